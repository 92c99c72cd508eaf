#!/usr/bin/env python3
"""Host-side numbers of the backward work plan for one GRPO group (prompt P, N responses of R), to
compare layouts and head dims without a GPU (docs/hopper.md, "Head dim 256").

The plan is the library's own (dualkv_plan_inspect: the planner of src/plan.cpp for a device of
--sms multiprocessors; a CPU-only build of libdualkv is enough). Printed per layout:
work entries, items, split tiles and their fp32 partial bytes, and dQ bytes per useful FLOP (one
64-row query step of one item = 5 GEMMs of 2 x 64 x BN x D FLOP; its dQ is 64 x D fp32).
--schedule adds a model of the persistent kernel: 132 CTAs take items in plan order, each step
costs 1 and each item `overhead` more; printed: the mean CTA load over the makespan (balance),
an LRU model of L2 (the step's (head, 64-row query tile): Q + dO + dQ = 64 x D x 8 bytes, --l2-mb
of capacity) as misses per step, and the dQ contention: per step, how many other CTAs add into
the same (head, query tile) in the same step, and the fan-in (KV tiles whose range covers a row).
The model assumes uniform step times, so it shows what the plan allows, not what the device does.
Run: PYTHONPATH=python DUALKV_LIBRARY=build/libdualkv.so python3 tools/plan_stats.py [--schedule]
"""
from __future__ import annotations

import argparse
import bisect
import collections
import ctypes
import heapq

import dualkv
from dualkv import _native

BM = 64


class PlanInfo(ctypes.Structure):
    """dualkv_plan_info (include/dualkv/dualkv.h)."""
    _fields_ = [("struct_size", ctypes.c_uint32), ("head_dim", ctypes.c_int32), ("fwd_block_m", ctypes.c_int32),
                ("bwd_block_n", ctypes.c_int32), ("bwd_block_m", ctypes.c_int32),
                ("bwd_split_rows", ctypes.c_int32), ("num_fwd_tiles", ctypes.c_int32),
                ("num_bwd_items", ctypes.c_int32), ("num_reductions", ctypes.c_int32),
                ("num_split_slots", ctypes.c_int32), ("plan_len", ctypes.c_int64), ("plan_key", ctypes.c_uint64)]


# src/plan_format.h
HDR_BWD_OFFSET, BWD_ITEM_INTS = 9, 6


def build_plan(P, N, R, D, sms):
    """The library's plan for one group (prompt P, N responses of R) through dualkv_plan_inspect."""
    layout = dualkv.Layout.from_groups([P], [[R] * N])
    c = layout.c_layout(host=True)
    lib = _native.lib()
    lib.dualkv_plan_inspect.argtypes = [ctypes.POINTER(_native.Layout_), ctypes.c_int32, ctypes.c_int32,
                                        ctypes.POINTER(PlanInfo), ctypes.POINTER(ctypes.c_int32), ctypes.c_int64]
    info = PlanInfo(struct_size=ctypes.sizeof(PlanInfo))
    _native.check(lib.dualkv_plan_inspect(ctypes.byref(c), D, sms, ctypes.byref(info), None, 0), "plan_inspect")
    buf = (ctypes.c_int32 * info.plan_len)()
    _native.check(lib.dualkv_plan_inspect(ctypes.byref(c), D, sms, ctypes.byref(info), buf, info.plan_len),
                  "plan_inspect")
    first = buf[HDR_BWD_OFFSET]
    bwd = [tuple(buf[first + i * BWD_ITEM_INTS + j] for j in range(BWD_ITEM_INTS)) for i in range(info.num_bwd_items)]
    # KV tiles (seg, k0, k1, end of the query range): the last query of the tile's items
    kv = {}
    for s, k0, k1, _, qb, _ in bwd:
        kv[(s, k0, k1)] = max(kv.get((s, k0, k1), 0), qb)
    return dict(T=layout.num_tokens, bn=info.bwd_block_n, split=info.bwd_split_rows,
                kv=[(s, k0, k1, qend) for (s, k0, k1), qend in sorted(kv.items())],
                bwd=bwd, n_split=info.num_reductions, n_slots=info.num_split_slots)


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
    ap.add_argument("--configs", default="16,4096,1024;8,16384,2048;32,8192,1024")
    ap.add_argument("--head-dims", default="256,128")
    ap.add_argument("--schedule", action="store_true", help="persistent-scheduler, L2 and contention model (~1 min)")
    ap.add_argument("--overhead", type=float, default=2.0, help="per-item cost in steps (K/V load, epilogue)")
    ap.add_argument("--l2-mb", type=float, default=50.0)
    args = ap.parse_args()
    H, Hk = args.heads, args.kv_heads
    for D in (int(x) for x in args.head_dims.split(",")):
        for cfg in args.configs.split(";"):
            N, P, R = (int(x) for x in cfg.split(","))
            plan = build_plan(P, N, R, D, args.sms)
            steps = sum((b[4] - b[3] + BM - 1) // BM for b in plan["bwd"]) * H
            flop_step = 5 * 2 * BM * plan["bn"] * D
            fan_in = sum(1 for (_, k0, _, qend) in plan["kv"] if k0 <= plan["T"] - 1 < qend)
            partial_mib = plan["n_slots"] * Hk * 2 * plan["bn"] * D * 4 / 2**20
            line = (f"D={D} N{N} P{P} R{R}: T {plan['T']}, split {plan['split']} rows, {len(plan['kv'])} KV tiles, "
                    f"{len(plan['bwd'])} work entries = {len(plan['bwd']) * Hk} items, {plan['n_split']} split tiles "
                    f"({plan['n_slots']} slots, partials {partial_mib:.0f} MiB), {steps} steps "
                    f"({steps / args.sms:.0f} per SM), dQ {BM * D * 4 / flop_step * 1e3:.2f} B/kFLOP, "
                    f"dQ fan-in of the last row {fan_in} KV tiles")
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
