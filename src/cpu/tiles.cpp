#include "cpu/tiles.h"

#include <algorithm>
#include <cmath>

namespace dualkv::detail::cpu {

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

void key_blocks(const ForestView& f, const QueryTile& tile, int32_t cols, std::vector<KeyBlock>* blocks) {
  blocks->clear();
  // Ancestors root first (the tile's segments share their parent): collect the chain bottom-up,
  // then emit it reversed.
  int32_t chain_length = 0;
  for (int32_t a = f.parent[tile.first_segment]; a >= 0; a = f.parent[a]) ++chain_length;
  std::vector<int32_t> chain(static_cast<size_t>(chain_length));
  for (int32_t a = f.parent[tile.first_segment], i = chain_length - 1; a >= 0; a = f.parent[a], --i)
    chain[static_cast<size_t>(i)] = a;
  for (int32_t a : chain) {
    const bool prefix = f.is_external(a);
    const int32_t begin = prefix ? f.prefix_begin(a) : f.segment_begin(a), end = prefix ? f.prefix_end(a) : f.segment_end(a);
    for (int32_t b = begin; b < end; b += cols)
      blocks->push_back({a, b, std::min(b + cols, end), tile.begin, tile.end, false, prefix});
  }
  // Each segment of the tile, causal: its rows in the tile see its keys up to the last of them.
  // Keys before the segment's first row in the tile are seen in full (their blocks end at that
  // row); the blocks from there on cross the diagonal. Rows before a block's first key see none
  // of it; a block is masked iff its last key lies after its first row.
  for (int32_t s = tile.first_segment; s < f.num_segments && f.segment_begin(s) < tile.end; ++s) {
    const int32_t rows_begin = std::max(tile.begin, f.segment_begin(s)), rows_end = std::min(tile.end, f.segment_end(s));
    for (int32_t b = f.segment_begin(s); b < rows_end;) {
      const int32_t width = b < rows_begin ? std::min(cols, rows_begin - b) : cols;
      const int32_t e = std::min(b + width, rows_end), first_row = std::max(rows_begin, b);
      blocks->push_back({s, b, e, first_row, rows_end, e - 1 > first_row, false});
      b = e;
    }
  }
}

void mask_block(const ForestView&, const KeyBlock& block, float* scores, int64_t ld) {
  // The rows of a masked block are tokens of block.segment (ancestor blocks are never masked), and
  // ForestView::visible within one segment is k <= q: each row loses the keys after it. (A
  // position window would also drop the keys before pos(q) - W + 1 here.)
  for (int32_t q = block.row_begin; q < block.row_end; ++q) {
    float* row = scores + (q - block.row_begin) * ld;
    std::fill(row + std::clamp(q + 1 - block.begin, 0, block.end - block.begin), row + (block.end - block.begin),
              -INFINITY);
  }
}

}  // namespace dualkv::detail::cpu
