#!/usr/bin/env python3
"""Where a benchmark's per-call time goes: bench/attention.py's event-timed loop (``time_fn``)
beside the same loop under torch.profiler, for bench/attention.py's methods on one layout.

    python3 tools/event_vs_kernels.py --case long_responses --methods dualkv,fa4_dense \\
        --head-dim 64 --direction fwd,fwdbwd --reps 2

Per method, direction and repetition it prints the event median (what the benchmarks report), the
profiled kernels' time per call and their span per call (first kernel's start to last kernel's
end), the largest gaps between consecutive kernels, each kernel's median and total per call, and a
few calls timed with a synchronize before each. Event time well above the kernels' time with large
gaps means host time or idle GPU; event time at the kernels' time, with the kernels' own time
moving between repetitions, means the kernels ran slower (clocks: METHOD.md, the power limit).
Session 25 (2026-12-03) found the latter for the class runs' forward (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).absolute().parent))

import torch  # noqa: E402

from kernel_counters import built_methods  # noqa: E402


def summarize(kernels, calls: int) -> dict:
    """Kernels [(name, start_us, end_us)] of ``calls`` calls: the kernels' time per call (ms), their
    span per call (ms), the gaps between consecutive kernels (us, ascending) and per name the
    median duration (ms), count and total per call (ms)."""
    if calls <= 0 or not kernels:
        raise ValueError("summarize: needs at least one call and one kernel")
    ks = sorted(kernels, key=lambda k: k[1])
    busy = sum(end - start for _, start, end in ks)
    span = ks[-1][2] - ks[0][1]
    gaps = sorted(b[1] - a[2] for a, b in zip(ks, ks[1:]))
    by_name: dict[str, list[float]] = {}
    for name, start, end in ks:
        by_name.setdefault(name, []).append(end - start)
    return {"kernels_ms": busy / calls / 1e3, "span_ms": span / calls / 1e3, "gaps_us": gaps,
            "by_name": {n: {"median_ms": statistics.median(d) / 1e3, "count": len(d),
                            "per_call_ms": sum(d) / calls / 1e3} for n, d in by_name.items()}}


def profiled_kernels(fn, sets, calls: int):
    """[(name, start_us, end_us)] of the device kernels (and memsets) of ``calls`` calls of fn."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(sets[i % len(sets)])
        torch.cuda.synchronize()
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def synced_calls_ms(fn, sets, calls: int) -> list:
    """Event ms of each call with a synchronize before it (nothing queued ahead of the call)."""
    out = []
    for i in range(calls):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(sets[i % len(sets)])
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", required=True, help="a layout class name or N,P,R")
    ap.add_argument("--methods", default="dualkv", help="comma-separated bench/attention.py methods")
    ap.add_argument("--direction", default="fwd,fwdbwd", help="fwd, fwdbwd or both, comma-separated")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10, help="calls per timed loop (bench/attention.py's default)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of the event loop and the profiled loop")
    args = ap.parse_args(argv)
    directions = args.direction.split(",")
    if any(d not in ("fwd", "fwdbwd") for d in directions):
        ap.error(f"--direction: fwd and/or fwdbwd, got {args.direction!r}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")

    for bench, case, name, setup, fwd, fwdbwd in built_methods(args):
        sets = [setup(1), setup(2)]  # two input sets rotated, as bench/attention.py's --rotate default
        for direction in directions:
            fn = fwd if direction == "fwd" else fwdbwd
            for rep in range(args.reps):
                event_ms, _first_s = bench.time_fn(fn, sets, 3, args.iters)
                s = summarize(profiled_kernels(fn, sets, args.iters), args.iters)
                print(f"{name} D{args.head_dim} {case.name} {direction} rep {rep}: event median {event_ms:.3f} ms; "
                      f"kernels {s['kernels_ms']:.3f} ms/call, span {s['span_ms']:.3f} ms/call; largest gaps us "
                      f"{[round(g, 1) for g in s['gaps_us'][-5:]]}", flush=True)
                for kname, k in s["by_name"].items():
                    print(f"    {kname[:70]:70s} n={k['count']:3d} median {k['median_ms']:.3f} ms, "
                          f"{k['per_call_ms']:.3f} ms/call")
                print(f"    calls after a synchronize, ms: {[round(t, 3) for t in synced_calls_ms(fn, sets, 6)]}",
                      flush=True)
        del sets
    return 0


if __name__ == "__main__":
    sys.exit(main())
