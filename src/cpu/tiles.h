// Which (query tile, key block) pairs the blocked CPU attention computes, and which of their
// elements are masked. The tiling (stacked sibling rows, block widths) is the CPU's own; every
// visibility decision goes through the segment mask policy of include/dualkv/mask.h: the key
// ranges a tile sees (clipped to the window), the rows that see a block (bwd_query_range), the
// block's kind (block_kind) and the keys each row sees (row_keys).
#ifndef DUALKV_SRC_CPU_TILES_H_
#define DUALKV_SRC_CPU_TILES_H_

#include <cstdint>
#include <vector>

#include "dualkv/layout.h"
#include "dualkv/mask.h"

namespace dualkv::detail::cpu {

// Rows [begin, end) of one query tile, all seeing the same ancestors: consecutive tokens of one
// segment, or of consecutive siblings (the N responses of a GRPO group), so that the prompt's key
// blocks are multiplied once for every response row of the tile. `first_segment` holds the
// tile's first row.
struct QueryTile {
  int32_t begin, end, first_segment;
};

// Keys pair.keys of `segment` (its tokens, or an external segment's prefix rows: ForestView's
// keys_begin/keys_end) and the tile rows [row_begin, row_end) that see any of them (pair.q_first,
// pair.q_last); `masked` when one of those rows does not see one of the keys (the block crosses
// the causal diagonal, or the window cuts it).
struct KeyBlock {
  BlockPair pair;
  int32_t segment, row_begin, row_end;
  bool masked;
};

// One tree of the forest: a root segment and its descendants, segments [first, last), tokens
// [token_begin, token_end). Trees share no keys, so they are independent units of work.
struct Tree {
  int32_t first, last, token_begin, token_end;
};

// Query tiles of at most `rows` tokens covering every token of the forest, in token order.
// Childless roots (a plain varlen batch) share tiles only with `stack_roots`; without it a tile
// stays within one tree (the backward's unit of work).
std::vector<QueryTile> query_tiles(const ForestView& f, int32_t rows, bool stack_roots);

// The trees of the forest, in token order.
std::vector<Tree> trees(const ForestView& f);

// Appends to `blocks` (cleared first) the key blocks of at most `cols` keys that `tile` sees:
// every proper ancestor of its segments (an external one's prefix rows), nearest first, then each
// of its segments up to that segment's last row in the tile; with a window only the keys some row
// of the tile sees.
void key_blocks(const ForestView& f, PositionWindow window, const QueryTile& tile, int32_t cols,
                std::vector<KeyBlock>* blocks);

// Sets scores[i * ld + j] to -infinity where key block.pair.keys.begin + j is invisible from query
// block.row_begin + i (only needed for a block with `masked` set).
void mask_block(const ForestView& f, PositionWindow window, const QueryTile& tile, const KeyBlock& block,
                float* scores, int64_t ld);

}  // namespace dualkv::detail::cpu

#endif  // DUALKV_SRC_CPU_TILES_H_
