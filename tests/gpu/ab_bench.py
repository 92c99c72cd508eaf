"""A/B of two libdualkv builds in ONE process, interleaved, with FlashAttention-2 beside them.

    PYTHONPATH=python python3 tests/gpu/ab_bench.py --base A/libdualkv.so --new B/libdualkv.so \
        [--head-dims D,D,...] [--paths hopper,portable] [--rounds 3] [--fa2] [--out DIR]

For every (head dim, path, config) of bench/attention.py (the issue's configs and the variable-length
micro-batch), each round times base, new (and, with --fa2, SDPA-flash on the unpacked batch) in a
rotated order, forward and forward+backward, through bench/attention.py's own methods and timer.
Both libraries are loaded side by side (bench/attention.py's Library: either may be an ABI-1 build such
as 72977b9's) and the dualkv package is pointed at one or the other around each call; each gets its own
layout (work plan). "portable" forces the sm80
kernels (DUALKV_DISABLE_SM90=1, DUALKV_DISABLE_SM90_BWD=1), "hopper" is the default dispatch.
Reported per config: the median of the rounds for each library, new/base time ratio per round
(median, and whether new was slower in every round), and dualkv/FA2 useful-FLOP rate. A head dim the
base library was not built for is timed for new (and FA2) only.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))
import attention as bench  # noqa: E402  bench/attention.py: Case, methods, time_fn
import provenance  # noqa: E402

PATH_ENV = {"hopper": {}, "portable": {"DUALKV_DISABLE_SM90": "1", "DUALKV_DISABLE_SM90_BWD": "1"}}


def set_path(path: str) -> None:
    for env in PATH_ENV.values():
        for k in env:
            os.environ.pop(k, None)
    os.environ.update(PATH_ENV[path])


def measure(fn_setup, args, sets_seed):
    setup, fwd, fwdbwd, pairs, _ = fn_setup()
    sets = [setup(1000 * i + sets_seed) for i in range(args.rotate)]
    # time_fn: (median ms, seconds of the first call)
    res = {"fwd_ms": bench.time_fn(fwd, sets, args.warmup, args.iters)[0],
           "fwdbwd_ms": bench.time_fn(fwdbwd, sets, args.warmup, args.iters)[0], "pairs": pairs}
    del sets
    torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--head-dims", default="", help="default: every head dim the new library was built for")
    ap.add_argument("--paths", default="hopper,portable")
    ap.add_argument("--configs", default="", help="N,P,R;... (default: bench/attention.py's list + varlen)")
    ap.add_argument("--no-varlen", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fa2", action="store_true", help="also time SDPA-flash (FA2) on the unpacked batch")
    ap.add_argument("--fa2-paths", default="portable", help="paths on which FA2 is timed")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rotate", type=int, default=2)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    libs = {"base": bench.Library.load(args.base), "new": bench.Library.load(args.new)}
    build_info = {k: lib.describe()["build"] for k, lib in libs.items()}
    base_dims = build_info["base"].get("cuda", {}).get("head_dims", [])
    new_dims = build_info["new"].get("cuda", {}).get("head_dims", [])
    head_dims = [int(d) for d in args.head_dims.split(",")] if args.head_dims else new_dims
    configs = ([tuple(int(x) for x in c.split(",")) for c in args.configs.split(";") if c] if args.configs
               else bench.DEFAULT_CONFIGS)
    cases = [bench.Case(f"N{n}_P{p}_R{r}", [p], [[r] * n]) for n, p, r in configs]
    if not args.no_varlen:
        cases.append(bench.Case(bench.VARLEN["name"], bench.VARLEN["prompts"], bench.VARLEN["responses"]))
    dtype = torch.bfloat16
    H, Hk = args.heads, args.kv_heads
    # bench/provenance.py's record (commit, dirty tree, GPU, versions, switches), as every benchmark's
    env = dict(provenance.record(provenance.git_state(), "cuda"), base=args.base, new=args.new, build_info=build_info)
    results = {"env": env,
               "shape": {"H": H, "Hk": Hk, "dtype": "bfloat16"}, "rounds": args.rounds, "rows": []}
    print(f"{'D':>4} {'path':8} {'config':18} {'fwd new/base':>13} {'f+b new/base':>13} "
          f"{'slower all':>10} {'fwd/FA2':>8} {'f+b/FA2':>8}", flush=True)
    for D in head_dims:
        for path in args.paths.split(","):
            set_path(path)
            # FA2 (SDPA's flash backend) has no kernel above head dim 256 (bench.HEAD_DIM_LIMITS)
            with_fa2 = args.fa2 and path in args.fa2_paths.split(",") and D <= bench.HEAD_DIM_LIMITS["sdpa_flash"]
            for case in cases:
                methods = (["base"] if D in base_dims else []) + ["new"] + (["fa2"] if with_fa2 else [])
                per = {m: [] for m in methods}
                for rnd in range(args.rounds):
                    order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
                    for m in order:
                        if m == "fa2":
                            per[m].append(measure(lambda: bench.method_sdpa(case, H, Hk, D, dtype, "flash"), args, 17))
                        else:
                            per[m].append(measure(lambda: bench.method_dualkv(case, H, Hk, D, dtype, libs[m]), args,
                                                  17))
                row = {"D": D, "path": path, "case": case.describe()}
                for m, rs in per.items():
                    row[m] = {k: [r[k] for r in rs] for k in ("fwd_ms", "fwdbwd_ms")}
                    row[m]["pairs"] = rs[0]["pairs"]
                for key in ("fwd_ms", "fwdbwd_ms"):
                    if "base" in row:
                        ratios = [n / b for n, b in zip(row["new"][key], row["base"][key])]
                        row[f"{key}_new_over_base"] = statistics.median(ratios)
                        row[f"{key}_new_slower_every_round"] = all(r > 1.0 for r in ratios)
                    if with_fa2:
                        # useful-FLOP rate ratio: (pairs / time) of dualkv over FA2's on its own batch
                        t_new = statistics.median(row["new"][key])
                        t_fa2 = statistics.median(row["fa2"][key])
                        row[f"{key}_rate_vs_fa2"] = (row["new"]["pairs"] / t_new) / (row["fa2"]["pairs"] / t_fa2)
                results["rows"].append(row)
                if "base" in row:
                    slower = row["fwd_ms_new_slower_every_round"] or row["fwdbwd_ms_new_slower_every_round"]
                    ab = f"{row['fwd_ms_new_over_base']:13.3f} {row['fwdbwd_ms_new_over_base']:13.3f} {str(slower):>10}"
                else:
                    ab = f"{'-':>13} {'-':>13} {'-':>10}"
                fa2 = (f"{row['fwd_ms_rate_vs_fa2']:8.3f} {row['fwdbwd_ms_rate_vs_fa2']:8.3f}" if with_fa2 else "")
                print(f"{D:>4} {path:8} {case.name:18} {ab} {fa2}", flush=True)
                if args.out:
                    out = pathlib.Path(args.out)
                    out.mkdir(parents=True, exist_ok=True)
                    (out / "ab_bench.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
