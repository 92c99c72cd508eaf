#include "cpu/tiles.h"

#include <algorithm>
#include <cmath>

namespace dualkv::detail::cpu {

namespace {

// Calls fn(s, rows) for each segment s with rows in the tile (consecutive siblings from
// first_segment), rows being s's tokens in the tile.
template <typename Fn>
void for_each_tile_segment(const ForestView& f, const QueryTile& tile, Fn&& fn) {
  for (int32_t s = tile.first_segment; s < f.num_segments && f.segment_begin(s) < tile.end; ++s)
    fn(s, TokenRange{std::max(tile.begin, f.segment_begin(s)), std::min(tile.end, f.segment_end(s))});
}

// Appends the block of keys [b, e) of segment s seen by tile rows `rows`, narrowed to the rows
// the policy says see it, unless none does.
void add_block(const ForestView& f, PositionWindow w, int32_t s, int32_t b, int32_t e, TokenRange rows,
               int32_t q_pos_min, int32_t q_pos_max, bool own, std::vector<KeyBlock>* blocks) {
  const TokenRange seeing = SegmentMask::bwd_query_range(f, w, s, b, e - 1);
  const int32_t row_begin = std::max(rows.begin, seeing.begin), row_end = std::min(rows.end, seeing.end);
  if (row_begin >= row_end) return;
  if (own) {  // the rows are tokens of s: positions follow the tokens
    q_pos_min = f.position(s, row_begin);
    q_pos_max = f.position(s, row_end - 1);
  }
  const BlockPair pair{{b, e}, f.key_position(s, b), row_begin, row_end - 1, q_pos_min, q_pos_max, own};
  const TileKind kind = SegmentMask::block_kind(pair, w);
  if (kind != TileKind::kEmpty) blocks->push_back({pair, s, row_begin, row_end, kind != TileKind::kFull});
}

}  // namespace

std::vector<QueryTile> query_tiles(const ForestView& f, int32_t rows, bool stack_roots) {
  std::vector<QueryTile> tiles;
  // The last tile takes more rows while the next segment is another child of `open_parent` (-1:
  // another root). In DFS order a sibling directly follows one only if that one has no children,
  // so the rows of a tile share their ancestors.
  bool open = false;
  int32_t open_parent = -1;
  for (int32_t s = 0; s < f.num_segments; ++s) {
    const bool stackable = f.parent[s] >= 0 || stack_roots;
    if (!stackable || f.parent[s] != open_parent) open = false;
    for (int32_t t = f.segment_begin(s); t < f.segment_end(s);) {
      if (!open) {
        tiles.push_back({t, t, s});
        open = true;
        open_parent = f.parent[s];
      }
      QueryTile& tile = tiles.back();
      tile.end = t + std::min(f.segment_end(s) - t, rows - (tile.end - tile.begin));
      t = tile.end;
      if (tile.end - tile.begin == rows) open = false;
    }
    if (!stackable) open = false;
  }
  return tiles;
}

std::vector<Tree> trees(const ForestView& f) {
  std::vector<Tree> out;
  for (int32_t s = 0; s < f.num_segments; s = f.subtree_end[s])
    out.push_back({s, f.subtree_end[s], f.segment_begin(s), f.subtree_token_end(s)});
  return out;
}

void key_blocks(const ForestView& f, PositionWindow w, const QueryTile& tile, int32_t cols,
                std::vector<KeyBlock>* blocks) {
  blocks->clear();
  // The rows' positions: siblings share their ancestors' length, so a row's position is that plus
  // its offset in its own segment.
  int32_t pos_min = INT32_MAX, pos_max = INT32_MIN;
  for_each_tile_segment(f, tile, [&](int32_t s, TokenRange rows) {
    pos_min = std::min(pos_min, f.position(s, rows.begin));
    pos_max = std::max(pos_max, f.position(s, rows.end - 1));
  });
  const TokenRange tile_rows{tile.begin, tile.end};
  // Ancestors, nearest first: each seen by every row in full but for the window, which cuts off
  // a prefix of keys (and every ancestor above one it cuts off entirely).
  for (int32_t a = f.parent[tile.first_segment]; a >= 0; a = f.parent[a]) {
    const TokenRange keys = SegmentMask::keys_in_window(f, w, a, TokenRange{f.keys_begin(a), f.keys_end(a)}, pos_min);
    if (keys.begin == keys.end) break;
    for (int32_t b = keys.begin; b < keys.end; b += cols)
      add_block(f, w, a, b, std::min(b + cols, keys.end), tile_rows, pos_min, pos_max, false, blocks);
  }
  // Each segment of the tile, causal: its rows in the tile see its keys up to the last of them.
  // Keys before the segment's first row in the tile are seen in full (but for the window): their
  // blocks end at that row, so that they need no mask; the blocks from there on cross the diagonal.
  for_each_tile_segment(f, tile, [&](int32_t s, TokenRange rows) {
    const TokenRange keys =
        SegmentMask::keys_in_window(f, w, s, TokenRange{f.segment_begin(s), rows.end}, f.position(s, rows.begin));
    for (int32_t b = keys.begin; b < keys.end;) {
      const int32_t e = std::min(b + (b < rows.begin ? std::min(cols, rows.begin - b) : cols), keys.end);
      add_block(f, w, s, b, e, rows, 0, 0, true, blocks);
      b = e;
    }
  });
}

void mask_block(const ForestView& f, PositionWindow w, const QueryTile& tile, const KeyBlock& block, float* scores,
                int64_t ld) {
  // Each row keeps the keys the policy's row_keys gives it (the window hides a prefix, the causal
  // rule a suffix). The rows of an own block are tokens of its segment; those of an ancestor block
  // may belong to several sibling segments.
  const TokenRange keys = block.pair.keys;
  auto mask_rows = [&](int32_t s, TokenRange rows) {
    for (int32_t q = std::max(rows.begin, block.row_begin); q < std::min(rows.end, block.row_end); ++q) {
      const TokenRange seen = SegmentMask::row_keys(block.pair, w, q, f.position(s, q));
      float* row = scores + (q - block.row_begin) * ld;
      std::fill(row, row + (seen.begin - keys.begin), -INFINITY);
      std::fill(row + (seen.end - keys.begin), row + (keys.end - keys.begin), -INFINITY);
    }
  };
  if (block.pair.own)
    mask_rows(block.segment, TokenRange{block.row_begin, block.row_end});
  else
    for_each_tile_segment(f, tile, mask_rows);
}

}  // namespace dualkv::detail::cpu
