"""A few small layouts through the CUDA forward and backward, for compute-sanitizer (sanitize.sh)."""
import os
import sys

import torch

import dualkv


def main() -> int:
    dims = [int(d) for d in dualkv._native.build_info()["cuda"]["head_dims"]]
    plain = [int(d) for d in dualkv._native.build_info()["cuda"].get("plain_head_dims", [])]
    if os.environ.get("SAN_DIMS"):  # e.g. SAN_DIMS=128,256 to shorten a run
        dims = [d for d in dims if str(d) in os.environ["SAN_DIMS"].split(",")]
    cases = [
        ([130, 1, 64, 129], [-1, 0, 0, 0]),            # GRPO group, ragged tiles, 1-token response
        ([5, 70, 3, 1, 200], [-1, 0, 1, -1, 3]),        # depth 3 + a second tree
        ([1], [-1]),                                    # one token
        ([256, 128, 128], [-1, 0, 0]),                  # whole 128-row tiles: the window kernels' unpacked build
    ]
    # D 64's, D 128's and D 256's forwards have a long-walk build (fwd_kernel.cuh fwd_has_long_walk_kernel,
    # tile_size.h fwd_long_kv_walks), which these small layouts do not run: the second pass makes
    # every walk long.
    runs = [(D, long_walks) for D in dims for long_walks in ((False, True) if D in (64, 128, 256) else (False,))]
    for D, long_walks in runs:
        if long_walks:
            os.environ["DUALKV_CUDA_LONG_WALK_KEYS"] = "0"
        else:
            os.environ.pop("DUALKV_CUDA_LONG_WALK_KEYS", None)
        for lens, parents in cases:
            layout = dualkv.Layout.from_tree(lens, parents).to("cuda")
            T = layout.num_tokens
            for det in (False, True):
                q = torch.randn(T, 4, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn(T, 1, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                v = torch.randn(T, 1, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                out, lse = dualkv.attention(q, k, v, layout, deterministic=det, return_lse=True)
                (out.float().sum() + lse.sum()).backward()
                torch.cuda.synchronize()
                print(f"ok D={D} long_walks={long_walks} lens={lens} det={det} split={os.environ.get('DUALKV_CUDA_SPLIT_ROWS')}", flush=True)
            if D in plain:  # built without the mask-modifier kernels (head dim 512): refused by name
                continue
            # mask modifiers (issue 16), with sinks (the dsinks reduction): the softcap kernels, then
            # the sliding window (windowed walk, window apply, per-item distance biases)
            wlayout = dualkv.Layout.from_tree(lens, parents).to("cuda", windows=(48,))
            for lay, label, mods in ((layout, "softcap+sinks", dict(softcap=5.0)),
                                     (wlayout, "window=48+sinks", dict(window=48))):
                for det in (False, True):
                    q = torch.randn(T, 4, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    k = torch.randn(T, 1, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    v = torch.randn(T, 1, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    sinks = torch.randn(4, device="cuda", requires_grad=True)
                    out, lse = dualkv.attention(q, k, v, lay, deterministic=det, return_lse=True, sinks=sinks,
                                                **mods)
                    (out.float().sum() + lse.sum()).backward()
                    torch.cuda.synchronize()
                    print(f"ok {label} D={D} lens={lens} det={det}", flush=True)
        # Many items per CTA (the forward is persistent; the layouts above give a CTA one item or
        # none): 8 small groups x 32 query heads, at least 512 forward items, so every CTA hands
        # items over several times (the Q buffers in turn at D 64, docs/notes/2026-12-04-d64-fwd-q-double-buffer.md).
        # Forward only: the hand-over is the forward's.
        lens, parents = [], []
        for g in range(8):
            root = len(lens)
            lens += [1 + 37 * g, 1, 65, 130]
            parents += [-1, root, root, root]
        layout = dualkv.Layout.from_tree(lens, parents).to("cuda")
        T = layout.num_tokens
        mods_of = [("plain", {})] if D in plain else [("plain", {}), ("softcap", {"softcap": 5.0}),
                                                       ("window=48", {"window": 48})]
        for label, mods in mods_of:
            q = torch.randn(T, 32, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(T, 8, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            lay = dualkv.Layout.from_tree(lens, parents).to("cuda", windows=(48,)) if "window" in mods else layout
            dualkv.attention(q, k, v, lay, return_lse=True, **mods)
            torch.cuda.synchronize()
            print(f"ok many items {label} D={D} long_walks={long_walks}", flush=True)
        # External prefix segments (issue 17): a group whose 150-row prompt lives in the prefix
        # buffers (prefix 1; prefix 0, 3 rows, is unused), ragged responses, then an ordinary group.
        layout = dualkv.Layout.from_tree([0, 70, 1, 129, 5, 3], [-1, 0, 0, 0, -1, 4], [1, -1, -1, -1, -1, -1],
                                         [3, 150]).to("cuda")
        T, rows = layout.num_tokens, layout.num_prefix_rows
        for det in (False, True):
            q = torch.randn(T, 4, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(T, 1, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            pk, pv = (torch.randn(rows, 1, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                      for _ in range(2))
            out, lse = dualkv.attention(q, k, v, layout, prefix_k=pk, prefix_v=pv, deterministic=det, return_lse=True)
            (out.float().sum() + lse.sum()).backward()
            torch.cuda.synchronize()
            print(f"ok D={D} prefixed det={det} split={os.environ.get('DUALKV_CUDA_SPLIT_ROWS')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
