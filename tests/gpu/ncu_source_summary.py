"""Summarise an Nsight Compute SASS source page (CSV from `ncu -i R --page source --csv --print-source sass`).

Prints, for one kernel: the stall-reason split of all warp-state samples, the share of executed
instructions and of stall samples per opcode, the SASS in blocks of --block instructions (share of
samples, main opcodes, dominant stall reasons) and the --top instructions with the most samples.
Runs anywhere (no GPU): tests/gpu/bwd_ncu_device_run.sh calls it on the device with NCU_SOURCE=1,
and a CSV brought back can be read again here.

--regions "name:lo-hi;..." prints instead a table of named SASS line ranges (0-based data rows, both
ends included; the ranges of a kernel's step loop, read off --lines): per region its units, warp
instructions executed per step and main stall reasons. Units: the region's share of all the regions'
samples times --scale, so that two kernels whose sampling intervals differ (ncu picks one per kernel)
compare when --scale is each loop's time per step relative to the other's (e.g. 100 for the peer, 108
for a kernel 8% slower per step). Steps: --steps N, or --steps @LINE for the executed count of that
line (a loop branch's). --lines lo-hi lists the lines of a range with their share, instructions per
step and top reasons. (docs/notes/2026-12-05-bwd-ncu-per-step.md is read this way.)

    python3 tests/gpu/ncu_source_summary.py ncu_dualkv_sass.csv [--top 40] [--block 40]
    python3 tests/gpu/ncu_source_summary.py ncu_dualkv_sass.csv --steps @1056 --lines 275-1056
    python3 tests/gpu/ncu_source_summary.py ncu_dualkv_sass.csv --steps @1056 --scale 108 \
        --regions "top:275-295;S and dP issue:296-367;..."
"""
import argparse
import collections
import csv
import re
import sys


def num(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass):
    """`@!P3 IMAD.MOV.U32 R1, ...` -> `IMAD`."""
    text = re.sub(r"^@!?U?P\w+\s+", "", sass.strip())
    return text.split(" ")[0].split(".")[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--block", type=int, default=40)
    ap.add_argument("--min-block-share", type=float, default=0.4, help="hide blocks below this %% of samples")
    ap.add_argument("--regions", default="", help='"name:lo-hi;..." named line ranges (see above)')
    ap.add_argument("--lines", default="", help="lo-hi: list these lines")
    ap.add_argument("--steps", default="", help="loop steps (warp-steps): a number, or @LINE for its executed count")
    ap.add_argument("--scale", type=float, default=100.0, help="the regions' units in all (the loop's relative time)")
    a = ap.parse_args(argv)

    rows = list(csv.reader(open(a.csv, newline="")))
    head = next((i for i, r in enumerate(rows) if "Source" in r and "Address" in r), None)
    if head is None:
        print("no header row with 'Address' and 'Source'; first lines:", rows[:3])
        return 1
    cols = rows[head]
    data = [r for r in rows[head + 1:] if len(r) == len(cols)]
    ix = {c: i for i, c in enumerate(cols)}
    if "Warp Stall Sampling (All Samples)" not in ix:
        print("columns:", cols)
        return 1
    kernel = rows[0][1] if rows and len(rows[0]) > 1 else "?"
    samples = [num(r[ix["Warp Stall Sampling (All Samples)"]]) for r in data]
    executed = [num(r[ix.get("Instructions Executed", 0)]) for r in data]
    reasons = [c for c in cols if c.startswith("stall_") and "Not Issued" not in c]
    if a.regions or a.lines:
        return regions_view(a, data, ix, samples, executed, reasons)
    total = sum(samples) or 1.0
    total_exec = sum(executed) or 1.0
    print(f"kernel: {kernel[:110]}")
    print(f"{len(data)} SASS lines, {total:.0f} stall samples, {total_exec:.3g} warp instructions executed")

    by_reason = collections.Counter()
    for r in data:
        for c in reasons:
            by_reason[c] += num(r[ix[c]])
    print("stall reasons (share of samples): " +
          ", ".join(f"{c[6:]} {100 * v / total:.1f}%" for c, v in by_reason.most_common() if v / total >= 0.005))

    ex, smp = collections.Counter(), collections.Counter()
    for r, s, e in zip(data, samples, executed):
        op = opcode(r[ix["Source"]])
        ex[op] += e
        smp[op] += s
    print("opcode: executed % / samples %: " +
          ", ".join(f"{op} {100 * v / total_exec:.1f}/{100 * smp[op] / total:.1f}" for op, v in ex.most_common(16)))

    print(f"blocks of {a.block} instructions (>= {a.min_block_share}% of samples): first line, share, opcodes, reasons")
    for b in range(0, len(data), a.block):
        blk = range(b, min(b + a.block, len(data)))
        s = sum(samples[i] for i in blk)
        if 100 * s / total < a.min_block_share:
            continue
        ops = collections.Counter(opcode(data[i][ix["Source"]]) for i in blk)
        st = reason_sums(data, ix, reasons, blk)
        print(f"  {b:5d} {100 * s / total:5.1f}%  " + " ".join(f"{o}:{n}" for o, n in ops.most_common(4)) +
              "  | " + ", ".join(f"{c[6:]} {100 * v / (s or 1):.0f}%" for c, v in st.most_common(3)))

    print(f"top {a.top} instructions:")
    for i in sorted(range(len(data)), key=lambda i: -samples[i])[:a.top]:
        top = sorted(((num(data[i][ix[c]]), c) for c in reasons), reverse=True)[:2]
        print(f"  {i:5d} {100 * samples[i] / total:5.2f}%  {data[i][ix['Source']].strip()[:58]:58s}  " +
              ", ".join(f"{c[6:]} {v:.0f}" for v, c in top if v > 0))
    return 0


def reason_sums(data, ix, reasons, lines):
    """Stall samples per reason over the given SASS lines."""
    st = collections.Counter()
    for i in lines:
        for c in reasons:
            st[c] += num(data[i][ix[c]])
    return st


def line_range(text, n):
    """"lo-hi" (or one line "i") as (lo, hi), both inside the page's n SASS lines."""
    lo, _, hi = text.partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 0 <= lo <= hi < n:
        raise SystemExit(f"line range {text} is outside the page's {n} SASS lines")
    return lo, hi


def regions_view(a, data, ix, samples, executed, reasons):
    n = len(data)
    if a.steps.startswith("@"):
        steps = executed[line_range(a.steps[1:], n)[0]]
    else:
        steps = num(a.steps) if a.steps else 1.0
    steps = steps or 1.0

    def top_reasons(lines, unit):
        st = reason_sums(data, ix, reasons, lines)
        return " ".join(f"{c[6:]} {unit * v:.1f}" for c, v in st.most_common(3) if v > 0)

    if a.lines:
        lo, hi = line_range(a.lines, n)
        span = sum(samples[lo:hi + 1]) or 1.0
        print(f"lines {lo}-{hi}: {span:.0f} samples; per line: % of them, instructions per step, top reasons (%)")
        for i in range(lo, hi + 1):
            print(f"  {i:5d} {100 * samples[i] / span:6.2f} {executed[i] / steps:6.2f}  "
                  f"{data[i][ix['Source']].strip()[:64]:64s}  {top_reasons([i], 100 / span)}")
    if a.regions:
        spec = [part.rsplit(":", 1) for part in a.regions.split(";") if part.strip()]
        ranges = [(name.strip(), line_range(r, n)) for name, r in spec]
        total = sum(sum(samples[lo:hi + 1]) for _, (lo, hi) in ranges) or 1.0
        unit = a.scale / total
        print(f"regions ({a.scale:g} units in all; {steps:.0f} steps): units, instructions per step, top reasons (units)")
        for name, (lo, hi) in ranges:
            lines = range(lo, hi + 1)
            print(f"  {name[:34]:34s} {lo:5d}-{hi:<5d} {unit * sum(samples[i] for i in lines):6.1f} "
                  f"{sum(executed[i] for i in lines) / steps:7.1f}  {top_reasons(lines, unit)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
