#!/usr/bin/env python3
"""Per-step timeline of the Hopper backward (diagnostic, branch tl: the dQ writer of every CTA stamps
each step with %globaltimer when its dQ tile is ready, into a buffer the launcher takes from
DUALKV_TIMELINE_PTR / DUALKV_TIMELINE_CAP).

Question (docs/notes/2026-12-05-bwd-timeline.md): do CTAs walking the same query rows fall into step
(a convoy: several CTAs on one (head, query tile) at the same time, their dQ reduce-adds meeting on the
same lines) in the slow runs, and more with the producer's loads first at 64-row steps?

Per run: the backward's span (first stamp to last CTA end), step durations, and per step how many
other CTAs had a step on the same (head, query tile) overlapping it in time ("overlaps"), and the
time to the nearest other CTA's step on that tile ("lag", in units of the step's own duration).
Libraries interleave per round in one process (tools/ab_libraries.Build).

Run: PYTHONPATH=python python tools/bwd_timeline.py --lib main=a.so --lib ldg=b.so
         --cases "128:64,1024,512;256:8,16384,2048" --rounds 6 --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import ab_libraries  # noqa: E402

import dualkv  # noqa: E402

BIG = 1 << 31  # > any span in ns (2.1 s)


def analyze(arr: np.ndarray, cap: int) -> dict:
    ends = arr[:, cap - 1, 0].astype(np.int64)
    nsteps = arr[:, cap - 1, 1].astype(np.int64)
    starts, durs, keys, ctas = [], [], [], []
    for c in range(arr.shape[0]):
        n = int(nsteps[c])
        if n == 0 or ends[c] == 0:
            continue
        n = min(n, cap - 1)
        t = arr[c, :n, 0].astype(np.int64)
        meta = arr[c, :n, 1].astype(np.int64)
        qt = (meta >> 8) & 0xFFFFFF
        h = meta & 0xFF
        starts.append(t)
        durs.append(np.diff(np.append(t, ends[c])))
        keys.append(h * (1 << 24) + qt)
        ctas.append(np.full(n, c))
    s = np.concatenate(starts)
    d = np.concatenate(durs)
    k = np.concatenate(keys)
    t0 = s.min()
    s = s - t0
    e = s + np.maximum(d, 1)
    span = int(max(ends[ends > 0]) - t0)
    _, kid = np.unique(k, return_inverse=True)
    sc, ec = kid * BIG + s, kid * BIG + e
    S, E = np.sort(sc), np.sort(ec)
    over = np.searchsorted(S, ec, "left") - np.searchsorted(E, sc, "right") - 1
    order = np.argsort(sc, kind="stable")
    so, ko = sc[order], kid[order]
    gap = np.full(len(so), np.iinfo(np.int64).max)
    same = ko[1:] == ko[:-1]
    dd = so[1:] - so[:-1]
    gap[1:] = np.where(same, dd, gap[1:])
    gap[:-1] = np.minimum(gap[:-1], np.where(same, dd, np.iinfo(np.int64).max))
    lag = np.empty_like(gap)
    lag[order] = gap
    # the first CTA on each (head, query tile): its Q / dO come from HBM, the later ones' from L2
    first_o = np.ones(len(so), bool)
    first_o[1:] = ~same
    first = np.empty_like(first_o)
    first[order] = first_o
    has = lag < np.iinfo(np.int64).max
    rel = lag[has] / np.maximum(d[has], 1)
    bins = np.minimum((s * 10) // max(span, 1), 9)
    by_bin = [float(over[bins == b].mean()) if np.any(bins == b) else 0.0 for b in range(10)]
    dur0 = d[over == 0]
    dur2 = d[over >= 2]
    return dict(span_ms=span / 1e6, steps=int(len(s)), ctas=int(len(starts)),
                dur_us_mean=float(d.mean() / 1e3), dur_us_median=float(np.median(d) / 1e3),
                overlaps_mean=float(over.mean()), overlaps_ge1=float((over >= 1).mean()),
                overlaps_ge3=float((over >= 3).mean()),
                lag_rel_median=float(np.median(rel)) if len(rel) else None,
                lag_lt_quarter=float((rel < 0.25).mean()) if len(rel) else None,
                dur_us_no_overlap=float(dur0.mean() / 1e3) if len(dur0) else None,
                dur_us_overlap2=float(dur2.mean() / 1e3) if len(dur2) else None,
                overlaps_by_tenth=[round(x, 3) for x in by_bin],
                first_touch=float(first.mean()), dur_us_first=float(d[first].mean() / 1e3),
                dur_us_later=float(d[~first].mean() / 1e3) if np.any(~first) else None,
                cta_end_ms_min=float((ends[ends > 0].min() - t0) / 1e6))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", action="append", required=True, help="label=path (repeat)")
    ap.add_argument("--cases", default="128:64,1024,512;256:8,16384,2048;128:8,16384,2048",
                    help="D:N,P,R separated by ';'")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--cap", type=int, default=40000, help="stamps per CTA (+1 for its end)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--raw-max-steps", type=int, default=400000, help="save raw events of runs up to this size")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    builds = [ab_libraries.Build(lbl, path, {}) for lbl, path in (x.split("=", 1) for x in args.lib)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.zeros(sms * args.cap * 2, dtype=torch.int64, device="cuda")
    print(f"bwd_timeline: device {torch.cuda.get_device_name(0)}, {sms} SMs, libraries "
          + ", ".join(f"{b.label}={b.path.name}" for b in builds), flush=True)
    results = []
    cases = []
    for c in args.cases.split(";"):
        dtxt, g = c.split(":")
        n, p, r = map(int, g.split(","))
        cases.append((int(dtxt), n, p, r))
    for D, N, P, R in cases:
        layout_cpu = dualkv.Layout.from_groups([P], [[R] * N])
        T = layout_cpu.num_tokens
        gen = torch.Generator(device="cuda").manual_seed(D * 1000 + N)
        q = torch.randn(T, args.heads, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(T, args.kv_heads, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(T, args.kv_heads, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        dout = torch.randn(T, args.heads, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        name = f"D{D} N{N} P{P} R{R}"

        def step(b, layout):
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            with b.active():
                o = dualkv.attention(*leaves, layout)
                o.backward(dout)

        layouts = {}
        for b in builds:
            with b.active():
                layouts[b.label] = layout_cpu.to("cuda")
            step(b, layouts[b.label])  # warm-up
        torch.cuda.synchronize()
        for rnd in range(args.rounds):
            for b in builds:
                # timeline off: the step's wall time by events
                ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev0.record()
                step(b, layouts[b.label])
                ev1.record()
                torch.cuda.synchronize()
                off_ms = ev0.elapsed_time(ev1)
                # timeline on
                buf.zero_()
                os.environ["DUALKV_TIMELINE_PTR"] = str(buf.data_ptr())
                os.environ["DUALKV_TIMELINE_CAP"] = str(args.cap)
                try:
                    step(b, layouts[b.label])
                    torch.cuda.synchronize()
                finally:
                    os.environ.pop("DUALKV_TIMELINE_PTR", None)
                    os.environ.pop("DUALKV_TIMELINE_CAP", None)
                arr = buf.view(sms, args.cap, 2).cpu().numpy()
                res = analyze(arr, args.cap)
                res.update(lib=b.label, case=name, round=rnd, fwd_bwd_off_ms=off_ms)
                results.append(res)
                print(f"{name} {b.label} r{rnd}: f+b off {off_ms:.2f} ms; bwd span {res['span_ms']:.2f} ms, "
                      f"step {res['dur_us_mean']:.2f} us (no overlap {res['dur_us_no_overlap'] or 0:.2f}, "
                      f">=2 {res['dur_us_overlap2'] or 0:.2f}), overlaps {res['overlaps_mean']:.3f} "
                      f"(>=1 {res['overlaps_ge1']:.1%}, >=3 {res['overlaps_ge3']:.1%}), lag/step median "
                      f"{res['lag_rel_median']:.2f}, <0.25 {res['lag_lt_quarter']:.1%}; by tenth "
                      f"{res['overlaps_by_tenth']}; first touch {res['first_touch']:.1%} {res['dur_us_first']:.2f} us, "
                      f"later {res['dur_us_later'] or 0:.2f} us", flush=True)
                if rnd == 0 and res["steps"] <= args.raw_max_steps:
                    n_max = int(arr[:, args.cap - 1, 1].max())
                    np.savez_compressed(out / f"raw_{b.label}_D{D}_N{N}_P{P}_R{R}.npz",
                                        steps=arr[:, :n_max], end=arr[:, args.cap - 1])
    (out / "bwd_timeline.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
