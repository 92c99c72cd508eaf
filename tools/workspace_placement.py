#!/usr/bin/env python3
"""Does the backward's time depend on where its workspace (the fp32 dQ accumulator) lies in memory?

    python3 tools/workspace_placement.py --case 8,16384,2048 --head-dim 256 [--buffers 6]
        [--offsets 0,4096,65536,1048576] [--rounds 5] [--out DIR]

The library asks for a backward workspace per call (the dQ accumulator [T, H, D] fp32 after the
work counters) and dualkv.ops allocates it from torch's caching allocator, so each call may get
another address. Here every forward + backward of bench/attention.py's `dualkv` method on one layout
runs with a workspace chosen by the tool, in rotating order over the rounds:
- `buf<i>`: --buffers separate allocations (different pages of device memory);
- `off<n>`: views at byte offset n of one more allocation (the same pages, other low address bits);
- `fresh`: the library's own way, a new torch.empty per call (the control).
Each call is timed by CUDA events. If a workspace keeps its time across rounds while the workspaces
differ (the medians spread far more than each one's rounds), the time depends on the placement; if
every workspace wanders between the same modes, it does not.

Why: on an H100 the D-256 backward main kernel ran in modes 1 : 1.33 : 2.0 on the same inputs
(session 39, N8 P16K R2K, the call's other kernels unchanged), and its dQ tiles are 64 rows x 1 KiB
at a 32 KiB stride in the accumulator (FA4's are contiguous): docs/notes/2026-12-04-device-queue.md
§0 item 6.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from types import SimpleNamespace

ROOT = pathlib.Path(__file__).absolute().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import dualkv  # noqa: E402
import provenance  # noqa: E402  (bench/)
from kernel_counters import built_methods  # noqa: E402  (tools/)

PAGE = 2 << 20  # 2 MiB: the granule of large device allocations


def summarize(times: dict[str, list[float]]) -> dict:
    """Per workspace the median, min and max ms; `between`: the largest median over the smallest;
    `within`: the largest max / min of one workspace's rounds."""
    per = {name: {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts), "ms": ts}
           for name, ts in times.items()}
    medians = [p["median_ms"] for p in per.values()]
    return {"workspaces": per, "between": max(medians) / min(medians),
            "within": max(p["max_ms"] / p["min_ms"] for p in per.values())}


class Placement:
    """dualkv.ops._workspace's stand-in: dualkv.ops asks the library for the backward's workspace size
    and allocates it (``library_workspace``); unless ``chosen`` is "fresh", the library then gets a
    view of the placement ``pool[chosen]`` of that size instead. ``size``: the last fresh request."""

    def __init__(self, library_workspace):
        self.library_workspace, self.size, self.chosen, self.pool = library_workspace, None, "fresh", {}

    def __call__(self, query, params, device):
        ws = self.library_workspace(query, params, device)
        if ws is None or getattr(query, "__name__", "") != "dualkv_bwd_workspace_size":
            return ws
        if self.chosen == "fresh":
            self.size = ws.numel()
            return ws
        view = self.pool[self.chosen][:ws.numel()]
        if view.numel() != ws.numel():
            raise RuntimeError(f"the backward's workspace grew from {self.size} to {ws.numel()} bytes")
        params.workspace = view.data_ptr()
        return view


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="8,16384,2048", help="a layout class name or N,P,R")
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--buffers", type=int, default=6, help="separate workspace allocations")
    ap.add_argument("--offsets", default="0,4096,65536,1048576",
                    help="byte offsets (multiples of 256) of views into one more allocation; '' for none")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="", help="a directory for workspace_placement.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    offsets = [int(v) for v in args.offsets.split(",") if v]
    if any(o % 256 for o in offsets):
        ap.error("--offsets must be multiples of 256 bytes")

    spec = SimpleNamespace(case=args.case, methods="dualkv", heads=args.heads, kv_heads=args.kv_heads,
                           head_dim=args.head_dim)
    _bench, _case, _name, setup, _fwd, fwdbwd = next(built_methods(spec))
    x = setup(17)

    library_workspace = dualkv.ops._workspace
    placement = Placement(library_workspace)
    dualkv.ops._workspace = placement
    try:
        fwdbwd(x)  # warm-up: plans, caches; learns the workspace size
        torch.cuda.synchronize()
        if placement.size is None:
            ap.error("the backward asked for no workspace (deterministic mode, or not the CUDA path)")
        size = placement.size
        for i in range(args.buffers):
            placement.pool[f"buf{i}"] = torch.empty(size, dtype=torch.uint8, device="cuda")
        if offsets:
            shared = torch.empty(size + max(offsets), dtype=torch.uint8, device="cuda")
            for o in offsets:
                placement.pool[f"off{o}"] = shared[o:]
        names = list(placement.pool) + ["fresh"]
        addresses = {n: placement.pool[n].data_ptr() for n in placement.pool}
        times = {n: [] for n in names}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for n in names:  # one untimed call per placement
            placement.chosen = n
            fwdbwd(x)
        torch.cuda.synchronize()
        for r in range(args.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:  # rotating order
                placement.chosen = n
                start.record()
                fwdbwd(x)
                end.record()
                end.synchronize()
                times[n].append(start.elapsed_time(end))
    finally:
        dualkv.ops._workspace = library_workspace

    result = {"env": provenance.record(provenance.git_state(), "cuda"), **summarize(times)}
    result.update(case=args.case, head_dim=args.head_dim, heads=args.heads, kv_heads=args.kv_heads,
                  rounds=args.rounds, workspace_bytes=size, addresses={n: hex(a) for n, a in addresses.items()})
    print(f"workspace placement: {args.case} D{args.head_dim} fwd+bwd, {args.rounds} rounds, workspace "
          f"{size / 2**30:.2f} GiB, {torch.cuda.get_device_name()}")
    for n, p in result["workspaces"].items():
        where = (f"{addresses[n]:#x} (mod 2 MiB {addresses[n] % PAGE:#x})" if n in addresses
                 else "a new torch.empty per call")
        print(f"  {n:>10}: median {p['median_ms']:8.2f} ms, min {p['min_ms']:8.2f}, max {p['max_ms']:8.2f}  {where}")
    print(f"  between workspaces (largest median / smallest): {result['between']:.3f}; within one workspace "
          f"(largest max / min): {result['within']:.3f}")
    if args.out:
        path = pathlib.Path(args.out) / "workspace_placement.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
