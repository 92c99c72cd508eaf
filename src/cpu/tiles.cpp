#include "cpu/tiles.h"

#include <algorithm>
#include <cmath>

namespace dualkv::detail::cpu {

std::vector<QueryTile> query_tiles(const ForestView& f, int32_t rows) {
  std::vector<QueryTile> tiles;
  for (int32_t s = 0; s < f.num_segments; ++s)
    for (int32_t b = f.segment_begin(s); b < f.segment_end(s); b += rows)
      tiles.push_back({s, b, std::min(b + rows, f.segment_end(s))});
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
  // Ancestors root first: collect the chain bottom-up, then emit it reversed.
  int32_t chain_length = 0;
  for (int32_t a = f.parent[tile.segment]; a >= 0; a = f.parent[a]) ++chain_length;
  std::vector<int32_t> chain(static_cast<size_t>(chain_length));
  for (int32_t a = f.parent[tile.segment], i = chain_length - 1; a >= 0; a = f.parent[a], --i)
    chain[static_cast<size_t>(i)] = a;
  for (int32_t a : chain)
    for (int32_t b = f.segment_begin(a); b < f.segment_end(a); b += cols)
      blocks->push_back({a, b, std::min(b + cols, f.segment_end(a)), false});
  // Own segment, causal: keys up to the tile's last row; a block is masked iff its last key lies
  // after the tile's first row.
  for (int32_t b = f.segment_begin(tile.segment); b < tile.end; b += cols) {
    const int32_t e = std::min(b + cols, tile.end);
    blocks->push_back({tile.segment, b, e, e - 1 > tile.begin});
  }
}

void mask_block(const ForestView& f, const QueryTile& tile, const KeyBlock& block, float* scores, int64_t ld) {
  for (int32_t q = tile.begin; q < tile.end; ++q) {
    float* row = scores + (q - tile.begin) * ld;
    for (int32_t k = block.begin; k < block.end; ++k)
      if (!f.visible(tile.segment, q, block.segment, k)) row[k - block.begin] = -INFINITY;
  }
}

}  // namespace dualkv::detail::cpu
