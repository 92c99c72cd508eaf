#!/usr/bin/env python3
"""Host-side numbers of the backward work plan for one GRPO group (prompt P, N responses of R), to
compare layouts and head dims without a GPU (docs/hopper.md, "Head dim 256").

The plan is rebuilt the way build_plan in src/cuda/api_cuda.cu builds it (KV tiles of 64 rows at
D > 128, 128 below; split length max(8192, total / SMs) rounded up to 64 rows; items sorted
longest-first, ties by root, k0, qa; item i = work i / Hk, KV head i % Hk). Printed per layout:
work entries, items, split tiles and their fp32 partial bytes, and dQ bytes per useful FLOP (one
64-row query step of one item = 5 GEMMs of 2 x 64 x BN x D FLOP; its dQ is 64 x D fp32).
--schedule adds a model of the persistent kernel: 132 CTAs take items in plan order, each step
costs 1 and each item `overhead` more; printed: the mean CTA load over the makespan (balance),
an LRU model of L2 (the step's (head, 64-row query tile): Q + dO + dQ = 64 x D x 8 bytes, --l2-mb
of capacity) as misses per step, and the dQ contention: per step, how many other CTAs add into
the same (head, query tile) in the same step, and the fan-in (KV tiles whose range covers a row).
The model assumes uniform step times, so it shows what the plan allows, not what the device does.
Run: python3 src/cuda/sm90/harness/bwd_plan_stats.py [--schedule] [--heads 32 --kv-heads 8]
"""
from __future__ import annotations

import argparse
import bisect
import collections
import heapq

BM = 64


def build_plan(P, N, R, D, sms):
    bn = 128 if D <= 128 else 64
    offs = [0, P]
    for _ in range(N):
        offs.append(offs[-1] + R)
    T = offs[-1]
    kv, total = [], 0
    for s in range(N + 1):
        qend = T if s == 0 else offs[s + 1]      # the prompt's subtree is the whole group
        for k0 in range(offs[s], offs[s + 1], bn):
            kv.append((s, k0, min(k0 + bn, offs[s + 1]), qend))
            total += qend - k0
    split = max(8192, (total + sms - 1) // sms)
    split = (split + BM - 1) // BM * BM
    bwd, n_split, n_slots = [], 0, 0
    for s, k0, k1, qend in kv:
        n = (qend - k0 + split - 1) // split
        if n == 1:
            bwd.append((s, k0, k1, k0, qend, -1))
        else:
            n_split += 1
            for i in range(n):
                qa = k0 + i * split
                bwd.append((s, k0, k1, qa, min(qa + split, qend), n_slots + i))
            n_slots += n
    bwd.sort(key=lambda b: (-(b[4] - b[3]), b[1], b[3]))  # one root: ties by k0, qa
    return dict(T=T, bn=bn, split=split, kv=kv, bwd=bwd, n_split=n_split, n_slots=n_slots)


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
