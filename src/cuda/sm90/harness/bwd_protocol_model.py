#!/usr/bin/env python3
"""Randomised CPU model of the sm90 backward's barrier protocol (bwd_sm90_kernel.cuh).

Actors, step for step as in the kernel: the producer warp (lane 0 takes items, issues the TMA loads
of K/V per item and of Q/dO per step; the 32 lanes each store their lse/delta values and arrive on
qdo_full, modelled one lane at a time) and the two consumer warpgroups (arrivals of their 4 warps
at once, as the wgmma instructions are warpgroup-collective). mbarriers have phase parity,
arrival counts and transaction counts; a TMA load completes at a random later time; the named
barrier 1 (256 threads) syncs the two consumer warpgroups after their dS halves are written.

A wgmma group reads its smem operands from its issue until the wgmma.wait_group that retires it.
Checked, over random interleavings of random work (items with 1-6 query steps):
  - no deadlock (every run ends),
  - TMA never overwrites K/V/Q/dO while a wgmma that reads it may run, and producer lanes never
    overwrite lse/delta while a consumer may read them,
  - a consumer warpgroup never overwrites its dS half while a dQ wgmma (of either warpgroup) reads it,
  - every read sees the version it expects: the item's K/V, the step's Q/dO and all 32 lanes' lse /
    delta values, both halves of the step's dS.
--mutant NAME plants a bug and expects the model to catch it (exit status 0 when it does):
  single_ds (one dS buffer), count32 (qdo_full initialised to 32 arrivals instead of 33),
  early_kv (kv_empty released before the item's last step), no_ds_bar (no named barrier before dQ),
  early_qdo (qdo_empty arrived before the dK / dQ wgmmas retire).
Run: python3 src/cuda/sm90/harness/bwd_protocol_model.py [--runs N] [--deterministic] [--mutant NAME]
"""
from __future__ import annotations

import argparse
import random
import sys


class ProtocolError(AssertionError):
    pass


def check(cond, msg):
    if not cond:
        raise ProtocolError(msg)


class MBar:
    def __init__(self, count):
        self.count, self.arrived, self.tx, self.completed = count, 0, 0, 0

    def _maybe_complete(self):
        if self.arrived == self.count and self.tx == 0:
            self.completed += 1
            self.arrived = 0

    def arrive(self, n=1):
        for _ in range(n):  # arrivals past the count start the next phase (as on the hardware)
            self.arrived += 1
            self._maybe_complete()

    def arrive_expect_tx(self, tx):
        self.tx += tx
        self.arrive()

    def complete_tx(self, tx):
        self.tx -= tx
        check(self.tx >= 0, "negative transaction count")
        self._maybe_complete()

    def ready(self, parity):  # mbarrier.try_wait.parity
        return (self.completed & 1) != parity


class NamedBar:
    def __init__(self, parties):
        self.parties, self.pending, self.generation = parties, set(), 0

    def arrive(self, who):
        check(who not in self.pending, f"{who} arrives twice on one named-barrier instance")
        self.pending.add(who)
        if len(self.pending) == self.parties:
            self.pending = set()
            self.generation += 1


class Buffer:
    """A smem buffer written by TMA (async) or by generic stores; readers = actors reading it."""

    def __init__(self, name):
        self.name, self.version, self.loaded, self.readers = name, None, False, set()

    def write(self, version, loaded=False):
        check(not self.readers, f"{self.name} (v{self.version}) overwritten while read by {sorted(self.readers)}")
        self.version, self.loaded = version, loaded


def simulate(rng, steps_of, deterministic=False, mutant=None):
    n_items = len(steps_of)
    stages = 2
    item_full = [MBar(1) for _ in range(2)]
    item_empty = [MBar(8) for _ in range(2)]
    kv_full, kv_empty = MBar(1), MBar(8)
    qdo_count = 32 if mutant == "count32" else 33
    qdo_full = [MBar(qdo_count) for _ in range(stages)]
    qdo_empty = [MBar(8) for _ in range(stages)]
    ds_bar = NamedBar(2)
    slots = [None, None]
    K, V = Buffer("K"), Buffer("V")
    Q = [Buffer(f"Q{s}") for s in range(stages)]
    dO = [Buffer(f"dO{s}") for s in range(stages)]
    lse = [[Buffer(f"lse{s}[{l}]") for l in range(32)] for s in range(stages)]
    n_ds = 1 if mutant == "single_ds" else 2
    dS = [[Buffer(f"dS{b}.half{c}") for c in range(2)] for b in range(n_ds)]
    inflight = []  # (barrier, buffer)
    counter = [0]

    def wait(cond):
        while not cond():
            yield "blocked"

    def tma(bar, buf, version):
        buf.write(version)
        inflight.append((bar, buf))

    def producer():
        kv_iter = step = n = 0
        while True:
            slot, ph = n & 1, (n >> 1) & 1
            yield from wait(lambda: item_empty[slot].ready(ph ^ 1))
            item = counter[0]
            counter[0] += 1
            slots[slot] = item
            item_full[slot].arrive()
            if item >= n_items:
                return
            yield from wait(lambda: kv_empty.ready((kv_iter & 1) ^ 1))
            kv_full.arrive_expect_tx(2)
            tma(kv_full, K, item)
            tma(kv_full, V, item)
            kv_iter += 1
            yield "step"
            for s in range(steps_of[item]):
                st = step % stages
                yield from wait(lambda: qdo_empty[st].ready(((step // stages) & 1) ^ 1))
                qdo_full[st].arrive_expect_tx(2)
                tma(qdo_full[st], Q[st], (item, s))
                tma(qdo_full[st], dO[st], (item, s))
                for lane in rng.sample(range(32), 32):  # lanes store, then arrive, in any order
                    lse[st][lane].write((item, s), loaded=True)
                    qdo_full[st].arrive()
                    if rng.random() < 0.3:
                        yield "step"
                step += 1
                yield "step"
            n += 1

    def consumer(cw):
        me = f"wg{cw}"
        groups = []  # committed wgmma groups, oldest first: sets of buffers read

        def read(buf, version):
            check(buf.loaded, f"{me} reads {buf.name} before it was written/loaded")
            check(buf.version == version, f"{me} reads {buf.name} v{buf.version}, expected v{version}")
            buf.readers.add(me)
            return buf

        def retire(keep):
            while len(groups) > keep:
                for b in groups.pop(0):
                    b.readers.discard(me)

        kv_iter = step = n = 0
        while True:
            slot, ph = n & 1, (n >> 1) & 1
            yield from wait(lambda: item_full[slot].ready(ph))
            item = slots[slot]
            item_empty[slot].arrive(4)
            if item >= n_items:
                return
            yield from wait(lambda: kv_full.ready(kv_iter & 1))
            kv_iter += 1
            n_steps = steps_of[item]
            for s in range(n_steps):
                st = step % stages
                yield from wait(lambda: qdo_full[st].ready((step // stages) & 1))
                groups.append({read(K, item), read(Q[st], (item, s))})    # S^T = K Q^T
                groups.append({read(V, item), read(dO[st], (item, s))})   # dP^T = V dO^T
                yield "step"
                retire(1)
                lse_read = [read(lse[st][l], (item, s)) for l in range(32)]  # softmax: lse
                yield "step"
                retire(0)
                lse_read += [read(lse[st][l], (item, s)) for l in range(32)]  # dS: delta
                for b in lse_read:
                    b.readers.discard(me)
                groups.append({read(dO[st], (item, s))})                  # dV += P^T dO
                buf = dS[step % n_ds]
                if not deterministic:
                    buf[cw].write((item, s), loaded=True)                 # stmatrix + proxy fence
                groups.append({read(Q[st], (item, s))})                   # dK += dS^T Q
                if mutant == "early_qdo":
                    qdo_empty[st].arrive(4)
                yield "step"
                if not deterministic:
                    if mutant != "no_ds_bar":
                        gen = ds_bar.generation
                        ds_bar.arrive(me)
                        yield from wait(lambda: ds_bar.generation > gen)
                    groups.append({read(buf[0], (item, s)), read(buf[1], (item, s)), read(K, item)})  # dQ
                    yield "step"
                if mutant == "early_kv" and s == n_steps - 1:
                    kv_empty.arrive(4)
                    yield "step"
                retire(0)
                if mutant != "early_qdo":
                    qdo_empty[st].arrive(4)
                step += 1
                yield "step"                                              # dQ atomics
            if mutant != "early_kv":
                kv_empty.arrive(4)
            yield "step"                                                  # epilogue
            n += 1

    procs = {"producer": producer(), "wg0": consumer(0), "wg1": consumer(1)}
    steps = stalled = 0
    while procs:
        steps += 1
        check(steps < 3_000_000, "runaway")
        if inflight and rng.random() < 0.3:
            bar, buf = inflight.pop(rng.randrange(len(inflight)))
            buf.loaded = True
            bar.complete_tx(1)
            stalled = 0
            continue
        name = rng.choice(list(procs))
        try:
            r = next(procs[name])
        except StopIteration:
            del procs[name]
            stalled = 0
            continue
        if r == "blocked":
            stalled += 1
            check(not (stalled > 5000 and not inflight), f"deadlock: {sorted(procs)} blocked, no TMA in flight")
        else:
            stalled = 0
    return steps


def run_many(runs, seed, deterministic, mutant):
    rng = random.Random(seed)
    for _ in range(runs):
        n_items = rng.randint(1, 10)
        steps_of = [rng.choice([1, 1, 2, 3, rng.randint(1, 6)]) for _ in range(n_items)]
        simulate(rng, steps_of, deterministic, mutant)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--deterministic", action="store_true", help="no dS / dQ (deterministic mode)")
    ap.add_argument("--mutant", choices=["single_ds", "count32", "early_kv", "no_ds_bar", "early_qdo"])
    args = ap.parse_args()
    if args.mutant is None:
        run_many(args.runs, 1, args.deterministic, None)
        print(f"ok: {args.runs} random runs (deterministic={args.deterministic})")
        return 0
    try:
        run_many(args.runs, 1, args.deterministic, args.mutant)
    except ProtocolError as e:
        print(f"mutant {args.mutant} caught: {e}")
        return 0
    print(f"mutant {args.mutant} NOT caught in {args.runs} runs")
    return 1


if __name__ == "__main__":
    sys.exit(main())
