"""Computed tile area per useful (q, k) pair: dualkv's segment walks against a dense kernel's tiling
of the unpacked rows, on the layout classes (bench/layout_classes.py). No library or GPU needed.

    python3 tools/tile_area_model.py [--classes long_responses,tree] [--bm 128] [--bn 64,80,128,160]

- dualkv (the plan's rule, restated): query tiles of --bm rows from each segment's start; a tile
  walks every ancestor segment whole in --bn-key tiles from the ancestor's start, then its own
  segment up to its last row. Each ancestor's last tile is ragged unless its length is a multiple
  of --bn. Not modelled: the forward's tiles of sibling leaves (several short leaves in one query
  tile), which matter for tiny responses only.
- dense (FA4 / cuDNN on the unpacked copies): each root-to-leaf row is one contiguous sequence,
  query tiles of --bm rows from its start, --bn-key tiles from its start up to the tile's last row:
  one ragged tile per query tile, at the diagonal.
- Packed query heads (--pack G for dualkv, --dense-pack G for the dense kernel; FA4's forward packs
  its heads by default: pack_gqa, G = H / Hk): a --bm-row tile holds --bm / G tokens of the G query
  heads of one KV head, so the walks above run per --bm / G tokens.
- Walk-to-rows (--walk-to-rows; the Hopper forward's long-walk builds, docs/notes/
  2026-12-07-fwd-walk-to-rows.md): each 64-row warpgroup of a query tile walks only up to its own
  last row, so the causal diagonal costs a warpgroup's rows rather than a tile's; counted in
  warpgroup-tiles (packed_tiles' wg). --ragged-keys K also charges each ancestor's ragged last KV
  tile its keys rounded up to K only (a kernel that narrows its products there), and --ragged-own
  each warpgroup's last own KV tile too (the keys up to its last row). Session 63 built both in the
  D-256 long-walk forward and measured it slower (docs/notes/2026-12-08-d256-fwd-narrowed-ragged-tiles.md).
- Printed per class and --bn: tiles, computed area / useful pairs for both, and their ratio
  (dualkv's area per useful pair over dense's: above 1, dualkv computes more masked area per
  useful FLOP than the dense kernel; a per-tile rate equal to dense's then loses that much).

Session 49 (docs/benchmarks.md): at D 256 (128 x 80 tiles) long responses read 1.018, from the
prompts' ragged last KV tile (256 = 3 x 80 + 16) walked by every response tile, beside the D-256
forward's 3% never-lose gap and +3% executed instructions against FA4's; at 128 x 128 (D 128) and
192 x 128 (D 64) 0.999 / 1.006. A junction tile that brings it to dense's area measured 1.02-1.04x the
forward's time (session 50, docs/decisions.md): the kernel's added instructions outweighed the area.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))  # layout_classes builds its GRPO groups with dualkv.Layout
sys.path.insert(0, str(ROOT / "bench"))

from layout_classes import CLASSES, layout_class, root_paths

# Session 57 (docs/notes/2026-12-07-fwd-packed-query-heads.md): with --dense-pack 4 this model gives
# FA4 dense's D-256 forward on long responses (H 32 / Hk 8) exactly the wgmmas ncu counted (1,701,952
# warpgroup-tiles), and dualkv's unpacked walks exactly ours (1,789,568): 5.1% more; packing ours
# (--pack 4) leaves the prompts' ragged tiles (1.7%).


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def tile_pairs(q0: int, q1: int) -> int:
    """Causal pairs of query rows q0..q1-1 over keys 0..q (positions within one sequence)."""
    return (q1 * (q1 + 1) - q0 * (q0 + 1)) // 2


def range_tiles(keys: int, bn: int, ragged_keys: int = 0):
    """KV tiles of a walk over `keys` keys of one range: its ragged last tile is one tile, or with
    ragged_keys > 0 the fraction its keys take rounded up to a multiple of ragged_keys."""
    whole, rest = divmod(keys, bn)
    if not rest:
        return whole
    return whole + (ceil_div(rest, ragged_keys) * ragged_keys / bn if ragged_keys else 1)


def packed_tiles(lens, parents, bm: int, bn: int, wg: int = 0, ragged_keys: int = 0, ragged_own: bool = False):
    """(KV tiles, useful pairs) of dualkv's walks over the forest (lens, parents).

    wg > 0 counts warpgroup-tiles instead, for query tiles of bm / wg warpgroups of wg rows each
    walking to its own last row (the Hopper forward's walk-to-rows; a warpgroup past a ragged
    tile's end walks nothing). Each tile's whole walk times bm / wg is the count without it.
    ragged_keys > 0 charges an ancestor's ragged last tile only its keys rounded up to a multiple of
    ragged_keys (a fraction of a tile: narrower products there); with ragged_own, so is each walk's last
    own tile."""
    tiles = pairs = 0
    rows = wg or bm  # the rows of one walk
    own_ragged_keys = ragged_keys if ragged_own else 0
    for s, length in enumerate(lens):
        ancestors, p = [], parents[s]
        while p >= 0:
            ancestors.append(lens[p])
            p = parents[p]
        prefix_tiles = sum(range_tiles(a, bn, ragged_keys) for a in ancestors)
        for q0 in range(0, length, bm):
            q1 = min(q0 + bm, length)
            tiles += sum(prefix_tiles + range_tiles(min(w + rows, q1), bn, own_ragged_keys)
                         for w in range(q0, q1, rows))
            pairs += (q1 - q0) * sum(ancestors) + tile_pairs(q0, q1)
    return tiles, pairs


def dense_tiles(rows, bm: int, bn: int):
    """(KV tiles, useful pairs) of a dense causal kernel over the unpacked rows."""
    tiles = pairs = 0
    for length in rows:
        for q0 in range(0, length, bm):
            q1 = min(q0 + bm, length)
            tiles += ceil_div(q1, bn)
            pairs += tile_pairs(q0, q1)
    return tiles, pairs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--classes", default=",".join(CLASSES))
    ap.add_argument("--bm", type=int, default=128, help="query rows per tile (D 64's Hopper forward: 192)")
    ap.add_argument("--bn", default="64,80,128,160", help="KV rows per tile, comma-separated")
    ap.add_argument("--pack", type=int, default=1, help="dualkv's query heads per tile (G; --bm / G tokens)")
    ap.add_argument("--dense-pack", type=int, default=1, help="the dense kernel's query heads per tile (FA4: H / Hk)")
    ap.add_argument("--walk-to-rows", action="store_true",
                    help="also count dualkv's warpgroup-tiles with each 64-row warpgroup walking to its own last row")
    ap.add_argument("--ragged-keys", type=int, default=0,
                    help="with --walk-to-rows: also charge each ancestor's ragged last KV tile only its keys rounded "
                         "up to this multiple (16: one P V k-step)")
    ap.add_argument("--ragged-own", action="store_true",
                    help="with --ragged-keys: also each warpgroup's last own KV tile (its keys up to its last row)")
    args = ap.parse_args()
    if args.ragged_keys and not args.walk_to_rows:
        ap.error("--ragged-keys counts on top of --walk-to-rows: give both")
    if args.ragged_own and not args.ragged_keys:
        ap.error("--ragged-own counts on top of --ragged-keys: give both")
    tq, tqd = args.bm // args.pack, args.bm // args.dense_pack  # tokens per tile
    wgs = args.bm // 64  # warpgroups per tile
    for name in args.classes.split(","):
        lens, parents = layout_class(name)
        rows = root_paths(lens, parents)
        for bn in (int(b) for b in args.bn.split(",")):
            t, p = packed_tiles(lens, parents, tq, bn)
            td, pd = dense_tiles(rows, tqd, bn)
            area, area_dense = t * tq * bn / p, td * tqd * bn / pd
            line = (f"{name:15s} {args.bm} x {bn:3d}: dualkv {t:7d} tiles, area/useful {area:.3f} | dense {td:7d} "
                    f"tiles, {area_dense:.3f} | dualkv / dense {area / area_dense:.3f}")
            if args.walk_to_rows:  # warpgroup-tiles: t * wgs without walk-to-rows
                tw, _ = packed_tiles(lens, parents, tq, bn, wg=tq // wgs)
                area_rows = tw * (tq // wgs) * bn / p
                line += (f" | walk-to-rows: {tw / (t * wgs):.3f} of the tiles' walks, area/useful {area_rows:.3f}, "
                         f"/ dense {area_rows / area_dense:.3f}")
                if args.ragged_keys:
                    tr, _ = packed_tiles(lens, parents, tq, bn, wg=tq // wgs, ragged_keys=args.ragged_keys,
                                         ragged_own=args.ragged_own)
                    line += (f" | narrow ragged tiles: {tr / tw:.3f} of that, "
                             f"/ dense {tr / tw * area_rows / area_dense:.3f}")
            print(line)


if __name__ == "__main__":
    main()
