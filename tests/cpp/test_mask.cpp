// The mask policy (include/dualkv/mask.h) against the visibility rule, pair by pair, on random
// forests: the forward walk with its tile kinds and apply step, and the backward query ranges with
// theirs, each reproduce exactly the visible (query, key) pairs; a tile called kFull hides nothing.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "dualkv/mask.h"
#include "forest_testing.h"

using dualkv::SegmentMask;
using dualkv::TileKind;
using dualkv::testing::HostLayout;
using dualkv::testing::random_forest;

namespace {

constexpr int kBlockM = 16;  // small tiles: many tile pairs, ragged ends and diagonals per forest
constexpr int kBlockN = 8;

// Forward: for each query tile, the KvWalk's tiles and the apply step see exactly the visible keys.
void check_forward(const HostLayout& l) {
  const dualkv_layout v = l.view();
  const dualkv::ForestView f = dualkv::make_forest_view(v);
  for (int32_t s = 0; s < l.num_segments(); ++s) {
    for (int32_t q0 = f.segment_begin(s); q0 < f.segment_end(s); q0 += kBlockM) {
      const int32_t q1 = std::min(q0 + kBlockM, f.segment_end(s));
      std::vector<std::vector<char>> seen(q1 - q0, std::vector<char>(l.num_tokens(), 0));
      dualkv::KvWalk<kBlockN> walk;
      walk.init(l.offsets.data(), l.parent.data(), s, q1);
      int tiles = 0;
      do {
        const int32_t klen = walk.len();
        ASSERT_GE(klen, 1);
        const TileKind kind = SegmentMask::fwd_tile_kind(walk.pos, klen, walk.own, q0, kBlockN);
        for (int32_t q = q0; q < q1; ++q)
          for (int32_t col = 0; col < kBlockN; ++col) {
            const bool hidden = SegmentMask::fwd_hidden(walk.pos, klen, walk.own, col, q);
            if (kind == TileKind::kFull) ASSERT_FALSE(hidden) << "a full tile hides a pair";
            if (!hidden) ++seen[q - q0][walk.pos + col];
          }
        ++tiles;
      } while (walk.next(l.offsets.data(), l.parent.data()));
      // The planner's work count is the walk's length for the tile's last query.
      ASSERT_EQ(tiles > 0, true);
      for (int32_t q = q0; q < q1; ++q) {
        int visible = 0;
        for (int32_t k = 0; k < l.num_tokens(); ++k) {
          const bool expect = SegmentMask::visible(f, s, q, f.segment_of(k), k);
          ASSERT_EQ(seen[q - q0][k], expect ? 1 : 0) << "q " << q << " k " << k;
          visible += expect;
        }
        ASSERT_EQ(visible, f.num_visible_keys(s, q));
      }
    }
  }
}

// Backward: for each KV tile, the queries of bwd_query_range, in query tiles, with the tile kinds
// and apply step, see the tile's keys exactly as the rule says; no query outside the range does.
void check_backward(const HostLayout& l) {
  const dualkv_layout v = l.view();
  const dualkv::ForestView f = dualkv::make_forest_view(v);
  for (int32_t s = 0; s < l.num_segments(); ++s) {
    for (int32_t k0 = f.segment_begin(s); k0 < f.segment_end(s); k0 += kBlockN) {
      const int32_t klen = std::min(kBlockN, f.segment_end(s) - k0);
      const dualkv::TokenRange range = SegmentMask::bwd_query_range(f, s, k0);
      for (int32_t q = 0; q < l.num_tokens(); ++q) {
        const int32_t qs = f.segment_of(q);
        for (int32_t r = 0; r < klen; ++r) {
          const bool expect = SegmentMask::visible(f, qs, q, s, k0 + r);
          const bool in_range = range.begin <= q && q < range.end;
          if (!in_range) {
            ASSERT_FALSE(expect) << "visible pair outside the range: q " << q << " k " << k0 + r;
            continue;
          }
          const int32_t qt = range.begin + (q - range.begin) / kBlockM * kBlockM;  // the query tile
          const TileKind kind = SegmentMask::bwd_tile_kind(k0 + kBlockN - 1, qt, klen < kBlockN);
          const bool hidden = SegmentMask::bwd_hidden(k0 + r, q);
          if (kind == TileKind::kFull) ASSERT_FALSE(hidden) << "a full tile hides a pair";
          ASSERT_EQ(!hidden, expect) << "q " << q << " k " << k0 + r;
        }
      }
    }
  }
}

TEST(Mask, PolicyReproducesTheRuleOnRandomForests) {
  std::mt19937 rng(4242);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<int32_t> lens, parents;
    random_forest(rng, 1 + trial % 3, 1 + trial % 4, 3, 40, &lens, &parents);
    HostLayout l(lens, parents);
    SCOPED_TRACE(trial);
    check_forward(l);
    check_backward(l);
  }
}

}  // namespace
