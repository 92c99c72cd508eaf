"""tools/tile_area_model.py counts tiles and useful pairs as the walks it restates: its useful pairs
equal the reference mask's on a forest, the packed and dense counts agree where nothing is shared
and no segment edge is ragged, and each ragged prompt edge costs one KV tile per response query tile."""
from __future__ import annotations

import pathlib
import sys

import dualkv
from dualkv.reference import visibility_mask

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
import tile_area_model as tam  # noqa: E402


def test_useful_pairs_match_the_reference_mask():
    layout = dualkv.Layout.from_groups([300, 77], [[200, 5, 129], [64]])
    lens, parents = layout.segment_lens, layout.parents
    _, pairs = tam.packed_tiles(lens, parents, 128, 80)
    assert pairs == int(visibility_mask(layout).sum())
    _, dense_pairs = tam.dense_tiles([300 + 200, 300 + 5, 300 + 129, 77 + 64], 128, 80)
    assert dense_pairs == sum(n * (n + 1) // 2 for n in (500, 305, 429, 141))


def test_aligned_prompt_costs_what_the_dense_tiling_costs():
    # one response under a prompt that is a whole number of KV tiles: the same tiles as the
    # contiguous sequence, since the response's query tiles start where the dense ones do
    lens, parents = [256, 256], [-1, 0]
    assert tam.packed_tiles(lens, parents, 128, 64) == tam.dense_tiles([512], 128, 64)


def test_ragged_prompt_costs_one_tile_per_response_query_tile():
    lens, parents = [256, 512], [-1, 0]  # 256 = 3 x 80 + 16
    packed, pairs = tam.packed_tiles(lens, parents, 128, 80)
    dense, dense_pairs = tam.dense_tiles([768], 128, 80)
    assert pairs == dense_pairs
    # prompt rows: 2 + 4 tiles either way; the response's 4 query tiles walk 4 prompt tiles plus
    # ceil(q1 / 80) own ones (2, 4, 5, 7) packed, ceil((256 + q1) / 80) (5, 7, 8, 10) dense
    assert packed == 6 + 4 * 4 + (2 + 4 + 5 + 7)
    assert dense == 6 + (5 + 7 + 8 + 10)


def test_packed_heads_tile_counts_match_the_kernels_wgmmas():
    # Session 57: Nsight Compute counted 1,789,568 (dualkv, one head per tile) and 1,701,952 (FA4 dense,
    # pack_gqa: 4 heads of 32 tokens per tile) warpgroup-tiles of 64 x 80 wgmmas in the D-256 forward on
    # long responses (H 32, Hk 8, two warpgroups per 128-row tile): the model's walks give both exactly.
    lens, parents = tam.layout_class("long_responses")
    ours, _ = tam.packed_tiles(lens, parents, 128, 80)
    fa4, _ = tam.dense_tiles(tam.root_paths(lens, parents), 128 // 4, 80)
    assert ours * 32 * 2 == 1_789_568
    assert fa4 * 8 * 2 == 1_701_952


def test_walk_to_rows_counts_each_warpgroup_to_its_own_last_row():
    # one 128-row tile of a 128-token segment in 64-key tiles: without walk-to-rows both warpgroups
    # walk both KV tiles (4 warpgroup-tiles); with it the first stops after one (3)
    assert tam.packed_tiles([128], [-1], 128, 64) == (2, 128 * 129 // 2)
    assert tam.packed_tiles([128], [-1], 128, 64, wg=64) == (3, 128 * 129 // 2)
    # a ragged tile: a warpgroup past the segment's end walks nothing; each walks the prompt whole
    assert tam.packed_tiles([100, 50], [-1, 0], 128, 64, wg=64)[0] == (1 + 2) + (2 + 1)
    # one warpgroup per tile is the tile's walk
    lens, parents = tam.layout_class("tree")
    assert tam.packed_tiles(lens, parents, 128, 80, wg=128) == tam.packed_tiles(lens, parents, 128, 80)


def test_narrow_ragged_tiles_charge_the_prompts_last_tile_its_keys():
    # 256 = 3 x 80 + 16: each response warpgroup walks 3 whole prompt tiles and 16 / 80 of the 4th
    lens, parents = [256, 128], [-1, 0]
    prompt = 1 + 2 + 3 + 4  # the prompt's own four warpgroups, to their last rows
    assert tam.packed_tiles(lens, parents, 128, 80, wg=64)[0] == prompt + 2 * 4 + (1 + 2)
    narrow, _ = tam.packed_tiles(lens, parents, 128, 80, wg=64, ragged_keys=16)
    assert abs(narrow - (prompt + 2 * 3.2 + (1 + 2))) < 1e-9


def test_narrow_own_tiles_charge_each_warpgroups_last_tile_its_keys():
    # ragged_own: each warpgroup's last own tile costs its keys up to the warpgroup's last row, in
    # 16-key blocks: a walk of 64 keys 0.8 tiles, of 128 1.6, of 192 2.4, of 256 3.2
    lens, parents = [256, 128], [-1, 0]
    narrow, _ = tam.packed_tiles(lens, parents, 128, 80, wg=64, ragged_keys=16, ragged_own=True)
    assert abs(narrow - ((0.8 + 1.6 + 2.4 + 3.2) + 2 * 3.2 + (0.8 + 1.6))) < 1e-9
