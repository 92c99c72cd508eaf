#!/usr/bin/env python3
"""Randomised model of the sm90 forward's barrier protocol (src/cuda/sm90/fwd_kernel.cuh), on the CPU.

Mirrors, step for step, the producer thread and the two (--wgs 3: three, D 64's) consumer
warpgroups: mbarriers with phase parity and transaction counts (TMA completion is an event that
fires at a random later time), the named barriers of the warpgroups' turn-taking ring, the item
ring, the Q buffers (--q-buffers 2: D 64's double-buffered Q, item n in buffer n % 2) and the K/V
stage ring. Random interleavings of many items with random KV-tile counts; checks that
  - nobody deadlocks (every run finishes),
  - TMA never overwrites a buffer that a consumer wgmma may still read (a read lasts from its
    issue to the wgmma wait that retires it),
  - consumers only read the version of a buffer they expect (tile j's K, tile j-1's V, the item's Q).
--mutant NAME plants a bug in the Q protocol; the run must then fail (printed as "mutant NAME caught").
--k-ahead: the producer loads tile j + 1's K before tile j's V (kKAhead: D 256, the short-walk builds); --late-v: a consumer
waits for the previous tile's V after issuing its S, inside its turn, just before its P V (kLateVWait).
Run: python3 tests/models/protocol_model.py [--split] [--no-pingpong] [--wgs 3] [--q-buffers 2] [--k-ahead]
     [--late-v] [--runs N]
"""
from __future__ import annotations

import argparse
import random

from mbar_sim import Buffer, MBar as _MBar, NamedBar


def MBar(count):  # every arrival of this model is accounted for: more than `count` per phase is a bug
    return _MBar(count, strict=True)


# Planted bugs in the Q protocol (each must make a run fail):
#   q_release_early  a consumer warpgroup arrives on q_empty before the wgmma wait that retires its last S
#   q_parity_iter    the consumers wait on q_full with the item counter's parity, not the buffer use's
#   q_one_empty      both Q buffers' loads wait on buffer 0's q_empty (the releases go to each buffer's)
#   q_same_buffer    the producer loads every Q into buffer 0, the consumers read buffer n % 2
Q_MUTANTS = ("q_release_early", "q_parity_iter", "q_one_empty", "q_same_buffer")
# and in the K-ahead producer (--k-ahead):
#   k_ahead_no_wait  tile j + 1's K load does not wait for its stage's k_empty (K_{j-1} still read)
#   v_before_empty   tile j's V load waits for k_empty instead of kv_empty (V_{j-2} still read)
K_MUTANTS = ("k_ahead_no_wait", "v_before_empty")


def simulate(rng, n_items, tiles_of, S, split, pingpong, W=2, QB=1, mutant=None, k_ahead=False, late_v=False):
    warps = 4 * W  # arrivals per consumer-released barrier: one per consumer warp
    k_full = [MBar(1) for _ in range(S)]
    v_full = [MBar(1) for _ in range(S)]
    kv_empty = [MBar(warps) for _ in range(S)]
    k_empty = [MBar(warps) for _ in range(S)]
    q_full = [MBar(1) for _ in range(QB)]
    q_empty = [MBar(warps) for _ in range(QB)]
    item_full = [MBar(1) for _ in range(2)]
    item_empty = [MBar(warps) for _ in range(2)]
    slots = [None, None]
    K = [Buffer(f"K{s}") for s in range(S)]
    V = [Buffer(f"V{s}") for s in range(S)]
    Q = [Buffer(f"Q{b}") for b in range(QB)]
    turn = [NamedBar() for _ in range(W)]  # bar.sync / bar.arrive of 256 threads: two warpgroups each
    inflight_tma = []  # (barrier, bytes, buffer)
    counter = [0]

    def wait(cond):
        while not cond():
            yield "blocked"

    def tma(bar, buf, version):
        buf.write(version)
        inflight_tma.append((bar, buf))

    def producer():
        q_iter = kv_iter = 0
        n = 0
        while True:
            slot, ph = n & 1, (n >> 1) & 1
            yield from wait(lambda: item_empty[slot].ready(ph ^ 1))
            item = counter[0]; counter[0] += 1
            slots[slot] = item
            item_full[slot].arrive()
            if item >= n_items:
                return

            def load_q():  # the item's Q into buffer q_iter % QB, after the wait for its previous use
                qb, use = q_iter % QB, q_iter // QB
                if mutant == "q_same_buffer":
                    qb = 0
                wb = 0 if mutant == "q_one_empty" else qb
                yield from wait(lambda: q_empty[wb].ready((use & 1) ^ 1))
                q_full[qb].arrive_expect_tx(1)
                tma(q_full[qb], Q[qb], item)

            if k_ahead:  # K_0, Q, then per tile K_{j+1} before V_j (fwd_kernel.cuh kKAhead)
                def load_k(it, j):
                    st, kph = it % S, (it // S) & 1
                    if not (mutant == "k_ahead_no_wait" and j > 0):
                        yield from wait(lambda: k_empty[st].ready(kph ^ 1))
                    k_full[st].arrive_expect_tx(1)
                    tma(k_full[st], K[st], (item, j))
                yield from load_k(kv_iter, 0)
                yield from load_q()
                q_iter += 1
                for j in range(tiles_of[item]):
                    if j + 1 < tiles_of[item]:
                        yield from load_k(kv_iter + 1, j + 1)
                    st, kph = kv_iter % S, (kv_iter // S) & 1
                    release = k_empty if mutant == "v_before_empty" else kv_empty
                    yield from wait(lambda: release[st].ready(kph ^ 1))
                    v_full[st].arrive_expect_tx(1)
                    tma(v_full[st], V[st], (item, j))
                    kv_iter += 1
                    yield "step"
                n += 1
                continue
            q_issued = False
            for j in range(tiles_of[item]):
                st, kph = kv_iter % S, (kv_iter // S) & 1
                if split:
                    yield from wait(lambda: k_empty[st].ready(kph ^ 1))
                else:
                    yield from wait(lambda: kv_empty[st].ready(kph ^ 1))
                k_full[st].arrive_expect_tx(1)
                tma(k_full[st], K[st], (item, j))
                if not q_issued:
                    yield from load_q()
                    q_iter += 1
                    q_issued = True
                if split:
                    yield from wait(lambda: kv_empty[st].ready(kph ^ 1))
                v_full[st].arrive_expect_tx(1)
                tma(v_full[st], V[st], (item, j))
                kv_iter += 1
                yield "step"
            n += 1

    def consumer(cw):
        me = f"wg{cw}"
        q_iter = kv_iter = 0
        groups = []  # committed wgmma groups: list of sets of buffers read

        def turn_wait():
            if pingpong:
                gen = turn[cw].generation
                turn[cw].arrive(cw)  # bar.sync: counts this warpgroup, then waits for the generation
                yield from wait(lambda: turn[cw].generation > gen)

        def turn_pass():  # to the next warpgroup of the ring
            if pingpong:
                turn[(cw + 1) % W].arrive(cw)

        def read(buf, version):
            assert buf.loaded, f"{me} reads {buf.name} before its TMA completed"
            assert buf.version == version, f"{me} reads {buf.name} v{buf.version}, expected v{version}"
            buf.readers.add(me)
            return buf

        def retire(keep):  # wgmma.wait_group keep
            while len(groups) > keep:
                for b in groups.pop(0):
                    b.readers.discard(me)

        if pingpong and cw == W - 1:
            turn[0].arrive(cw)
        n = 0
        while True:
            slot, ph = n & 1, (n >> 1) & 1
            yield from wait(lambda: item_full[slot].ready(ph))
            item = slots[slot]
            item_empty[slot].arrive(4)
            if item >= n_items:
                return
            T = tiles_of[item]
            qb, use = q_iter % QB, q_iter // QB
            parity = (q_iter if mutant == "q_parity_iter" else use) & 1
            yield from wait(lambda: q_full[qb].ready(parity))
            q_iter += 1
            st = kv_iter % S
            yield from wait(lambda: k_full[st].ready((kv_iter // S) & 1))
            yield from turn_wait()
            groups.append({read(Q[qb], item), read(K[st], (item, 0))})
            turn_pass()
            yield "step"
            if mutant == "q_release_early" and T == 1:
                q_empty[qb].arrive(4)
                yield "step"  # the S still running
            retire(0)
            if split:
                k_empty[st].arrive(4)
            more = T > 1
            if not more and mutant != "q_release_early":
                q_empty[qb].arrive(4)
            prev = kv_iter
            kv_iter += 1
            j = 1
            while more:
                st = kv_iter % S
                yield from wait(lambda: k_full[st].ready((kv_iter // S) & 1))
                pst = prev % S
                if not late_v:
                    yield from wait(lambda: v_full[pst].ready((prev // S) & 1))
                yield from turn_wait()
                groups.append({read(Q[qb], item), read(K[st], (item, j))})
                if late_v:  # S issued; the V wait comes before the P V, the turn still held
                    yield "step"
                    yield from wait(lambda: v_full[pst].ready((prev // S) & 1))
                groups.append({read(V[pst], (item, j - 1))})
                turn_pass()
                yield "step"
                if mutant == "q_release_early" and j + 1 == T:
                    q_empty[qb].arrive(4)
                    yield "step"  # the S still running
                retire(1)
                if split:
                    k_empty[st].arrive(4)
                more = j + 1 < T
                if not more and mutant != "q_release_early":
                    q_empty[qb].arrive(4)
                yield "step"
                retire(0)
                kv_empty[pst].arrive(4)
                prev = kv_iter
                kv_iter += 1
                j += 1
            pst = prev % S
            yield from wait(lambda: v_full[pst].ready((prev // S) & 1))
            yield from turn_wait()
            groups.append({read(V[pst], (item, T - 1))})
            turn_pass()
            yield "step"
            retire(0)
            kv_empty[pst].arrive(4)
            n += 1

    procs = {"producer": producer(), **{f"wg{c}": consumer(c) for c in range(W)}}
    steps = 0
    stalled = 0
    while procs:
        steps += 1
        assert steps < 2_000_000, "runaway"
        # Complete some TMA loads at random times.
        if inflight_tma and rng.random() < 0.3:
            bar, buf = inflight_tma.pop(rng.randrange(len(inflight_tma)))
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
            if stalled > 2000 and not inflight_tma:
                raise AssertionError(f"deadlock: {sorted(procs)} blocked, no TMA in flight")
        else:
            stalled = 0
    assert not inflight_tma or all(b.readers == set() for _, b in inflight_tma)
    return steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--no-pingpong", action="store_true")
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--wgs", type=int, default=2, choices=(2, 3), help="consumer warpgroups (3: D 64's 192-row tiles)")
    ap.add_argument("--q-buffers", type=int, default=1, choices=(1, 2), help="Q buffers (2: D 64)")
    ap.add_argument("--k-ahead", action="store_true", help="tile j + 1's K loaded before tile j's V (D 256)")
    ap.add_argument("--late-v", action="store_true", help="V waited for after the S issue (D 256)")
    ap.add_argument("--mutant", choices=Q_MUTANTS + K_MUTANTS, default=None, help="plant a bug; the runs must catch it")
    args = ap.parse_args()
    if args.k_ahead and not args.split:
        ap.error("--k-ahead needs --split: the kernel's K loads wait for k_empty (K's own release)")
    if args.mutant in K_MUTANTS and not args.k_ahead:
        ap.error(f"--mutant {args.mutant} plants a bug in the K-ahead producer: add --k-ahead")
    rng = random.Random(1)
    desc = (f"split={args.split}, pingpong={not args.no_pingpong}, stages={args.stages}, wgs={args.wgs}, "
            f"q_buffers={args.q_buffers}, k_ahead={args.k_ahead}, late_v={args.late_v}")
    for r in range(args.runs):
        n_items = rng.randint(1, 12)
        tiles_of = [rng.choice([1, 1, 2, 3, rng.randint(1, 9)]) for _ in range(n_items)]
        try:
            simulate(rng, n_items, tiles_of, args.stages, args.split, not args.no_pingpong, args.wgs, args.q_buffers,
                     args.mutant, args.k_ahead, args.late_v)
        except AssertionError as e:  # ProtocolError is one too
            if args.mutant is None:
                raise
            print(f"mutant {args.mutant} caught in run {r}: {e}")
            return
    if args.mutant is not None:
        raise SystemExit(f"mutant {args.mutant} NOT caught in {args.runs} runs ({desc})")
    print(f"ok: {args.runs} random runs ({desc})")


if __name__ == "__main__":
    main()
