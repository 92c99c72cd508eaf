#!/usr/bin/env python3
"""CPU model of the Hopper backward's dQ staging (src/cuda/sm90: bwd_stage_dq_fragment and its callers in
bwd_kernel.cuh / bwd_kernel_d256.cuh, make_dq_accum_map in tma.h), per thread, with the kernels' formulas:

  - a thread (warp w, lane: g = lane / 4, t4 = lane % 4) holds the dQ accumulator fragment of rows
    r = row0 + 16 w + g and r + 8, element 4 k + e at column col0 + 8 k + 2 t4 + (e & 1) (+8 rows for e >= 2);
  - a box is 32 rows x 64 columns (8 KiB), row block major (box = (r / 32) n_cp + column / 64); its smem row
    p = 2 (r % 32) + b holds row r's 32-column block b;
  - row_base = box(r, col0) * 8192 + (2 (r % 32) + b0) * 128 + (t4 & 1) * 8 with b0 = (col0 / 32) % 2, and
    x = b0 | ((g & 3) << 1); store k writes block k at row_base + (k / 8) * 8192 + b * 128
    + ((2 (k % 4) + t4 / 2) XOR (x XOR b)) * 16 with b = (k / 4) % 2, row r + 8 at + 16 * 128.

Checked against what the dQ writer's TMA reduce reads through the 4-d tensor map (columns within a
32-column block, the block, head, token; box 32 x 2 x 1 x 32, 128B swizzle: byte o of a box holds smem
row p = o / 128, i.e. row p / 2 and column block p % 2, 16-byte chunk ((o / 16) % 8) XOR (p % 8), word
(o / 4) % 4), for the four staging shapes (D 128: a warpgroup's 64 columns of a 64-row step; D 64: all
64 columns of a warpgroup's 64 rows of a 128-row step; D 64 with a softcap: a warpgroup's 32 columns;
D 256: a warpgroup's 128 columns in its own stage): every element lands where the reduce reads it,
every staged byte is written once, and each 64-bit store is bank-conflict free within each half-warp
(lanes 0-15 and 16-31 are served apart: two lanes of a half-warp on one bank at different addresses
cost a wavefront more).
Mutants, each of which must fail a check (exit status 0 when caught): rows_in_place (the layout before:
64-row boxes of one 32-column block, smem row = row, x = g, in the stores and in the reduce: placed right
but two-way conflicted per half-warp), no_xor (x = 0), no_block_phase (the box's second column block
stored with the first block's phase), no_b0 (b0 taken as 0: the softcap shape's second warpgroup),
box_per_block (the next box every 32 columns instead of every 64). store_addr is also the D-256 model's
(tests/models/bwd_d256_fragment_model.py) staging formula.
"""
from __future__ import annotations

import argparse
import sys

BOX_BYTES = 32 * 2 * 128


def store_addr(r: int, lane: int, k: int, col0: int, n_cp: int, mutant: str = "") -> int:
    """Byte address (in the staging region) of the float2 that `lane` stores for fragment row r (its row
    or its row + 8) in store k, the kernels' formula. The row + 8 lands 16 smem rows (2 KiB) below the
    row without a separate formula: the fragment's rows sit at r % 32 < 24."""
    g, t4 = lane // 4, lane % 4
    chunk = 2 * (k % 4) + (t4 >> 1)
    if mutant == "rows_in_place":  # 64-row boxes of 32 columns, box = (r / 64) (cols / 32) + col / 32
        row_base = ((r // 64) * (n_cp * 2) + col0 // 32) * BOX_BYTES + (r % 64) * 128 + (t4 & 1) * 8
        return row_base + (k // 4) * BOX_BYTES + ((chunk ^ g) << 4)
    b0 = 0 if mutant == "no_b0" else (col0 // 32) % 2
    box = (r // 32) * n_cp + col0 // 64
    row_base = box * BOX_BYTES + (2 * (r % 32) + b0) * 128 + (t4 & 1) * 8
    x = 0 if mutant == "no_xor" else b0 | ((g & 3) << 1)
    b = (k // 4) % 2
    phase = x if mutant == "no_block_phase" else x ^ b
    box_step = k // 4 if mutant == "box_per_block" else k // 8
    return row_base + box_step * BOX_BYTES + b * 128 + ((chunk ^ phase) << 4)


def store_plan(n_cols: int, col0: int, row0: int, n_cp: int, mutant: str = ""):
    """Per warp and store instruction (warp, k, row half): [(lane, byte address, (row, column) of its first
    word)], the kernels' formulas (rows and columns of the step's staging region)."""
    plan = {}
    for warp in range(4):
        for lane in range(32):
            r = row0 + 16 * warp + lane // 4
            for k in range(n_cols // 8):
                col = col0 + 8 * k + 2 * (lane % 4)
                for half in range(2):
                    addr = store_addr(r + 8 * half, lane, k, col0, n_cp, mutant)
                    plan.setdefault((warp, k, half), []).append((lane, addr, (r + 8 * half, col)))
    return plan


def reduce_reads(addr: int, n_cp: int, mutant: str = ""):
    """(row, column) of the staging region the TMA reduce takes from byte `addr` (4-byte word)."""
    box, o = divmod(addr, BOX_BYTES)
    p = o // 128
    chunk = ((o // 16) % 8) ^ (p % 8)
    word = (o // 4) % 4
    if mutant == "rows_in_place":  # the 3-d map before: 64-row boxes of one 32-column block
        rb, cb = divmod(box, n_cp * 2)
        return 64 * rb + p, 32 * cb + 4 * chunk + word
    rb, cp = divmod(box, n_cp)
    return 32 * rb + p // 2, 64 * cp + 32 * (p % 2) + 4 * chunk + word


def check(name: str, n_cols: int, col0: int, row0: int, n_cp: int, mutant: str = "") -> list[str]:
    errors = []
    written = {}
    for (warp, k, half), stores in store_plan(n_cols, col0, row0, n_cp, mutant).items():
        for lane, addr, (row, col) in stores:
            for w in range(2):  # the two fp32 words of the float2
                got = reduce_reads(addr + 4 * w, n_cp, mutant)
                if got != (row, col + w):
                    errors.append(f"{name}: warp {warp} store {k}.{half} lane {lane} word {w}: wrote "
                                  f"({row}, {col + w}) where the reduce reads {got}")
                if addr + 4 * w in written:
                    errors.append(f"{name}: byte {addr + 4 * w} written twice")
                written[addr + 4 * w] = (row, col + w)
        for part in (range(16), range(16, 32)):  # 64-bit stores: each half-warp apart
            banks = {}
            for lane, addr, _ in (s for s in stores if s[0] in part):
                for w in range(2):
                    banks.setdefault(((addr + 4 * w) // 4) % 32, set()).add(addr + 4 * w)
            worst = max(len(a) for a in banks.values())
            if worst > 1:
                errors.append(f"{name}: warp {warp} store {k}.{half} lanes {part.start}-{part.stop - 1}: "
                              f"{worst}-way bank conflict")
    expected = {(r, c) for r in range(row0, row0 + 64) for c in range(col0, col0 + n_cols)}
    if set(written.values()) != expected:
        errors.append(f"{name}: {len(expected - set(written.values()))} elements not staged")
    return errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mutant", choices=["rows_in_place", "no_xor", "no_block_phase", "no_b0", "box_per_block"], default="")
    args = ap.parse_args()
    # (name, columns a warpgroup stages, its first column, its first row, 64-column boxes per 32-row block)
    shapes = [("D 128, warpgroup 1", 64, 64, 0, 2), ("D 64 by rows, warpgroup 1", 64, 0, 64, 1),
              ("D 64 softcap, warpgroup 1", 32, 32, 0, 1), ("D 256, a warpgroup's stage", 128, 0, 0, 2)]
    errors = [e for shape in shapes for e in check(*shape, args.mutant)]
    if args.mutant:
        if errors:
            print(f"mutant {args.mutant} caught: {errors[0]}")
            return 0
        print(f"mutant {args.mutant} NOT caught")
        return 1
    for e in errors[:20]:
        print(e)
    if errors:
        return 1
    print(f"ok: {len(shapes)} staging shapes, every element where the reduce reads it, conflict-free half-warps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
