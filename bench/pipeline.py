#!/usr/bin/env python
"""Benchmark of the GRPO data pipeline: pack() and response_logprobs().

(a) pack() of a veRL-style padded batch (default: 16 groups x 16 rows, P ~ 4K, R ~ 1K, rows of
    the groups interleaved) against a straightforward per-sequence Python loop doing the same job
    (lengths per row with .item(), prompt check with torch.equal, slicing, cat, layout).
(b) response_logprobs() on that batch with V = 151,936 and hidden 2048 in bf16: forward (no grad)
    and forward + backward, time and peak memory above the inputs, compared with the size of one
    chunk of fp32 logits.

    PYTHONPATH=python python bench/pipeline.py                      # CUDA, full size
    PYTHONPATH=python python bench/pipeline.py --device cpu --small # quick CPU check

Prints a table and writes JSON to --out (default bench/results/pipeline.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

try:
    import dualkv  # noqa: F401
except Exception:  # the script also runs from a checkout without PYTHONPATH
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dualkv.logprobs as logprobs_mod  # noqa: E402
import provenance  # noqa: E402
from dualkv.layout import Layout  # noqa: E402
from dualkv.logprobs import response_logprobs  # noqa: E402
from dualkv.packing import pack  # noqa: E402


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def make_batch(groups: int, per_group: int, p_mean: int, r_mean: int, vocab: int, device, seed=0):
    """veRL-style padded batch with interleaved groups: (input_ids, attention_mask, response_mask, uid)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    P = [rng.randint(int(p_mean * 0.875), int(p_mean * 1.125)) for _ in range(groups)]
    rows = [(k, i) for k in range(groups) for i in range(per_group)]
    rng.shuffle(rows)
    R = [rng.randint(max(1, r_mean // 2), r_mean * 3 // 2) for _ in rows]
    Lp, Lr = max(P), max(R)
    B = len(rows)
    prompts = [torch.randint(0, vocab, (p,), generator=g) for p in P]
    ids = torch.zeros(B, Lp + Lr, dtype=torch.int64)
    am = torch.zeros(B, Lp + Lr, dtype=torch.int64)
    resp = torch.randint(0, vocab, (B, Lr), generator=g)
    for b, (k, _) in enumerate(rows):  # building the benchmark input, not timed
        ids[b, Lp - P[k]:Lp] = prompts[k]
        ids[b, Lp:Lp + R[b]] = resp[b, :R[b]]
        am[b, Lp - P[k]:Lp + R[b]] = 1
    uid = [f"prompt-{k}" for k, _ in rows]
    return ids.to(device), am.to(device), am[:, Lp:].clone().to(device), uid


# --------------------------------------------------------------------------------------------
# Baseline: the straightforward per-sequence loop
# --------------------------------------------------------------------------------------------


def pack_loop(input_ids, attention_mask, response_mask, uid):
    """Per-row Python loop with host syncs; returns (packed ids [1, T], layout on device)."""
    dev = input_ids.device
    Lr = response_mask.shape[1]
    Lp = input_ids.shape[1] - Lr
    groups = {}
    order = []
    for b in range(input_ids.shape[0]):
        plen = int(attention_mask[b, :Lp].sum().item())
        rlen = int(response_mask[b].sum().item())
        prompt = input_ids[b, Lp - plen:Lp]
        key = uid[b]
        if key not in groups:
            groups[key] = (prompt, [])
            order.append(key)
        elif not torch.equal(groups[key][0], prompt):
            raise ValueError(f"row {b}: prompt differs from its group")
        groups[key][1].append(input_ids[b, Lp:Lp + rlen])
    pieces, prompt_lens, response_lens = [], [], []
    for key in order:
        prompt, rs = groups[key]
        pieces.append(prompt)
        pieces.extend(rs)
        prompt_lens.append(prompt.numel())
        response_lens.append([r.numel() for r in rs])
    ids = torch.cat(pieces).unsqueeze(0)
    layout = Layout.from_groups(prompt_lens, response_lens).to(dev)
    pos = []
    for p, rl in zip(prompt_lens, response_lens):
        pos.append(torch.arange(p, device=dev))
        pos.extend(torch.arange(p, p + r, device=dev) for r in rl)
    return ids, torch.cat(pos).unsqueeze(0), layout


# --------------------------------------------------------------------------------------------
# Timing helpers
# --------------------------------------------------------------------------------------------


def timed(fn, device, repeats: int, warmup: int = 2):
    """Median / min milliseconds of fn() (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = device.type == "cuda"
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "repeats": repeats}


def peak_delta(fn, device):
    """(result, peak bytes allocated above what was allocated before fn) on CUDA, else (result, None)."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - base


def gib(x):
    return None if x is None else x / 2**30


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--response-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--chunk-sizes", default="auto,2048",
                    help="comma-separated chunk sizes for response_logprobs ('auto' = the default)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                    help="hidden / lm-head dtype (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--skip-logprobs", action="store_true")
    ap.add_argument("--out", default=os.path.join("bench", "results", "pipeline.json"))
    ap.add_argument("--allow-dirty", action="store_true", help="measure a tree that is not a commit (marked dirty)")
    args = ap.parse_args()
    tree = provenance.measured_state(args.device, args.allow_dirty)
    if args.small:
        args.groups, args.per_group, args.prompt_len, args.response_len = 4, 4, 64, 16
        args.vocab, args.hidden, args.chunk_sizes = 1000, 64, "auto,7"
        args.repeats = min(args.repeats, 3)
    device = torch.device(args.device)
    if device.type == "cuda":
        # torch < 2.12 rejects set_device("cuda") without an index
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    results = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "env": dict(provenance.record(tree, device),
                    device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()),
    }

    # ---- (a) pack ------------------------------------------------------------------------------
    ids, am, rm, uid = make_batch(args.groups, args.per_group, args.prompt_len, args.response_len,
                                  min(args.vocab, 32000), device)
    pb = pack(input_ids=ids, attention_mask=am, response_mask=rm, uid=uid)
    ref_ids, ref_pos, ref_layout = pack_loop(ids, am, rm, uid)
    same = (torch.equal(pb.input_ids, ref_ids) and torch.equal(pb.position_ids, ref_pos)
            and torch.equal(pb.layout.seg_offsets.cpu(), ref_layout.seg_offsets.cpu()))
    pack_res = {
        "rows": ids.shape[0], "padded_shape": list(ids.shape), "packed_tokens": pb.num_tokens,
        "unpacked_tokens": int(round(pb.rho * pb.num_tokens)), "rho": pb.rho, "matches_loop": bool(same),
        "pack_uid": timed(lambda: pack(input_ids=ids, attention_mask=am, response_mask=rm, uid=uid),
                          device, args.repeats),
        "pack_no_uid_hash": timed(lambda: pack(input_ids=ids, attention_mask=am, response_mask=rm),
                                  device, args.repeats),
        "python_loop": timed(lambda: pack_loop(ids, am, rm, uid), device, max(3, args.repeats // 2)),
        "layout_only": timed(lambda: Layout.from_groups(
            list(pb.group_prompt_lens), [list(r) for r in (g[1] for g in pb.groups())]).to(device),
            device, args.repeats),
    }
    pack_res["speedup_vs_loop"] = pack_res["python_loop"]["median_ms"] / pack_res["pack_uid"]["median_ms"]
    results["pack"] = pack_res

    # ---- (b) response log-probs ------------------------------------------------------------------
    if not args.skip_logprobs:
        dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
        gen = torch.Generator(device=device).manual_seed(0)
        T, H, V = pb.num_tokens, args.hidden, args.vocab
        hidden = torch.randn(T, H, device=device, dtype=dtype, generator=gen)
        weight = (torch.randn(V, H, device=device, dtype=dtype, generator=gen) * H ** -0.5)
        adv = torch.randn(pb.num_rows, pb.max_response_len, device=device, generator=gen)
        S = pb.num_groups + sum(pb.row_response_lens) - pb.num_rows
        lp_res = {"tokens": T, "selected_rows": S, "vocab": V, "hidden": H, "dtype": str(dtype),
                  "full_selected_logits_fp32_gib": gib(S * V * 4), "full_packed_logits_fp32_gib": gib(T * V * 4),
                  "runs": []}
        # correctness spot check of two rows against a direct fp32 computation
        with torch.no_grad():
            lp = response_logprobs(hidden, weight, pb)
            errs = []
            for b in (0, pb.num_rows - 1):
                off, R = int(pb.response_offsets[b]), int(pb.response_lens[b])
                pos = torch.cat([pb.prompt_last_index[b:b + 1], torch.arange(off, off + R - 1, device=device)])
                z = hidden[pos].float() @ weight.float().t()
                ref = torch.log_softmax(z, -1).gather(1, pb.input_ids[0, off:off + R, None])[:, 0]
                errs.append(float((lp[b, :R] - ref).abs().max()))
            lp_res["spot_check_max_abs_err"] = max(errs)
        del lp
        flops_fwd = 2.0 * S * V * H
        for cs in args.chunk_sizes.split(","):
            chunk = None if cs.strip() == "auto" else int(cs)
            eff = chunk if chunk is not None else max(16, min(8192, logprobs_mod._AUTO_CHUNK_ELEMS // V))
            run = {"chunk_size": eff, "chunk_logits_fp32_gib": gib(eff * V * 4)}

            def fwd():
                with torch.no_grad():
                    return response_logprobs(hidden, weight, pb, chunk_size=chunk)

            _, run["fwd_peak_gib"] = peak_delta(fwd, device)
            run["fwd"] = timed(fwd, device, args.repeats)
            run["fwd_tflops"] = flops_fwd / run["fwd"]["median_ms"] / 1e9

            h = hidden.detach().requires_grad_()
            w = weight.detach().requires_grad_()

            def fwd_bwd():
                lp = response_logprobs(h, w, pb, chunk_size=chunk)
                (lp * adv).sum().backward()
                h.grad = None
                w.grad = None

            def fwd_bwd_ent():
                lp, ent = response_logprobs(h, w, pb, chunk_size=chunk, entropy=True)
                ((lp * adv).sum() + 1e-3 * ent.sum()).backward()
                h.grad = None
                w.grad = None

            _, run["fwd_bwd_peak_gib"] = peak_delta(fwd_bwd, device)
            run["fwd_bwd"] = timed(fwd_bwd, device, max(2, args.repeats // 2))
            run["fwd_bwd_tflops"] = 4 * flops_fwd / run["fwd_bwd"]["median_ms"] / 1e9  # fwd + recompute + 2 GEMMs
            _, run["fwd_bwd_entropy_peak_gib"] = peak_delta(fwd_bwd_ent, device)
            run["fwd_bwd_entropy"] = timed(fwd_bwd_ent, device, max(2, args.repeats // 2))
            # what backward must hold anyway: d hidden (T x H, input dtype), fp32 weight-grad accumulator and
            # the weight grad itself
            esz = torch.empty((), dtype=dtype).element_size()
            run["grad_buffers_gib"] = gib(T * H * esz + V * H * 4 + V * H * esz)
            lp_res["runs"].append(run)
            del h, w
        lp_res["out_dtype_gemm_ok"] = {f"{op}/{d}": ok for (op, d), ok in logprobs_mod._OUT_DTYPE_OK.items()}
        results["logprobs"] = lp_res

    # ---- report ------------------------------------------------------------------------------
    p = results["pack"]
    print(f"pack: {p['rows']} rows {p['padded_shape']} -> {p['packed_tokens']} packed tokens "
          f"(rho {p['rho']:.2f}), matches loop: {p['matches_loop']}")
    print(f"  {'variant':28s} {'median ms':>10s} {'min ms':>10s}")
    for k in ("pack_uid", "pack_no_uid_hash", "python_loop", "layout_only"):
        print(f"  {k:28s} {p[k]['median_ms']:10.3f} {p[k]['min_ms']:10.3f}")
    print(f"  speedup vs loop: {p['speedup_vs_loop']:.1f}x")
    if "logprobs" in results:
        lr = results["logprobs"]
        print(f"response_logprobs: T={lr['tokens']} selected={lr['selected_rows']} V={lr['vocab']} H={lr['hidden']} "
              f"{lr['dtype']}; spot-check err {lr['spot_check_max_abs_err']:.2e}; full selected fp32 logits would be "
              f"{lr['full_selected_logits_fp32_gib']:.1f} GiB")
        hdr = (f"  {'chunk':>6s} {'chunk GiB':>9s} {'fwd ms':>9s} {'fwd TF/s':>8s} {'fwd peak':>9s} "
               f"{'f+b ms':>9s} {'f+b TF/s':>8s} {'f+b peak':>9s} {'f+b+ent ms':>10s} {'grads GiB':>9s}")
        print(hdr)
        for r in lr["runs"]:
            fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
            print(f"  {r['chunk_size']:6d} {r['chunk_logits_fp32_gib']:9.3f} {r['fwd']['median_ms']:9.2f} "
                  f"{r['fwd_tflops']:8.1f} {fmt(r['fwd_peak_gib']):>9s} {r['fwd_bwd']['median_ms']:9.2f} "
                  f"{r['fwd_bwd_tflops']:8.1f} {fmt(r['fwd_bwd_peak_gib']):>9s} "
                  f"{r['fwd_bwd_entropy']['median_ms']:10.2f} {r['grad_buffers_gib']:9.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
