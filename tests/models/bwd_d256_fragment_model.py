#!/usr/bin/env python3
"""CPU emulation of the per-thread index arithmetic of src/cuda/sm90/bwd_kernel_d256.cuh (one work item).

The wgmma products themselves are taken as exact matrix products (their descriptors follow forms
already run on the device: SS K-major m64n64 as in the D <= 128 backward, RS m64n256 with B N-major
over four 64-column boxes as in the D = 256 forward, SS m64n128 with B N-major as WgmmaTB). What is
emulated thread by thread, with the kernel's formulas:
  - the accumulator fragment layout of S^T / dP^T (warp w, lane g = lane / 4, t4 = lane % 4:
    element 4 j + e at kv row 16 w + g + 8 (e >= 2), q column 8 j + 2 t4 + (e & 1)),
  - the mask (kv row >= klen, k0 + row > q), lse / delta indexing (staged at bwd_row_stat_slot, read by
    one 16-byte load per k16 step),
  - the P^T hand-over through smem (thread-linear float4 at tid * 16 + i * 2048),
  - dS^T = P^T (dP^T - delta), the 16-bit packing into A fragments frag[4 kk + i] and the A-operand
    layout they must form (a0: row g, cols 2 t4..; a1: row g + 8; a2: cols + 8; a3: both),
  - the stmatrix.trans addresses of dS into the 128B-swizzled [q][kv] box, read back the way TMA /
    wgmma see that layout (byte o of the box: row o / 128, 16-byte chunk ((o / 16) % 8) ^ (row % 8)),
  - the dQ atomics' (row, column) after the lane-pair shuffle, and the epilogue's (row, column),
  - the bulk-dQ kernel's staging (bwd_stage_dq_fragment): each warpgroup's fp32 dQ half stored by
    float2 into the step's Q (P role) or dO (dS role) stage as four 128B-swizzled boxes of 32 rows x
    64 columns (row block major), read back the way the dq_accum tensor map's reduce reads a box (byte
    o: smem row p = o / 128 = row p / 2's 32-column block p % 2, 16-byte chunk ((o / 16) % 8) ^ (p % 8),
    word (o / 4) % 4: dq_staging_model.reduce_reads); every byte of both 32 KiB stages written once, rows >= qb staged as 0 whatever
    the registers hold, no bank conflict within a half-warp (64-bit stores are served per half-warp;
    the layout's reasons: bwd_stage_dq_fragment, tests/models/dq_staging_model.py).
Compared with float64 dense math on random data for items with a tail (klen < 64), a diagonal tile
and query rows past qb. Exit status 0 when every check passes.
--mutant NAME plants an index bug in the staging and expects a check to fail (exit status 0 when
it does): stage_no_xor (chunk without the rows' XOR phase), stage_row8 (the row + 8 store at + 8 x 128
bytes, the layout before), stage_box (box j / 4 instead of j / 8), stage_no_zero (rows >= qb staged from registers),
stage_same_buf (both warpgroups stage into the Q stage), rowstat_rowmajor (lse / delta staged row-major, read
as the kernel's 16-byte loads read them).
"""
from __future__ import annotations

import sys

import numpy as np

from dq_staging_model import BOX_BYTES, reduce_reads, store_addr

BM = BN = 64
D = 256


def bf16(x):
    """Round to bfloat16 (nearest even), returned as float64."""
    a = np.asarray(x, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


MUTANT = None


def row_stat_slot(i):
    """bwd_row_stat_slot: query row i of a step's lse / delta at 16 kk + 4 t4 + 2 h + e."""
    if MUTANT == "rowstat_rowmajor":
        return i
    return (i & ~15) | ((i & 6) << 1) | ((i >> 2) & 2) | (i & 1)


def row_stats_k16(smem, kk, t4):
    """bwd_row_stats_k16: the 16-byte load of k16 step kk's two pairs for t4."""
    return smem[16 * kk + 4 * t4:16 * kk + 4 * t4 + 4]


def stage_dq(dq_full, qt, qb):
    """The bulk-dQ kernel's staging of dQ (kernel formulas), read back as the TMA reduce reads it."""
    box_bytes = BOX_BYTES                            # 32 rows x 64 fp32 columns
    stage_bytes = 4 * box_bytes                      # 32 KiB: one Q (or dO) stage
    smem = {}                                        # (buffer, byte) -> fp32 value
    for cw in range(2):
        half = dq_full[:, 128 * cw:128 * cw + 128].copy()
        half[qt + np.arange(BM) >= qb] += 1.0        # registers of rows >= qb need not be 0
        buf = 0 if (cw == 0 or MUTANT == "stage_same_buf") else 1  # Q stage / dO stage
        for warp in range(4):
            for j in range(16):
                for second in range(2):              # the two st.shared.v2 of iteration j
                    banks = [{}, {}]                 # per half-warp
                    for lane in range(32):
                        r0 = warp * 16 + (lane >> 2)
                        valid = qt + r0 + 8 * second < qb
                        if MUTANT == "stage_no_zero":
                            valid = True
                        # A warpgroup's 128 columns are a whole stage: two 64-column boxes per 32-row block.
                        if MUTANT == "stage_row8":  # the row + 8 eight smem rows down, the layout before
                            addr = store_addr(r0, lane, j, 0, 2) + 8 * 128 * second
                        else:
                            addr = store_addr(r0 + 8 * second, lane, j, 0, 2, SHARED_MUTANTS.get(MUTANT, ""))
                        r, c = r0 + 8 * second, 8 * j + 2 * (lane & 3)
                        for e in range(2):
                            a = addr + 4 * e
                            assert 0 <= a < stage_bytes, f"staging store outside the stage at {a}"
                            assert (buf, a) not in smem, f"staging byte {a} of buffer {buf} written twice"
                            smem[(buf, a)] = half[r, c + e] if valid else 0.0
                            banks[lane // 16].setdefault((a // 4) % 32, set()).add(a // 4)
                    assert max(len(v) for hw in banks for v in hw.values()) == 1, f"bank conflict in store {j}.{second}"
    assert len(smem) == 2 * stage_bytes // 4, f"{len(smem)} of {2 * stage_bytes // 4} staging words written"
    # The writer's 8 reduces: buffer cw's four boxes (two 64-column boxes per 32-row block) add to
    # columns 128 cw.. where the dq_accum map's reduce reads each word.
    added = np.full((BM, D), np.nan)
    for (cw, a), value in smem.items():
        row, col = reduce_reads(a, 2)
        added[row, 128 * cw + col] = value
    return added


def emulate(k0, klen, qt, qb, rng):
    scale = 1.0 / np.sqrt(D)
    K = rng.standard_normal((BN, D))
    V = rng.standard_normal((BN, D))
    Q = rng.standard_normal((BM, D))
    dO = rng.standard_normal((BM, D))
    lse = rng.standard_normal(BM) + 3.0
    delta = rng.standard_normal(BM)
    log2e = 1.0 / np.log(2.0)
    s_lse = np.where(qt + np.arange(BM) < qb, lse * log2e, np.inf)
    s_delta = np.where(qt + np.arange(BM) < qb, delta, 0.0)
    # The producer's staging (bwd_stage_lse_delta): row i at bwd_row_stat_slot(i), a permutation inside
    # each 16-row group (so each 32-lane store of 32 rows stays conflict-free).
    slots = [row_stat_slot(i) for i in range(BM)]
    assert all(sorted(slots[b:b + 16]) == list(range(b, b + 16)) for b in range(0, BM, 16)), "slot not a 16-row permutation"
    smem_lse, smem_delta = np.full(BM, np.nan), np.full(BM, np.nan)
    smem_lse[slots], smem_delta[slots] = s_lse, s_delta

    # Reference (float64, with the kernel's roundings of P and dS to 16 bits before the products).
    S = K @ Q.T  # [kv][q]
    kv = np.arange(BN)[:, None]
    q = qt + np.arange(BM)[None, :]
    P = np.exp2(S * scale * log2e - s_lse[None, :])
    P = np.where((kv >= klen) | (k0 + kv > q), 0.0, P)
    dP = V @ dO.T
    dS = P * (dP - s_delta[None, :])
    ref_dv = bf16(P) @ dO
    ref_dk = bf16(dS) @ Q
    ref_dq = bf16(dS).T @ K  # [q][d]

    # Thread by thread. sacc[tid][4 j + e].
    def frag_coords(tid, j, e):
        w, lane = tid // 32, tid % 32
        g, t4 = lane // 4, lane % 4
        return 16 * w + g + 8 * (e >> 1), 8 * j + 2 * t4 + (e & 1)

    sacc_s = np.zeros((128, 32))
    sacc_dp = np.zeros((128, 32))
    for tid in range(128):
        for j in range(8):
            for e in range(4):
                r, c = frag_coords(tid, j, e)
                sacc_s[tid, 4 * j + e], sacc_dp[tid, 4 * j + e] = S[r, c], dP[r, c]

    # P role: exp2, mask (kernel formulas), then the thread-linear float4 stores.
    p_smem = np.full(128 * 32, np.nan)
    tail = klen < BN
    mask = tail or qt < k0 + BN - 1
    for tid in range(128):
        w, lane = tid // 32, tid % 32
        g, t4 = lane // 4, lane % 4
        kv_row0 = w * 16 + g
        for j in range(8):
            c = j * 8 + 2 * t4
            l4 = row_stats_k16(smem_lse, j // 2, t4)
            for e in range(4):
                lv = l4[2 * (j % 2) + (e & 1)]
                pv = np.exp2(sacc_s[tid, 4 * j + e] * scale * log2e - lv)
                if mask:
                    r = kv_row0 + (e >> 1) * 8
                    if r >= klen or k0 + r > qt + c + (e & 1):
                        pv = 0.0
                sacc_s[tid, 4 * j + e] = pv
        for i in range(8):
            base = (tid * 16 + i * 2048) // 4
            p_smem[base:base + 4] = sacc_s[tid, 4 * i:4 * i + 4]
    # dS role: loads, dS^T.
    ds_acc = np.zeros((128, 32))
    for tid in range(128):
        t4 = tid % 4
        for j in range(8):
            base = (tid * 16 + j * 2048) // 4
            pv = p_smem[base:base + 4]
            d4 = row_stats_k16(smem_delta, j // 2, t4)
            for e in range(4):
                d = d4[2 * (j % 2) + (e & 1)]
                ds_acc[tid, 4 * j + e] = pv[e] * (sacc_dp[tid, 4 * j + e] - d)

    def a_matrix(acc):
        """frag[4 kk + i] = pack(acc[8 kk + 2 i], +1) placed where the RS wgmma reads A from."""
        A = np.full((BN, BM), np.nan)
        for tid in range(128):
            w, lane = tid // 32, tid % 32
            g, t4 = lane // 4, lane % 4
            for kk in range(4):
                for i in range(4):
                    lo, hi = bf16(acc[tid, 8 * kk + 2 * i]), bf16(acc[tid, 8 * kk + 2 * i + 1])
                    row = 16 * w + g + (8 if i in (1, 3) else 0)
                    col = 16 * kk + 2 * t4 + (8 if i in (2, 3) else 0)
                    A[row, col], A[row, col + 1] = lo, hi
        assert not np.isnan(A).any()
        return A

    PT = a_matrix(sacc_s)
    dST = a_matrix(ds_acc)
    dv = PT @ dO
    dk = dST @ Q

    # stmatrix.trans of dS^T fragments into the swizzled [q][kv] box (8 KiB).
    box = np.full(BM * 64, np.nan)  # 16-bit elements
    for tid in range(128):
        w, lane = tid // 32, tid % 32
        m = lane >> 3
        kvl = w * 16 + (m & 1) * 8
        chunk = kvl // 8
        for kk in range(4):
            qq = kk * 16 + (m >> 1) * 8 + (lane & 7)
            addr = qq * 128 + ((chunk ^ (qq & 7)) << 4)
            # Matrix mm (0..3) of the x4 is frag[4 kk + mm]: rows (kv) 8 x cols (q) 8, transposed on
            # store: the row address of lane l gives row l % 8 of matrix l / 8, i.e. q = that row,
            # holding the 8 kv values kvl .. kvl + 7 of matrix m = lane / 8.
            mm = m
            # Matrix mm covers kv rows 16 w + 8 (mm & 1) + (0..7), q cols 16 kk + 8 (mm >> 1) + (0..7).
            for x in range(8):
                kvr = 16 * w + 8 * (mm & 1) + x
                box[(addr + 2 * x) // 2] = dST[kvr, qq]
    assert not np.isnan(box).any()
    # Read back as TMA / wgmma see the 128B-swizzled box.
    dS_read = np.zeros((BM, BN))
    for o in range(0, BM * 128, 2):
        row = o // 128
        col = (((o // 16) % 8) ^ (row % 8)) * 8 + (o % 16) // 2
        dS_read[row, col] = box[o // 2]
    assert np.array_equal(dS_read, dST.T), "dS box layout"
    dq_full = dS_read @ K  # [q][d]; each warpgroup computes columns [128 cw, +128)

    # Atomics' destinations after the lane-pair shuffle.
    dq_acc = np.zeros((BM, D))
    hits = np.zeros((BM, D), dtype=int)
    for cw in range(2):
        half = dq_full[:, 128 * cw:128 * cw + 128]
        reg = np.zeros((128, 64))
        for tid in range(128):
            w, lane = tid // 32, tid % 32
            g, t4 = lane // 4, lane % 4
            for j in range(16):
                for e in range(4):
                    reg[tid, 4 * j + e] = half[16 * w + g + 8 * (e >> 1), 8 * j + 2 * t4 + (e & 1)]
        for tid in range(128):
            w, lane = tid // 32, tid % 32
            g, t4 = lane // 4, lane % 4
            odd = t4 & 1
            partner = tid ^ 1
            qi = qt + w * 16 + g + (8 if odd else 0)
            col = cw * 128 + 2 * t4 - (2 if odd else 0)
            for j in range(16):
                r0 = reg[partner, 4 * j + 0] if (partner % 4) & 1 else reg[partner, 4 * j + 2]
                r1 = reg[partner, 4 * j + 1] if (partner % 4) & 1 else reg[partner, 4 * j + 3]
                v4 = ([r0, r1, reg[tid, 4 * j + 2], reg[tid, 4 * j + 3]] if odd
                      else [reg[tid, 4 * j + 0], reg[tid, 4 * j + 1], r0, r1])
                if qi < qb:
                    dq_acc[qi - qt, col + 8 * j:col + 8 * j + 4] += v4
                    hits[qi - qt, col + 8 * j:col + 8 * j + 4] += 1
    valid = qt + np.arange(BM) < qb
    assert (hits[valid] == 1).all() and (hits[~valid] == 0).all(), "dQ atomics coverage"
    dq_bulk = stage_dq(dq_full, qt, qb)
    assert (dq_bulk[~valid] == 0).all(), "bulk dQ: rows >= qb not added as 0"

    # Epilogue mapping (unsplit): rows r < klen, columns 8 j + 2 t4 (+1), from acc[4 j + 2 hr (+1)].
    def epilogue(acc_mat):
        out = np.full((BN, D), np.nan)
        for tid in range(128):
            w, lane = tid // 32, tid % 32
            g, t4 = lane // 4, lane % 4
            for hr in range(2):
                r = w * 16 + g + hr * 8
                if r < klen:
                    for j in range(32):
                        c = j * 8 + 2 * t4
                        out[r, c], out[r, c + 1] = acc_mat[r, c], acc_mat[r, c + 1]
        return out

    e_dv, e_dk = epilogue(dv), epilogue(dk)
    assert not np.isnan(e_dv[:klen]).any() and np.isnan(e_dv[klen:]).all(), "epilogue rows"
    tol = 1e-9
    for name, got, ref in (("dv", e_dv[:klen], ref_dv[:klen]), ("dk", e_dk[:klen], ref_dk[:klen]),
                           ("dq", dq_acc[valid], ref_dq[valid]), ("dq bulk", dq_bulk[valid], ref_dq[valid])):
        err = np.abs(got - ref).max() / max(1.0, np.abs(ref).max())
        assert err < tol, f"{name}: rel err {err:.3e} (k0={k0}, klen={klen}, qt={qt}, qb={qb})"
    return True


MUTANTS = ("stage_no_xor", "stage_row8", "stage_box", "stage_no_zero", "stage_same_buf", "rowstat_rowmajor")
SHARED_MUTANTS = {"stage_no_xor": "no_xor", "stage_box": "box_per_block"}  # planted in dq_staging_model.store_addr


def main():
    global MUTANT
    if len(sys.argv) == 3 and sys.argv[1] == "--mutant" and sys.argv[2] in MUTANTS:
        MUTANT = sys.argv[2]
    elif len(sys.argv) != 1:
        print(f"usage: {sys.argv[0]} [--mutant {'|'.join(MUTANTS)}]")
        return 2
    rng = np.random.default_rng(5)
    cases = [(0, 64, 0, 64), (0, 37, 0, 37), (100, 64, 100, 150), (100, 1, 100, 101),
             (0, 64, 64, 100), (64, 64, 0, 64), (7, 50, 40, 90), (0, 64, 200, 264)]
    if MUTANT:
        try:
            for c in cases:
                emulate(*c, rng)
        except AssertionError as e:
            print(f"mutant {MUTANT} caught: {e}")
            return 0
        print(f"mutant {MUTANT} NOT caught")
        return 1
    for c in cases:
        emulate(*c, rng)
    print(f"ok: {len(cases)} items (tails, diagonal tiles, rows past qb): P hand-over, dS, A fragments, "
          f"dS box layout, dQ atomics, bulk dQ staging, epilogue all match float64")
    return 0


if __name__ == "__main__":
    sys.exit(main())
