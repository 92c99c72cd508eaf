// Which (query tile, key block) pairs the blocked CPU attention computes, and which of their
// elements are masked: the segment-forest visibility rule of include/dualkv/layout.h, applied to
// tiles. Every mask decision of the blocked path is made here (a position window would be added
// to `key_blocks` and `mask_block`, nowhere else).
#ifndef DUALKV_SRC_CPU_TILES_H_
#define DUALKV_SRC_CPU_TILES_H_

#include <cstdint>
#include <vector>

#include "dualkv/layout.h"

namespace dualkv::detail::cpu {

// Rows of one query tile: consecutive tokens of one segment (tiles never straddle segments, so
// every row of a tile sees the same ancestors).
struct QueryTile {
  int32_t segment, begin, end;
};

// Keys [begin, end) of one segment; `masked` when some key is invisible to some query of the tile
// (the block crosses the causal diagonal of the tile's own segment). Unmasked blocks are computed
// in full.
struct KeyBlock {
  int32_t segment, begin, end;
  bool masked;
};

// One tree of the forest: a root segment and its descendants, segments [first, last), tokens
// [token_begin, token_end). Trees share no keys, so they are independent units of work.
struct Tree {
  int32_t first, last, token_begin, token_end;
};

// Query tiles of at most `rows` tokens covering every segment of the forest, in token order.
std::vector<QueryTile> query_tiles(const ForestView& f, int32_t rows);

// The trees of the forest, in token order.
std::vector<Tree> trees(const ForestView& f);

// Appends to `blocks` (cleared first) the key blocks of at most `cols` keys that `tile` sees:
// every proper ancestor of its segment in full, root first, then its own segment up to the
// tile's last row. Blocks the tile sees none of are never produced.
void key_blocks(const ForestView& f, const QueryTile& tile, int32_t cols, std::vector<KeyBlock>* blocks);

// Sets scores[i * ld + j] to -infinity where key block.begin + j is invisible from query
// tile.begin + i (only needed for a block with `masked` set).
void mask_block(const ForestView& f, const QueryTile& tile, const KeyBlock& block, float* scores, int64_t ld);

}  // namespace dualkv::detail::cpu

#endif  // DUALKV_SRC_CPU_TILES_H_
