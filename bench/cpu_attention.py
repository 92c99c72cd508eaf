"""CPU attention benchmark: dualkv's CPU backend against PyTorch's CPU SDPA, side by side in one process.

  dualkv  the packed layout ([P | R_1 | ... | R_N] per group, or a forest), one dualkv.attention call
  sdpa    the unpacked rows the way a user would run them: one F.scaled_dot_product_attention(is_causal=True)
          call per row (prompt + response), no padding, so SDPA never computes a padded pair

Rate = useful (query, key) pairs per second, each method credited with the pairs of its own layout
(the unpacked rows hold N copies of every prompt's pairs, so the rate compares the kernels, not the
packing). Per case, dtype, head dim and direction (forward; forward + backward), the two methods run
in interleaved rounds; the median round is reported with the ratio dualkv / sdpa, by wall clock and
by process CPU time (all threads; the steadier of the two on a machine other processes share). Both
use torch.get_num_threads() threads (--threads).

  PYTHONPATH=python DUALKV_LIBRARY=build/libdualkv.so python3 bench/cpu_attention.py [--quick] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))
import dualkv  # noqa: E402
import provenance  # noqa: E402
from layout_classes import root_paths  # noqa: E402

# (name, segment lengths, parents): GRPO groups, a plain varlen batch, and a multi-turn tree.
CASES = [
    ("grpo_p512_n4_r128", *[[512, 128, 128, 128, 128], [-1, 0, 0, 0, 0]]),
    ("grpo_2groups_varied", *[[384, 96, 200, 31, 160, 700, 64, 250, 120],
                              [-1, 0, 0, 0, 0, -1, 5, 5, 5]]),
    ("varlen_4seq", *[[200, 333, 150, 417], [-1, -1, -1, -1]]),
    ("tree_depth3", *[[256, 64, 96, 80, 128, 48, 112], [-1, 0, 1, 1, 0, 4, 4]]),
]
QUICK_CASES = CASES[:1]


def median_seconds(fn, reps, min_seconds=0.05):
    """Median wall-clock and process CPU seconds (all threads) per call over `reps` samples; a sample
    repeats fn until it has run at least `min_seconds` (millisecond calls are timed in batches)."""
    t0 = time.perf_counter()
    fn()
    calls = max(1, int(min_seconds / max(time.perf_counter() - t0, 1e-6)) + 1)
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            fn()
        wall.append((time.perf_counter() - t0) / calls)
        cpu.append((time.process_time() - c0) / calls)
    return statistics.median(wall), statistics.median(cpu)


def run_case(name, lens, parents, dtype, D, H, rounds, reps):
    layout = dualkv.Layout.from_tree(lens, parents)
    rows = root_paths(lens, parents)
    g = torch.Generator().manual_seed(0)
    T = layout.num_tokens
    q, k, v, dout = (torch.randn(T, H, D, generator=g).to(dtype) for _ in range(4))
    unpacked = [tuple(torch.randn(1, H, n, D, generator=g).to(dtype) for _ in range(4)) for n in rows]
    packed_pairs = layout.visible_pairs * H
    unpacked_pairs = sum(n * (n + 1) // 2 for n in rows) * H

    def dualkv_fwd():
        with torch.no_grad():
            dualkv.attention(q, k, v, layout)

    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def dualkv_fwd_bwd():
        dualkv.attention(qg, kg, vg, layout).backward(dout)
        qg.grad = kg.grad = vg.grad = None

    def sdpa_fwd():
        with torch.no_grad():
            for a, b, c, _ in unpacked:
                F.scaled_dot_product_attention(a, b, c, is_causal=True)

    grads = [tuple(x.clone().requires_grad_() for x in row[:3]) + (row[3],) for row in unpacked]

    def sdpa_fwd_bwd():
        for a, b, c, d in grads:
            F.scaled_dot_product_attention(a, b, c, is_causal=True).backward(d)
            a.grad = b.grad = c.grad = None

    results = []
    for direction, fns in (("fwd", (dualkv_fwd, sdpa_fwd)), ("fwd_bwd", (dualkv_fwd_bwd, sdpa_fwd_bwd))):
        for fn in fns:
            fn()  # warm-up
        rounds_d, rounds_s = [], []
        for _ in range(rounds):
            rounds_d.append(median_seconds(fns[0], reps))
            rounds_s.append(median_seconds(fns[1], reps))
        (t_d, c_d), (t_s, c_s) = ([statistics.median(x) for x in zip(*r)] for r in (rounds_d, rounds_s))
        results.append({"case": name, "dtype": str(dtype).replace("torch.", ""), "head_dim": D, "heads": H,
                        "direction": direction, "dualkv_seconds": t_d, "sdpa_seconds": t_s,
                        "dualkv_cpu_seconds": c_d, "sdpa_cpu_seconds": c_s,
                        "dualkv_pairs": packed_pairs, "sdpa_pairs": unpacked_pairs,
                        "dualkv_mpairs_per_s": packed_pairs / t_d / 1e6, "sdpa_mpairs_per_s": unpacked_pairs / t_s / 1e6,
                        "rate_ratio": (packed_pairs / t_d) / (unpacked_pairs / t_s),
                        "cpu_rate_ratio": (packed_pairs / c_d) / (unpacked_pairs / c_s), "wall_ratio": t_s / t_d,
                        "rounds_dualkv": rounds_d, "rounds_sdpa": rounds_s})
        r = results[-1]
        print(f"{name:<20} {r['dtype']:<8} D{D:<4} {direction:<8} dualkv {r['dualkv_mpairs_per_s']:7.1f}  "
              f"sdpa {r['sdpa_mpairs_per_s']:7.1f} Mpairs/s  ratio {r['rate_ratio']:.2f}x (CPU time "
              f"{r['cpu_rate_ratio']:.2f}x)  wall {t_d * 1e3:.0f} vs {t_s * 1e3:.0f} ms", flush=True)
    return results


def cpu_model():
    """The CPU's model name (/proc/cpuinfo), or None."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def environment(tree):
    """bench/provenance.py's record (commit, clean tree, command, date, packages, the libdualkv file and
    its build info, environment switches such as DUALKV_CPU_ISA) and the machine: CPU model, cores,
    threads used."""
    model = cpu_model()
    return dict(provenance.record(tree), device=f"{model}, {torch.get_num_threads()} threads", cpu_model=model,
                cpu_count=os.cpu_count(), threads=torch.get_num_threads(), build_info=dualkv.build_info())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one case, fp32 and bf16, D 64 and 128, 1 round")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per measurement (median reported)")
    ap.add_argument("--reps", type=int, default=3, help="samples per round (median); a sample is >= 50 ms of calls")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--allow-dirty", action="store_true", help="measure a tree that is not a commit (recorded)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cases, rounds = (QUICK_CASES, 1) if args.quick else (CASES, args.rounds)
    tree = provenance.git_state()
    provenance.check_tree(tree, args.allow_dirty)
    info = environment(tree)
    print(f"dualkv CPU backend ({info['build_info']['cpu']['isa']}) vs torch {torch.__version__} SDPA, "
          f"{torch.get_num_threads()} threads, {info['cpu_model']}", flush=True)
    results = []
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for D in (int(x) for x in args.head_dims.split(",")):
            for name, lens, parents in cases:
                results.extend(run_case(name, lens, parents, dtype, D, args.heads, rounds, args.reps))
    worst = min(results, key=lambda r: r["rate_ratio"])
    print(f"lowest rate ratio (dualkv / sdpa per useful pair): {worst['rate_ratio']:.2f}x wall clock "
          f"({worst['case']} {worst['dtype']} D{worst['head_dim']} {worst['direction']}); lowest by CPU time "
          f"{min(r['cpu_rate_ratio'] for r in results):.2f}x")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"provenance": info, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
