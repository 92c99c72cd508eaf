#!/usr/bin/env python3
"""CPU model of the Hopper backward's dQ staging (src/cuda/sm90: bwd_stage_dq_fragment and its callers
in bwd_kernel.cuh / bwd_kernel_d256.cuh, dq_stage_row and make_dq_accum_map in tma.h), per thread,
with the kernels' formulas:

  - a thread (warp w, lane: g = lane / 4, t4 = lane % 4) holds the dQ accumulator fragment of box rows
    i = 16 w + g and i + 8, element 4 k + e at column 8 k + 2 t4 + (e & 1) (+8 rows for e >= 2);
  - store k writes block k at row_base + (k / 4) box_bytes + ((2 (k % 4) + t4 / 2) XOR x) * 16
    (+ 8 x 128 for row i + 8), with row_base = box0 * box_bytes + dq_stage_row(i) * 128 + (t4 & 1) * 8
    and x = dq_stage_row(g), dq_stage_row(i) = ((i >> 2) & 1) | ((i & 3) << 1) | (i & ~7).

Checked against what the dQ writer's TMA reduce reads through the 4-d tensor map (a box of 64 rows x
32 fp32 columns, 128-byte rows, 128B swizzle: byte o holds smem row p = o / 128, 16-byte chunk
((o / 16) % 8) XOR (p % 8), word (o / 4) % 4; smem row p = x1 + 2 x2 + 8 x3 holds box row
x2 + 4 x1 + 8 x3), for the four staging shapes (D 128: each warpgroup's 64 columns of a 64-row step;
D 64: all 64 columns of its 64-row block of a 128-row step; D 64 with a softcap: 32 columns; D 256: a
warpgroup's 128 columns): every element lands where the reduce reads it, every staged byte is written
once, each 64-bit store is bank-conflict free within each half-warp (lanes 0-15 and 16-31 are served
apart), and the map's per-dim bounds (rows coordinate first + x2 < T) skip only rows past T and reach
at most kDqAccumPadRows - 4 rows past it.
Mutants, each of which must fail a check (exit status 0 when caught): rows_in_place (box row i at smem
row i and x = g in the stores and in the reduce: the order before, placed right but two-way conflicted
per half-warp), no_xor (x = 0), map_3d (the reduce reads box row p at smem row p while the stores move
rows).
"""
from __future__ import annotations

import argparse
import sys

BOX_ROWS = 64
BOX_BYTES = BOX_ROWS * 128
PAD_ROWS = 64  # kDqAccumPadRows (src/cuda/kernel_params.h)


def dq_stage_row(i: int) -> int:
    return ((i >> 2) & 1) | ((i & 3) << 1) | (i & ~7)


def box_row_of_smem_row(p: int, mutant: str = "") -> int:
    """The box row the 4-d map's reduce takes from smem row p (x1 = p bit 0, x2 = bits 1-2, x3 = bits 3-5)."""
    if mutant == "map_3d":
        return p
    x1, x2, x3 = p & 1, (p >> 1) & 3, p >> 3
    return x2 + 4 * x1 + 8 * x3


def store_plan(n_cols: int, box0: int, mutant: str = ""):
    """Per warp and store instruction (warp, k, row half): [(lane, byte address, (box row, column) of its
    first word)], the kernels' formulas."""
    n_blocks = n_cols // 8  # 8-column blocks k (the fragment's N / 4)
    plan = {}
    for warp in range(4):
        for lane in range(32):
            g, t4 = lane // 4, lane % 4
            i = 16 * warp + g
            if mutant == "rows_in_place":
                row, x = i, g
            else:
                row, x = dq_stage_row(i), (0 if mutant == "no_xor" else dq_stage_row(g))
            row_base = box0 * BOX_BYTES + row * 128 + (t4 & 1) * 8
            for k in range(n_blocks):
                addr = row_base + (k // 4) * BOX_BYTES + (((2 * (k % 4) + (t4 >> 1)) ^ x) << 4)
                col = 8 * k + 2 * t4
                plan.setdefault((warp, k, 0), []).append((lane, addr, (i, col)))
                plan.setdefault((warp, k, 1), []).append((lane, addr + 8 * 128, (i + 8, col)))
    return plan


def reduce_reads(addr: int, box0: int, mutant: str = ""):
    """(box row, column) the TMA reduce takes from byte `addr` of the staging (4-byte word)."""
    box, o = divmod(addr, BOX_BYTES)
    p = o // 128
    chunk = ((o // 16) % 8) ^ (p % 8)
    word = (o // 4) % 4
    in_place = "map_3d" if mutant in ("map_3d", "rows_in_place") else ""
    return box_row_of_smem_row(p, in_place), (box - box0) * 32 + chunk * 4 + word


def check_bounds() -> list[str]:
    """The 4-d map's bounds: a box starting at row qt < T reads rows qt + x2 + 4 x1 + 8 x3 where the
    rows coordinate qt + x2 (x2 < 4) alone is checked against T. Every box row below T must be added,
    only rows past T skipped, and none past T + PAD_ROWS - 1 reached."""
    errors = []
    T = 1000
    for qt in range(T - BOX_ROWS - 8, T):
        for x1 in range(2):
            for x2 in range(4):
                for x3 in range(8):
                    row = qt + x2 + 4 * x1 + 8 * x3
                    added = qt + x2 < T
                    if not added and row < T:
                        errors.append(f"bounds: qt {qt}: row {row} < T skipped")
                    if added and row >= T + PAD_ROWS:
                        errors.append(f"bounds: qt {qt}: row {row} past the padding")
    return errors[:5]


def check(n_cols: int, box0: int, mutant: str = "") -> list[str]:
    errors = []
    written = {}
    for (warp, k, half), stores in store_plan(n_cols, box0, mutant).items():
        for lane, addr, (row, col) in stores:
            for w in range(2):  # the two fp32 words of the float2
                got = reduce_reads(addr + 4 * w, box0, mutant)
                if got != (row, col + w):
                    errors.append(f"cols {n_cols}: warp {warp} store {k}.{half} lane {lane} word {w}: wrote "
                                  f"({row}, {col + w}) where the reduce reads {got}")
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
                errors.append(f"cols {n_cols}: warp {warp} store {k}.{half} lanes {part.start}-{part.stop - 1}: "
                              f"{worst}-way bank conflict")
    expected = {(r, c) for r in range(BOX_ROWS) for c in range(n_cols)}
    if set(written.values()) != expected:
        errors.append(f"cols {n_cols}: {len(expected - set(written.values()))} elements not staged")
    return errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mutant", choices=["rows_in_place", "no_xor", "map_3d"], default="")
    args = ap.parse_args()
    # (columns a warpgroup stages, its first box): D 128 warpgroup 1 (columns 64..127 of a 64-row step:
    # boxes 2, 3), D 64's 128-row steps (warpgroup 1: its block's boxes 0..1), D 64 softcap (warpgroup 1:
    # columns 32..63, box 1), D 256 (a warpgroup's half in its own Q or dO stage: boxes 0..3)
    shapes = [(64, 2), (64, 0), (32, 1), (128, 0)]
    errors = [e for n, b in shapes for e in check(n, b, args.mutant)] + check_bounds()
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
    print(f"ok: {len(shapes)} staging shapes, every element where the reduce reads it, conflict-free half-warps, "
          f"rows past T only in the padding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
