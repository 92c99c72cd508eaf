#!/usr/bin/env python3
"""CPU model of the D <= 128 Hopper backward's dQ staging stores (src/cuda/sm90/bwd_kernel.cuh,
bwd_stage_dq_fragment and its caller), per thread, with the kernel's formulas:

  - a thread (warp w, lane: g = lane / 4, t4 = lane % 4) holds the dQ accumulator fragment of rows
    r0 = 16 w + g and r0 + 8, element 4 j + e at column 8 j + 2 t4 + (e & 1) (+8 rows for e >= 2);
  - store k of a lane writes block j = k (t4 < 2) or j = k ^ 2 (t4 >= 2) at
    row_base + (k / 4) box_bytes + ((2 (k % 4)) XOR x) * 16 (+ 8 x 128 for row r0 + 8), with
    row_base = box0 * box_bytes + r0 * 128 + (t4 & 1) * 8 and x = (t4 >= 2 ? 5 : 0) XOR g.

Checked against the layout the dQ writer's TMA reduce reads (a box of 64 rows x 32 fp32 columns,
128-byte rows, 128B swizzle: byte o holds row o / 128, 16-byte chunk ((o / 16) % 8) XOR (row % 8),
word (o / 4) % 4), for the three staging shapes (D 128: each warpgroup's 64 columns of a 64-row step;
D 64: all 64 columns of its 64-row block of a 128-row step; D 64 with a softcap: 32 columns of a 64-row
step): every element lands where the reduce reads it, every staged byte is written once, and each
64-bit store is bank-conflict free within each half-warp (lanes 0-15 and 16-31 are served apart: two
lanes of a half-warp on one bank at different addresses cost a wavefront more).
--mutant column_order (every lane writes block k, the order before session 41: two-way conflicted per
half-warp) and --mutant no_xor (x without g) must each fail a check; exit status 0 when they do.
"""
from __future__ import annotations

import argparse
import sys

BOX_BYTES = 64 * 128


def store_plan(n_cols: int, box0: int, mutant: str = ""):
    """Per warp and store instruction (k, row half): [(lane, byte address, (row, column) of its
    first word)], the kernel's formulas for one warp (rows 0..15 of the warp: the row offset 16 w
    moves every address by a multiple of 128 bytes, which changes neither the box nor the bank)."""
    n_blocks = n_cols // 8  # 8-column blocks j (the fragment's N / 4)
    plan = {}
    for lane in range(32):
        g, t4 = lane // 4, lane % 4
        if mutant == "column_order":  # block k in every lane: chunk (2 (k % 4) + t4 / 2) XOR g
            hi, x = False, (t4 >> 1) ^ g
        else:
            hi = t4 >= 2
            x = (5 if hi else 0) ^ (0 if mutant == "no_xor" else g)
        row_base = box0 * BOX_BYTES + g * 128 + (t4 & 1) * 8
        for k in range(n_blocks):
            j = k ^ 2 if hi else k
            addr = row_base + (k // 4) * BOX_BYTES + (((2 * (k % 4)) ^ x) << 4)
            col = 8 * j + 2 * t4
            plan.setdefault((k, 0), []).append((lane, addr, (g, col)))
            plan.setdefault((k, 1), []).append((lane, addr + 8 * 128, (g + 8, col)))
    return plan


def reduce_reads(addr: int, box0: int):
    """(row, column) the TMA reduce takes from byte `addr` of the staging (4-byte word)."""
    box, o = divmod(addr, BOX_BYTES)
    row = o // 128
    chunk = ((o // 16) % 8) ^ (row % 8)
    word = (o // 4) % 4
    return row, (box - box0) * 32 + chunk * 4 + word


def check(n_cols: int, box0: int, mutant: str = "") -> list[str]:
    errors = []
    written = {}
    for (k, half), stores in store_plan(n_cols, box0, mutant).items():
        for lane, addr, (row, col) in stores:
            for w in range(2):  # the two fp32 words of the float2
                got = reduce_reads(addr + 4 * w, box0)
                if got != (row, col + w):
                    errors.append(f"cols {n_cols}: store {k}.{half} lane {lane} word {w}: wrote ({row}, {col + w}) "
                                  f"where the reduce reads {got}")
                if addr + 4 * w in written:
                    errors.append(f"cols {n_cols}: byte {addr + 4 * w} written twice")
                written[addr + 4 * w] = (row, col + w)
        for part in (range(16), range(16, 32)):  # 64-bit stores: each half-warp apart
            banks = {}
            for lane, addr, _ in (s for s in stores if s[0] in part):
                for w in range(2):
                    banks.setdefault(((addr + 4 * w) // 4) % 32, set()).add(addr + 4 * w)
            worst = max(len(a) for a in banks.values())
            if worst > 1:
                errors.append(f"cols {n_cols}: store {k}.{half} lanes {part.start}-{part.stop - 1}: "
                              f"{worst}-way bank conflict")
    expected = {(r, c) for r in range(16) for c in range(n_cols)}
    if set(written.values()) != expected:
        errors.append(f"cols {n_cols}: {len(expected - set(written.values()))} elements not staged")
    return errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mutant", choices=["column_order", "no_xor"], default="")
    args = ap.parse_args()
    # (columns a warpgroup stages, its first box): D 128 warpgroup 1 (columns 64..127 of a 64-row step:
    # boxes 2, 3), D 64's 128-row steps (warpgroup 1: its block's boxes 2..3 of 4), D 64 softcap
    # (warpgroup 1: columns 32..63, box 1)
    shapes = [(64, 2), (64, 0), (32, 1)]
    errors = [e for n, b in shapes for e in check(n, b, args.mutant)]
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
