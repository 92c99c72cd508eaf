#!/usr/bin/env python3
"""Randomised CPU model of the sm90 backward's barrier protocol (src/cuda/sm90/bwd_kernel.cuh).

Actors, step for step as in the kernel: the producer warp (lane 0 takes items, issues the TMA loads
of K/V per item and of Q/dO per step; the 32 lanes each store their lse/delta values and arrive on
qdo_full, modelled one lane at a time) and the two consumer warpgroups (arrivals of their 4 warps
at once, as the wgmma instructions are warpgroup-collective). mbarriers have phase parity,
arrival counts and transaction counts; a TMA load completes at a random later time; the named
barrier 1 (256 threads) syncs the two consumer warpgroups after their dS halves are written.

A wgmma group reads its smem operands from its issue until the wgmma.wait_group that retires it.
Consumer step (dQ-computing kernel; the order since 2026-12-02, FA3/FA4's): S^T, dP^T, wait_group 1,
wait_group 0, dV, dS stored (or dS stored, then dV: the 128-row steps' kDvAfterDsStore since
2026-12-03, D 128's kDsEarly since 2026-12-04; half the runs model it), the proxy fence (the stores
and the fence are separate events: the new dS is visible to the dQ wgmmas only after the fence),
[dK's first k step: D 128, a group of its own; half the runs model it], barrier 1, dQ, dK (the rest), wait_group 1 (dV, the dK head and dQ retired; checked before dQ is
read), dQ staged (--bulk) or added while dK runs, wait_group 0, qdo_empty. Deterministic kernel:
S^T, dP^T, waits, dV, dK, wait_group 0, qdo_empty.
Checked, over random interleavings of random work (items with 1-6 query steps):
  - no deadlock (every run ends),
  - TMA never overwrites K/V/Q/dO while a wgmma that reads it may run, and producer lanes never
    overwrite lse/delta while a consumer may read them,
  - a consumer warpgroup never overwrites its dS half while a dQ wgmma (of either warpgroup) reads it,
  - every read sees the version it expects: the item's K/V, the step's Q/dO and all 32 lanes' lse /
    delta values, both halves of the step's dS, and every actor the item the producer handed out
    in that ring position.
--bulk models the DUALKV_SM90_BWD_DQ_BULK=1 build: a fourth actor, the dQ writer (thread 32),
takes the items too (item_empty then counts 9 arrivals); per step each consumer warp stores its
16 x D/2 quarter of dQ into the step's staging buffer (double-buffered by step parity) after
waiting dq_empty, and arrives on dq_full (8 warps); the writer waits dq_full, issues the TMA
reduces, whose smem reads happen at random later times, waits cp.async.bulk.wait_group.read 0 and
arrives on dq_empty. Checked in addition: no consumer overwrites a staging quarter that an issued
reduce has not read yet, every reduce reads the step's version of all 8 quarters, the writer
exits with no reduce still reading smem.
--bulk --wide models the 128-row-step kernel (D 64 without softcap, since 2026-12-02): the same
protocol with ONE dQ staging buffer (dq_full[0] / dq_empty[0], phase = step parity; two of 32 KiB do
not fit next to dS), so a consumer stages step i only after the writer's reduces of step i - 1 have
read the buffer. The writer's skipped reduce of a 64-row block wholly past qb only reads less.
Mutant dq_stage_parity (--wide only): the one buffer waited with the two-buffer parity.
--mutant NAME plants a bug and expects the model to catch it (exit status 0 when it does):
  single_ds (one dS buffer), count32 (qdo_full initialised to 32 arrivals instead of 33),
  early_kv (kv_empty released before the item's last step), no_ds_bar (no named barrier before dQ),
  early_qdo (qdo_empty arrived before the dK / dQ wgmmas retire), dk_first (dK issued before dQ, as
  before 2026-12-02, with the new wait_group 1 before reading dQ), qdo_at_wait1 (qdo_empty arrived
  at wait_group 1, while dK still reads Q), ds_fence_after_bar (the dS proxy fence after barrier 1:
  the other warpgroup's dQ may read the old dS); with --bulk also:
  dq_no_wait_read (dq_empty arrived right after the reduces' commit, before wait_group.read),
  dq_no_empty_wait (consumers store into the staging buffer without waiting dq_empty),
  dq_full4 (dq_full initialised to 4 arrivals: one warpgroup's), dq_missing_arrive (warpgroup 1
  skips its dq_full arrival on an item's last step), item_empty8 (item_empty left at 8 arrivals
  although the writer arrives too).
--d256 models the head-dim-256 kernel (src/cuda/sm90/bwd_kernel_d256.cuh): same producer, item ring, K/V and
Q/dO/lse/delta ring, but the consumer warpgroups split the step by role: wg0 computes S^T = K Q^T,
arrives (no wait) on named barrier 3 once it retired (wg1 syncs there before issuing dP^T; not with
--no-stagger), reads lse, stores P^T into the single P buffer and arrives (no wait) on named barrier 2, then issues
dV += P^T dO; wg1 computes dP^T = V dO^T, syncs on barrier 2, loads P^T and delta, issues
dK += dS^T Q and (atomic-dQ kernel) stores the whole dS into the single dS buffer. Atomic-dQ kernel:
both retire their dV/dK group, arrive on qdo_empty, sync on barrier 1, issue dQ (reads dS and K),
retire it. Deterministic kernel: both retire, arrive on qdo_empty, then wg0 syncs and wg1 only
arrives on barrier 1 (the P buffer's release). A named-barrier instance that an actor reaches twice
(two generations in flight) is an error. Mutants for --d256: p_no_bar (wg1 loads P^T without the
barrier-2 sync), det_no_end_bar (deterministic: wg0 skips the end-of-step barrier 1), p_arrive_early
(wg0 arrives on barrier 2 before its P^T stores), d256_early_qdo (qdo_empty arrived
before dV/dK retire), d256_no_ds_bar (atomic: no barrier 1 before dQ); count32 and early_kv apply too.
--d256 --bulk models DUALKV_SM90_BWD_D256_DQ_BULK=1: after barrier 1 and the dQ wgmma each consumer
warp stores its 16 x 128 quarter of the warpgroup's dQ half into the step's Q stage (wg0) or dO stage
(wg1) and arrives on dq_full[stage] (8 warps); the consumers no longer arrive on qdo_empty; the writer
waits dq_full, issues the reduces (smem read at random later times), waits wait_group.read 0 and
arrives on qdo_empty (count 1), so the producer's next TMA load into the stage follows the reads.
Checked in addition: a staging store never hits a Q/dO buffer that a wgmma still reads or that the
producer has reloaded, no TMA load overwrites a quarter a reduce still reads, every reduce reads all
8 quarters of its step. Mutants: d256_consumer_release (the release left where it was: the consumers
arrive on qdo_empty, count 8, after dV/dK retire, the writer does not), d256_qdo_empty8 (qdo_empty left at 8 arrivals), d256_stage_no_bar (a warpgroup stages
its dQ half without waiting for barrier 1, i.e. while the other may still read Q or dO), and
dq_no_wait_read, dq_full4, dq_missing_arrive, item_empty8 as for --bulk.
Run: python3 tests/models/bwd_protocol_model.py [--runs N] [--deterministic] [--bulk [--wide]]
     [--d256 [--no-stagger]] [--mutant NAME]
"""
from __future__ import annotations

import argparse
import random
import sys

from mbar_sim import Buffer, MBar, NamedBar, ProtocolError, check


def wgmma_reads(me):
    """One warpgroup's smem reads by wgmma: `read(buf, version)` checks that the buffer holds that
    version and marks it read by `me`; the buffers of each committed group (a set appended to
    `groups`, oldest first) stay read until `retire(keep)` leaves only the newest `keep` groups."""
    groups = []

    def read(buf, version):
        check(buf.loaded, f"{me} reads {buf.name} before it was written/loaded")
        check(buf.version == version, f"{me} reads {buf.name} v{buf.version}, expected v{version}")
        buf.readers.add(me)
        return buf

    def retire(keep):
        while len(groups) > keep:
            for b in groups.pop(0):
                b.readers.discard(me)

    return groups, read, retire


def simulate(rng, steps_of, deterministic=False, mutant=None, bulk=False, d256=False, stagger=True, dk_head=False,
             dv_after_ds=False, dq_stages=2):
    n_items = len(steps_of)
    stages = 2
    writer_on = bulk and not deterministic  # the deterministic kernel has no writer in a bulk build
    item_full = [MBar(1) for _ in range(2)]
    item_empty = [MBar(8 + (1 if writer_on and mutant != "item_empty8" else 0)) for _ in range(2)]
    kv_full, kv_empty = MBar(1), MBar(8)
    qdo_count = 32 if mutant == "count32" else 33
    qdo_full = [MBar(qdo_count) for _ in range(stages)]
    # d256 bulk: the writer alone releases a Q/dO stage (after its reduces read the dQ staged there).
    qdo_empty_count = (8 if not (d256 and writer_on) or mutant in ("d256_qdo_empty8", "d256_consumer_release")
                       else 1)
    qdo_empty = [MBar(qdo_empty_count) for _ in range(stages)]
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
    # dQ staging (bulk): [buffer][warpgroup][warp] quarters of 16 rows x D/2 columns.
    n_dq = dq_stages  # 1 in the 128-row-step (D 64) kernel: one buffer, its phase flips every step
    dq_stage = [[[Buffer(f"dQstage{b}.wg{c}.w{w}") for w in range(4)] for c in range(2)] for b in range(n_dq)]
    dq_full = [MBar(4 if mutant == "dq_full4" else 8) for _ in range(n_dq)]
    dq_empty = [MBar(1) for _ in range(n_dq)]
    bulk_reads = []  # reduces issued, smem not read yet: (reader name, buffer, expected version)
    # d256 bulk: dQ staged in the Q (wg0) / dO (wg1) stage: [stage][warpgroup][warp] quarters of
    # 16 rows x 128 columns, aliasing Q[stage] / dO[stage].
    q_stage = [[[Buffer(f"dQin{'Q' if c == 0 else 'dO'}{b}.w{w}") for w in range(4)] for c in range(2)]
               for b in range(stages)]

    def wait(cond):
        while not cond():
            yield "blocked"

    def tma(bar, buf, version):
        buf.write(version)
        inflight.append((bar, buf))

    def take_item(me, n, arrivals):
        """Ring position n of the work-item ring: wait for it, read the item, and release the slot
        with ``arrivals`` (4 per consumer warpgroup, 1 for the dQ writer)."""
        slot, ph = n & 1, (n >> 1) & 1
        yield from wait(lambda: item_full[slot].ready(ph))
        item = slots[slot]
        check(item == n, f"{me} reads item {item} in ring position {n}")
        item_empty[slot].arrive(arrivals)
        return item

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
                if d256 and writer_on:                                  # TMA rewrites the staged dQ too
                    for quarter in q_stage[st][0] + q_stage[st][1]:
                        quarter.write(None)
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
        groups, read, retire = wgmma_reads(me)

        kv_iter = step = n = 0
        while True:
            item = yield from take_item(me, n, 4)
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
                if deterministic or not dv_after_ds:
                    groups.append({read(dO[st], (item, s))})              # dV += P^T dO
                buf = dS[step % n_ds]
                if deterministic:
                    groups.append({read(Q[st], (item, s))})               # dK += dS^T Q
                    if mutant == "early_qdo":
                        qdo_empty[st].arrive(4)
                    yield "step"
                    if mutant == "early_kv" and s == n_steps - 1:
                        kv_empty.arrive(4)
                        yield "step"
                    retire(0)
                    if mutant != "early_qdo":
                        qdo_empty[st].arrive(4)
                    step += 1
                    yield "step"                                          # next step
                    continue
                # dQ-computing kernel: dS stored, barrier, dQ issued before dK; wait_group 1 retires
                # dV and dQ, the dQ staging runs under dK, wait_group 0, then qdo_empty.
                # The dS stores (stmatrix, generic proxy) and the proxy fence are two events: the
                # stores must not hit a half a dQ wgmma still reads (checked at the stores); the
                # async proxy (the dQ wgmmas) sees the new version only after the fence.
                check(not buf[cw].readers,
                      f"{me} stores dS {buf[cw].name} while read by {sorted(buf[cw].readers)}")
                if rng.random() < 0.5:
                    yield "step"                                          # wgmmas between them
                if dv_after_ds:                                           # dV after the dS stores
                    groups.append({read(dO[st], (item, s))})              # (128-row steps; D 128)
                    if rng.random() < 0.5:
                        yield "step"
                if mutant != "ds_fence_after_bar":
                    buf[cw].write((item, s), loaded=True)                 # fence.proxy.async
                if mutant == "dk_first" or dk_head:                       # dK's first k step (D 128),
                    groups.append({read(Q[st], (item, s))})               # or all of dK (the mutant)
                yield "step"
                if mutant != "no_ds_bar":
                    gen = ds_bar.generation
                    ds_bar.arrive(me)
                    yield from wait(lambda: ds_bar.generation > gen)
                if mutant == "ds_fence_after_bar":                        # the bug: fence after the
                    yield "step"                                          # barrier, the other
                    buf[cw].write((item, s), loaded=True)                 # warpgroup may read first
                dq_group = {read(buf[0], (item, s)), read(buf[1], (item, s)), read(K, item)}
                groups.append(dq_group)                                   # dQ = dS K
                if mutant != "dk_first":
                    groups.append({read(Q[st], (item, s))})               # dK += dS^T Q
                if mutant == "early_qdo":
                    qdo_empty[st].arrive(4)
                yield "step"
                if mutant == "early_kv" and s == n_steps - 1:
                    kv_empty.arrive(4)
                    yield "step"
                retire(1)                                                 # wait_group 1: dV, dQ
                if mutant == "qdo_at_wait1":
                    qdo_empty[st].arrive(4)
                    yield "step"
                # dQ's accumulators are read (staged or added) only once its group retired.
                check(not any(g is dq_group for g in groups), f"{me} reads dQ of step {step} before it retired")
                if writer_on:                                             # stage dQ, per warp, under dK
                    b = step % n_dq
                    # dq_stage_parity: one buffer waited with the two-buffer parity ((step >> 1) & 1).
                    ph = ((step // 2) & 1) if mutant == "dq_stage_parity" else ((step // n_dq) & 1)
                    if mutant != "dq_no_empty_wait":
                        yield from wait(lambda: dq_empty[b].ready(ph ^ 1))
                    for w in rng.sample(range(4), 4):
                        dq_stage[b][cw][w].write((item, s), loaded=True)  # st.shared + fence.proxy.async
                        if not (mutant == "dq_missing_arrive" and cw == 1 and s == n_steps - 1):
                            dq_full[b].arrive()                           # lane 0 after __syncwarp
                        if rng.random() < 0.3:
                            yield "step"
                else:
                    yield "step"                                          # dQ atomics
                retire(0)                                                 # wait_group 0: dK
                if mutant not in ("early_qdo", "qdo_at_wait1"):
                    qdo_empty[st].arrive(4)
                step += 1
                yield "step"                                              # dQ atomics / next step
            if mutant != "early_kv":
                kv_empty.arrive(4)
            yield "step"                                                  # epilogue
            n += 1

    p_bar = NamedBar(2)
    s_bar = NamedBar(2)        # d256, staggered issue: S^T retired (wg0 arrives, wg1 syncs)
    P1 = Buffer("P")           # d256: P^T fragments (single buffer)
    dS1 = Buffer("dS")         # d256: dS [q][kv] (single buffer)

    def consumer_d256(cw):
        me = f"wg{cw}"
        groups, read, retire = wgmma_reads(me)

        def sync(bar):
            gen = bar.generation
            bar.arrive(me)
            yield from wait(lambda: bar.generation > gen)

        kv_iter = step = n = 0
        while True:
            item = yield from take_item(me, n, 4)
            if item >= n_items:
                return
            yield from wait(lambda: kv_full.ready(kv_iter & 1))
            kv_iter += 1
            n_steps = steps_of[item]
            for s in range(n_steps):
                st = step % stages
                v = (item, s)
                yield from wait(lambda: qdo_full[st].ready((step // stages) & 1))
                if mutant == "early_kv" and s == n_steps - 1:                     # K/V still to be read
                    kv_empty.arrive(4)
                if cw == 0:
                    groups.append({read(K, item), read(Q[st], v)})                # S^T = K Q^T
                    yield "step"
                    retire(0)
                    if stagger:
                        s_bar.arrive(me)                                          # bar.arrive 3
                    for b in [read(lse[st][l], v) for l in range(32)]:           # exp2: lse
                        b.readers.discard(me)
                    if mutant == "p_arrive_early":
                        p_bar.arrive(me)
                        yield "step"
                    P1.write(v, loaded=True)                                      # st.shared P^T
                    yield "step"
                    if mutant != "p_arrive_early":
                        p_bar.arrive(me)                                          # bar.arrive 2
                    groups.append({read(dO[st], v)})                              # dV += P^T dO
                else:
                    if stagger:
                        yield from sync(s_bar)                                    # bar.sync 3
                    groups.append({read(V, item), read(dO[st], v)})              # dP^T = V dO^T
                    yield "step"
                    retire(0)
                    if mutant != "p_no_bar":
                        yield from sync(p_bar)                                    # bar.sync 2
                    pread = read(P1, v)                                           # ld.shared P^T
                    for b in [read(lse[st][l], v) for l in range(32)]:           # delta
                        b.readers.discard(me)
                    yield "step"
                    groups.append({read(Q[st], v)})                               # dK += dS^T Q
                    if not deterministic:
                        dS1.write(v, loaded=True)                                 # stmatrix + fence
                    pread.readers.discard(me)                                     # P^T consumed (dS)
                if mutant == "d256_early_qdo":
                    qdo_empty[st].arrive(4)
                yield "step"
                retire(0)
                if mutant != "d256_early_qdo" and (not writer_on or mutant == "d256_consumer_release"):
                    qdo_empty[st].arrive(4)
                if not deterministic:
                    stage_early = writer_on and mutant == "d256_stage_no_bar"
                    if not stage_early and mutant != "d256_no_ds_bar":
                        yield from sync(ds_bar)                                   # bar.sync 1
                    if not stage_early:
                        groups.append({read(dS1, v), read(K, item)})              # dQ = dS K
                        yield "step"
                        retire(0)
                    if writer_on:                                                 # stage dQ, per warp
                        big = Q[st] if cw == 0 else dO[st]
                        for w in rng.sample(range(4), 4):
                            check(not big.readers, f"{me} stages dQ into {big.name} while read by {sorted(big.readers)}")
                            check(big.version == v, f"{me} stages dQ into {big.name} reloaded to v{big.version}")
                            q_stage[st][cw][w].write(v, loaded=True)              # st.shared + fence
                            if not (mutant == "dq_missing_arrive" and cw == 1 and s == n_steps - 1):
                                dq_full[st].arrive()                              # lane 0 after __syncwarp
                            if rng.random() < 0.3:
                                yield "step"
                    else:
                        yield "step"                                              # atomics
                    if stage_early:                                               # the bug's late barrier
                        yield from sync(ds_bar)
                        groups.append({read(dS1, v), read(K, item)})
                        yield "step"
                        retire(0)
                else:
                    if cw == 0:
                        if mutant != "det_no_end_bar":
                            yield from sync(ds_bar)                               # bar.sync 1
                    else:
                        ds_bar.arrive(me)                                         # bar.arrive 1
                step += 1
                yield "step"
            retire(0)
            if mutant != "early_kv":
                kv_empty.arrive(4)
            yield "step"                                                          # epilogue
            n += 1

    def writer(ring, full, buffers, release, release_mutant):
        """The dQ writer (thread 32): per step, wait ``full`` of the step's ring slot, issue the TMA
        reduces that read ``buffers(slot)`` (all 8 quarters), commit, wait for their reads, then
        free the slot on ``release``. D <= 128: the dedicated staging ring (dq_full / dq_empty);
        DUALKV_SM90_BWD_D256_DQ_BULK: the dQ staged in the step's Q/dO stage, handed back to the
        producer (qdo_empty) once the reduces have read it."""
        me = "writer"
        step = n = 0
        while True:
            item = yield from take_item(me, n, 1)
            if item >= n_items:
                yield from wait(lambda: not bulk_reads)                   # bulk wait_group 0
                return
            for s in range(steps_of[item]):
                b = step % ring
                yield from wait(lambda: full[b].ready((step // ring) & 1))
                for buf in buffers(b):                                    # D/32 reduces, all 8 quarters
                    name = f"reduce{step}"
                    buf.readers.add(name)
                    bulk_reads.append((name, buf, (item, s)))
                yield "step"                                              # commit_group
                if mutant != "dq_no_wait_read":
                    yield from wait(lambda: not bulk_reads)               # wait_group.read 0
                if mutant is None or mutant != release_mutant:
                    release[b].arrive()
                step += 1
                yield "step"
            n += 1

    cons = consumer_d256 if d256 else consumer
    procs = {"producer": producer(), "wg0": cons(0), "wg1": cons(1)}
    if writer_on:
        if d256:
            procs["writer"] = writer(stages, dq_full, lambda st: q_stage[st][0] + q_stage[st][1], qdo_empty,
                                     "d256_consumer_release")
        else:
            procs["writer"] = writer(n_dq, dq_full, lambda b: [buf for c in range(2) for buf in dq_stage[b][c]],
                                     dq_empty, None)
        # Per-run actor speeds, so that some runs let the writer lag items behind the consumers.
        speed = {name: rng.choice([1.0, 1.0, 0.1, 4.0]) for name in procs}
    steps = stalled = 0
    while procs:
        steps += 1
        check(steps < 3_000_000, "runaway")
        if (inflight or bulk_reads) and rng.random() < 0.3:
            k = rng.randrange(len(inflight) + len(bulk_reads))
            if k < len(inflight):
                bar, buf = inflight.pop(k)
                buf.loaded = True
                bar.complete_tx(1)
            else:                                                         # a reduce reads its source now
                name, buf, version = bulk_reads.pop(k - len(inflight))
                check(buf.loaded and buf.version == version,
                      f"{name} reads {buf.name} v{buf.version}, expected v{version}")
                buf.readers.discard(name)
            stalled = 0
            continue
        names = list(procs)
        name = rng.choices(names, [speed[x] for x in names])[0] if writer_on else rng.choice(names)
        try:
            r = next(procs[name])
        except StopIteration:
            del procs[name]
            stalled = 0
            continue
        if r == "blocked":
            stalled += 1
            check(not (stalled > 5000 and not inflight and not bulk_reads),
                  f"deadlock: {sorted(procs)} blocked, no TMA in flight")
        else:
            stalled = 0
    return steps


def run_many(runs, seed, deterministic, mutant, bulk=False, d256=False, stagger=True, dq_stages=2):
    rng = random.Random(seed)
    for _ in range(runs):
        n_items = rng.randint(1, 10)
        steps_of = [rng.choice([1, 1, 2, 3, rng.randint(1, 6)]) for _ in range(n_items)]
        simulate(rng, steps_of, deterministic, mutant, bulk, d256, stagger, dk_head=rng.random() < 0.5,
                 dv_after_ds=rng.random() < 0.5, dq_stages=dq_stages)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--deterministic", action="store_true", help="no dS / dQ (deterministic mode)")
    ap.add_argument("--bulk", action="store_true", help="dQ by staging + TMA reduce (DUALKV_SM90_BWD_DQ_BULK=1)")
    ap.add_argument("--mutant", choices=["single_ds", "count32", "early_kv", "no_ds_bar", "early_qdo",
                                         "dq_no_wait_read", "dq_no_empty_wait", "dq_full4", "dq_missing_arrive",
                                         "item_empty8", "p_no_bar", "det_no_end_bar", "p_arrive_early",
                                         "d256_early_qdo", "d256_no_ds_bar", "d256_consumer_release",
                                         "d256_qdo_empty8", "d256_stage_no_bar", "dk_first", "qdo_at_wait1",
                                         "dq_stage_parity", "ds_fence_after_bar"])
    ap.add_argument("--wide", action="store_true",
                    help="the 128-row-step kernel (D 64 without softcap): one dQ staging buffer")
    ap.add_argument("--d256", action="store_true", help="the head-dim-256 kernel (src/cuda/sm90/bwd_kernel_d256.cuh)")
    ap.add_argument("--no-stagger", action="store_true",
                    help="--d256 built with DUALKV_SM90_BWD_D256_STAGGER=0 (no named barrier 3)")
    args = ap.parse_args()
    if args.mutant is None:
        run_many(args.runs, 1, args.deterministic, None, args.bulk, args.d256, not args.no_stagger,
                 1 if args.wide else 2)
        print(f"ok: {args.runs} random runs (deterministic={args.deterministic}, bulk={args.bulk}, "
              f"d256={args.d256}{', no stagger' if args.d256 and args.no_stagger else ''}"
              f"{', wide (one dQ staging buffer)' if args.wide else ''})")
        return 0
    try:
        run_many(args.runs, 1, args.deterministic, args.mutant, args.bulk, args.d256, not args.no_stagger,
                 1 if args.wide else 2)
    except ProtocolError as e:
        print(f"mutant {args.mutant} caught: {e}")
        return 0
    print(f"mutant {args.mutant} NOT caught in {args.runs} runs")
    return 1


if __name__ == "__main__":
    sys.exit(main())
