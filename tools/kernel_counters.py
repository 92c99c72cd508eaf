#!/usr/bin/env python3
"""One call of bench/attention.py's methods on one layout, bracketed for Nsight Compute: every
method is warmed up first, then exactly one forward (or forward + backward) per method runs
between cudaProfilerStart / Stop, so `ncu --profile-from-start off` sees only those kernels, the
same kernels bench/attention.py times. Use it to put hardware counters (SM clock, tensor-pipe
activity, stall reasons) of dualkv's kernels beside a peer's on the same layout, e.g.

  ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
      --section ComputeWorkloadAnalysis --section WarpStateStats --csv --page details \\
      python3 tools/kernel_counters.py --case long_responses --methods dualkv,fa4_dense --direction fwdbwd

(METHOD.md: leave the clocks alone, hence --clock-control none.) A marker line on stdout before each
method's profiled call says which kernels that follow belong to which method.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).absolute().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402


def _bench_module(name: str):
    """bench/<name>.py from its file (as tools/ab_libraries.py loads it)."""
    spec = importlib.util.spec_from_file_location(f"dualkv_bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case_of(bench, text: str):
    """A layout class name (bench/layout_classes.py) or one aligned GRPO group N,P,R."""
    if text in bench.layout_classes.CLASSES:
        return bench.Case(text, *bench.layout_classes.layout_class(text))
    n, p, r = (int(v) for v in text.split(","))
    return bench.Case.groups(f"N{n}_P{p}_R{r}", [p], [[r] * n])


def built_methods(args):
    """bench/attention.py's methods args.methods on layout args.case (args.heads, args.kv_heads,
    args.head_dim; bf16), one at a time: (bench module, case, name, setup, fwd, fwdbwd)."""
    bench = _bench_module("attention")
    case = case_of(bench, args.case)
    libraries = {"dualkv": bench.Library.default()}
    for name in args.methods.split(","):
        setup, fwd, fwdbwd, _pairs, _extras = bench.build_method(
            name, case, args.heads, args.kv_heads, args.head_dim, torch.bfloat16, libraries)
        yield bench, case, name, setup, fwd, fwdbwd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", required=True, help="a layout class name or N,P,R")
    ap.add_argument("--methods", default="dualkv", help="comma-separated bench/attention.py methods")
    ap.add_argument("--direction", choices=("fwd", "fwdbwd"), default="fwdbwd")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")

    for _bench, case, name, setup, fwd, fwdbwd in built_methods(args):
        fn = fwd if args.direction == "fwd" else fwdbwd
        x = setup(17)
        for _ in range(args.warmup):  # compiles, plans, caches: outside the profiled range
            fn(x)
        torch.cuda.synchronize()
        print(f"== profiled: {name} {args.direction} on {case.name} (D {args.head_dim})", flush=True)
        torch.cuda.profiler.start()
        fn(x)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        del x
    return 0


if __name__ == "__main__":
    sys.exit(main())
