#!/usr/bin/env python3
"""Host-side numbers of the backward work plan for one GRPO group (prompt P, N responses of R) or a layout
class of bench/layout_classes.py (--classes), to compare layouts and head dims without a GPU
(docs/hopper.md, "Head dim 256").

The plan is the library's own (dualkv_plan_inspect: the planner of src/plan.cpp for a device of
--sms multiprocessors; a CPU-only build of libdualkv is enough). Printed per layout:
work entries, items, split tiles and their fp32 partial bytes, query steps per item (the mean, and the
share of items of at most 2 query tiles: an item's K/V load and dK/dV epilogue are paid per item), and dQ
bytes per useful FLOP (one 64-row query step of one item = 5 GEMMs of 2 x 64 x BN x D FLOP; its dQ is
64 x D fp32).
--schedule adds a model of the persistent kernel: 132 CTAs take items in plan order, each step
costs 1 and each item `overhead` more; printed: the mean CTA load over the makespan (balance),
an LRU model of L2 (the step's (head, 64-row query tile): Q + dO + dQ = 64 x D x 8 bytes, --l2-mb
of capacity) as misses per step, and the dQ contention: per step, how many other CTAs add into
the same (head, query tile) in the same step, and the fan-in (KV tiles whose range covers a row).
The model assumes uniform step times, so it shows what the plan allows, not what the device does.
--window W builds the plan cut to a sliding window of W positions (plan_format.h) and adds the
masking numbers of the Hopper backward (sm90/bwd_kernel.cuh: a consumer warpgroup's 64 KV rows
against a 64-row query step take the masked softmax when the step is ragged, crosses the causal
diagonal or holds a pair the window hides): the share of masked warpgroup-steps, and the useful
pairs per computed pair (visible pairs under the window / 64 x 64 per warpgroup-step).
(--masking prints them without a window too.)
Run: PYTHONPATH=python DUALKV_LIBRARY=build/libdualkv.so python3 tools/plan_stats.py [--schedule] [--window W]
         [--configs "N,P,R;..."] [--classes tree,small_groups]
"""
from __future__ import annotations

import argparse
import bisect
import collections
import heapq
import pathlib
import sys

import numpy as np

import dualkv
from dualkv import _native

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import layout_classes  # noqa: E402

BM = 64


# src/plan_format.h
HDR_BWD_OFFSET, HDR_BWD_BIAS_OFFSET, BWD_ITEM_INTS = 9, 14, 6


def build_plan(layout, D, sms, window=0):
    """The library's plan for `layout`, cut to a sliding window of `window` positions (0: none),
    through dualkv_plan_inspect_ex."""
    info, buf = _native.inspect_plan(layout, D, sms, window)
    first = buf[HDR_BWD_OFFSET]
    bwd = [tuple(buf[first + i * BWD_ITEM_INTS + j] for j in range(BWD_ITEM_INTS)) for i in range(info.num_bwd_items)]
    # distance biases (plan_format.h): only in a windowed plan; 0 is what the kernels use without
    bias_at = buf[HDR_BWD_BIAS_OFFSET] if window > 0 else 0
    bias = [buf[bias_at + i] if window > 0 else 0 for i in range(info.num_bwd_items)]
    # KV tiles (seg, k0, k1, end of the query range): the last query of the tile's items
    kv = {}
    for s, k0, k1, _, qb, _ in bwd:
        kv[(s, k0, k1)] = max(kv.get((s, k0, k1), 0), qb)
    return dict(T=layout.num_tokens, bn=info.bwd_block_n, split=info.bwd_split_rows,
                kv=[(s, k0, k1, qend) for (s, k0, k1), qend in sorted(kv.items())],
                bwd=bwd, bias=bias, window=window, n_split=info.num_reductions, n_slots=info.num_split_slots)


def masking(plan, wg_rows=64):
    """The Hopper backward's masked warpgroup-steps and visible pairs, per query head: each item's
    64-row query steps against each 64-row half of its KV tile (sm90/bwd_kernel.cuh: `tail`, the
    causal test qt < k_first + 63 and SegmentMask::window_tile). Returns (warpgroup-steps, masked
    ones, visible pairs, items' masked steps as a list)."""
    W = plan["window"]
    q = np.arange(BM)[None, :]
    r = np.arange(wg_rows)[:, None]
    steps = masked = 0
    pairs = 0
    per_item = []
    for (s, k0, k1, qa, qb, _), b in zip(plan["bwd"], plan["bias"]):
        klen = k1 - k0
        item_masked = 0
        for half in range(plan["bn"] // wg_rows):
            kf = k0 + half * wg_rows
            for qt in range(qa, qb, BM):
                tail = half * wg_rows + wg_rows - 1 >= klen
                diag = qt < kf + wg_rows - 1
                win = W > 0 and (qt + BM - 1 - kf) + b >= W
                steps += 1
                m = tail or diag or win
                masked += m
                item_masked += m
                k = kf + r
                qq = qt + q
                vis = (k < k1) & (k <= qq) & (qq < qb)
                if W > 0:
                    vis &= (qq - k) + b < W
                pairs += int(vis.sum())
        per_item.append(item_masked)
    return steps, masked, pairs, per_item


def schedule(plan, H, Hk, sms, overhead):
    group = H // Hk
    heap = [(0.0, c) for c in range(sms)]
    starts, load = [], [0.0] * sms
    for i in range(len(plan["bwd"]) * Hk):
        w, hk = divmod(i, Hk)
        b = plan["bwd"][w]
        tiles = (b[4] - b[3] + BM - 1) // BM
        t, c = heapq.heappop(heap)
        dur = overhead + tiles * group
        starts.append((t, c, hk, tiles, b[3]))
        load[c] += dur
        heapq.heappush(heap, (t + dur, c))
    return starts, max(t for t, _ in heap), sum(load) / sms


def step_events(starts, H, Hk, overhead):
    group = H // Hk
    for t, c, hk, tiles, qa in starts:
        for s in range(tiles * group):
            yield t + overhead + s, c, hk * group + s // tiles, (qa + (s % tiles) * BM) // BM


def l2_misses(events, D, l2_mb):
    cap = int(l2_mb * 2**20 // (64 * D * 8))
    lru, miss, n = collections.OrderedDict(), 0, 0
    for _, _, h, qt in sorted(events):
        n += 1
        if (h, qt) in lru:
            lru.move_to_end((h, qt))
        else:
            miss += 1
            lru[(h, qt)] = 1
            if len(lru) > cap:
                lru.popitem(last=False)
    return miss / n


def contention(events):
    by_tile = collections.defaultdict(list)
    for t, _, h, qt in events:
        by_tile[(h, qt)].append(t)
    others, many, n = 0, 0, 0
    for times in by_tile.values():
        times.sort()
        for t in times:
            o = bisect.bisect_right(times, t) - bisect.bisect_left(times, t) - 1
            others += o
            many += o >= 4
            n += 1
    return others / n, many / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--configs", default="16,4096,1024;8,16384,2048;32,8192,1024",
                    help="GRPO groups N,P,R separated by ';' ('' for none)")
    ap.add_argument("--classes", default="", help="layout classes of bench/layout_classes.py, comma-separated")
    ap.add_argument("--head-dims", default="256,128")
    ap.add_argument("--schedule", action="store_true", help="persistent-scheduler, L2 and contention model (~1 min)")
    ap.add_argument("--overhead", type=float, default=2.0, help="per-item cost in steps (K/V load, epilogue)")
    ap.add_argument("--l2-mb", type=float, default=50.0)
    ap.add_argument("--window", type=int, default=0, help="sliding window of W positions (0: none)")
    ap.add_argument("--masking", action="store_true", help="masking numbers without a window too")
    args = ap.parse_args()
    H, Hk = args.heads, args.kv_heads
    for D in (int(x) for x in args.head_dims.split(",")):
        cases = [(f"N{N} P{P} R{R}", dualkv.Layout.from_groups([P], [[R] * N]))
                 for N, P, R in (map(int, c.split(",")) for c in args.configs.split(";") if c)]
        cases += [(name, dualkv.Layout.from_tree(*layout_classes.layout_class(name)))
                  for name in args.classes.split(",") if name]
        for name, layout in cases:
            plan = build_plan(layout, D, args.sms, args.window)
            item_steps = [(b[4] - b[3] + BM - 1) // BM for b in plan["bwd"]]
            steps = sum(item_steps) * H
            flop_step = 5 * 2 * BM * plan["bn"] * D
            fan_in = sum(1 for (_, k0, _, qend) in plan["kv"] if k0 <= plan["T"] - 1 < qend)
            partial_mib = plan["n_slots"] * Hk * 2 * plan["bn"] * D * 4 / 2**20
            short = sum(n <= 2 for n in item_steps) / len(item_steps)
            line = (f"D={D} {name}: T {plan['T']}, split {plan['split']} rows, {len(plan['kv'])} KV tiles, "
                    f"{len(plan['bwd'])} work entries = {len(plan['bwd']) * Hk} items, {plan['n_split']} split tiles "
                    f"({plan['n_slots']} slots, partials {partial_mib:.0f} MiB), "
                    f"{sum(item_steps) / len(item_steps) * H / Hk:.1f} steps per item ({short:.0%} of 2 or fewer "
                    f"query tiles), {steps} steps "
                    f"({steps / args.sms:.0f} per SM), dQ {BM * D * 4 / flop_step * 1e3:.2f} B/kFLOP, "
                    f"dQ fan-in of the last row {fan_in} KV tiles")
            if args.window > 0 or args.masking:
                wg_steps, wg_masked, pairs, _ = masking(plan)
                line += (f"; window {args.window}: {wg_masked / wg_steps:.1%} of warpgroup-steps masked, "
                         f"{pairs / 1e6:.2f}M visible pairs (one head), {pairs / (wg_steps * 64 * 64):.3f} of the "
                         f"computed pairs")
            if args.schedule:
                starts, makespan, mean = schedule(plan, H, Hk, args.sms, args.overhead)
                events = list(step_events(starts, H, Hk, args.overhead))
                miss = l2_misses(events, D, args.l2_mb)
                others, many = contention(events)
                line += (f"; balance {mean / makespan:.3f}; L2 misses {miss:.3f}/step; same-step dQ collisions: "
                         f"{others:.2f} other CTAs/step, {many:.1%} of steps with >= 4")
            print(line, flush=True)


if __name__ == "__main__":
    main()
