// The mask policy (include/dualkv/mask.h) against the visibility rule, pair by pair, on random
// forests: the forward walk with its tile kinds and apply step, and the backward query ranges with
// theirs, each reproduce exactly the visible (query, key) pairs; a tile called kFull hides nothing.
// With a sliding window: the key ranges cut to the window, the block kinds and the rows' keys
// reproduce the windowed rule, written here from positions alone.
#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dualkv/mask.h"
#include "forest_testing.h"
#include "plan_format.h"
#include "plan_testing.h"

using dualkv::BlockPair;
using dualkv::PositionWindow;
using dualkv::SegmentMask;
using dualkv::TokenRange;
using dualkv::TileKind;
using dualkv::testing::HostLayout;
using dualkv::testing::PrefixedLayout;
using dualkv::testing::random_forest;

namespace {

constexpr int kBlockM = 16;  // small tiles: many tile pairs, ragged ends and diagonals per forest
constexpr int kBlockN = 8;

// The KV tiles in which query q of the tile (s, .., q1) sees a key, with the columns it sees in each.
template <int BN>
std::vector<std::pair<int32_t, std::vector<char>>> row_trace(const HostLayout& l, int32_t s, int32_t q1, int32_t q) {
  std::vector<std::pair<int32_t, std::vector<char>>> trace;
  dualkv::KvWalk<BN> walk;
  walk.init(l.offsets.data(), l.parent.data(), s, q1);
  do {
    std::vector<char> cols(BN, 0);
    bool any = false;
    for (int32_t col = 0; col < BN; ++col) {
      cols[col] = !SegmentMask::fwd_hidden(walk.pos, walk.rest(), walk.own, col, q);
      any = any || cols[col];
    }
    if (any) trace.emplace_back(walk.pos, cols);
  } while (walk.next(l.offsets.data(), l.parent.data()));
  return trace;
}

// Forward: for each query tile (s, q0, q1), the KvWalk's tiles and the apply step see exactly the
// visible keys. The tile kind is taken for the tile's rows q0 .. q1 - 1 (the sm90 kernels' test)
// and for each row alone (the sm80 warps' test over their rows). A tile past s's end is one of
// sibling leaves (the planner's packing): each row meets its keys in the same KV tiles at the same
// columns as in a tile of its segment alone (so the kernels compute it to the same bits).
template <int BN>
void check_forward_tile(const HostLayout& l, int32_t s, int32_t q0, int32_t q1) {
  const dualkv_layout v = l.view();
  const dualkv::ForestView f = dualkv::make_forest_view(v);
  const int32_t* off = l.offsets.data();
  std::vector<std::vector<char>> seen(q1 - q0, std::vector<char>(l.num_tokens(), 0));
  dualkv::KvWalk<BN> walk;
  walk.init(off, l.parent.data(), s, q1);
  int tiles = 0;
  do {
    const int32_t klen = walk.len();
    ASSERT_GE(klen, 1);
    const TileKind kind = SegmentMask::fwd_tile_kind(walk.pos, walk.rest(), walk.own, q0, q1 - 1, BN);
    for (int32_t q = q0; q < q1; ++q) {
      const TileKind row_kind = SegmentMask::fwd_tile_kind(walk.pos, walk.rest(), walk.own, q, q, BN);
      for (int32_t col = 0; col < BN; ++col) {
        const bool hidden = SegmentMask::fwd_hidden(walk.pos, walk.rest(), walk.own, col, q);
        if (kind == TileKind::kFull || row_kind == TileKind::kFull) ASSERT_FALSE(hidden) << "a full tile hides a pair";
        if (!hidden) ++seen[q - q0][walk.pos + col];
      }
    }
    ++tiles;
  } while (walk.next(off, l.parent.data()));
  ASSERT_EQ(tiles > 0, true);
  const bool siblings = SegmentMask::fwd_packs_siblings(off, s, q1);
  for (int32_t q = q0; q < q1; ++q) {
    const int32_t qs = f.segment_of(q);
    int visible = 0;
    for (int32_t k = 0; k < l.num_tokens(); ++k) {
      const bool expect = SegmentMask::visible(f, qs, q, f.segment_of(k), k);
      ASSERT_EQ(seen[q - q0][k], expect ? 1 : 0) << "q " << q << " k " << k;
      visible += expect;
    }
    ASSERT_EQ(visible, f.num_visible_keys(qs, q));
    if (siblings) ASSERT_EQ(row_trace<BN>(l, s, q1, q), row_trace<BN>(l, qs, q + 1, q)) << "row " << q;
  }
}

// Every segment in tiles of BM rows. BM x BN: the query and KV tiles (KV tiles may be wider than
// query tiles: the sm90 D-128 forward's 160-row KV tiles against its 128-row query tiles).
template <int BM = kBlockM, int BN = kBlockN>
void check_forward(const HostLayout& l) {
  for (int32_t s = 0; s < l.num_segments(); ++s)
    for (int32_t q0 = l.offsets[s]; q0 < l.offsets[s + 1]; q0 += BM)
      check_forward_tile<BN>(l, s, q0, std::min(q0 + BM, l.offsets[s + 1]));
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

// The windowed rule, from positions: forest-visible and pos(q) - pos(k) < W.
bool windowed_visible(const dualkv::ForestView& f, int32_t window, int32_t q, int32_t k) {
  const int32_t qs = f.segment_of(q), ks = f.segment_of(k);
  return f.visible(qs, q, ks, k) && (window == 0 || f.position(qs, q) - f.position(ks, k) < window);
}

// For query blocks of one segment (rows [q0, q1)) and every key range they walk (each ancestor,
// then their own segment up to q1 - 1), cut to the window of the first row and into key blocks:
// block_kind, row_keys and bwd_query_range agree pair by pair with the windowed rule; every visible
// key lies in a cut range; kFull hides nothing, kEmpty shows nothing.
void check_window(const HostLayout& l, int32_t window) {
  const dualkv_layout v = l.view();
  const dualkv::ForestView f = dualkv::make_forest_view(v);
  const PositionWindow w{window};
  for (int32_t s = 0; s < l.num_segments(); ++s) {
    for (int32_t q0 = f.segment_begin(s); q0 < f.segment_end(s); q0 += kBlockM) {
      const int32_t q1 = std::min(q0 + kBlockM, f.segment_end(s));
      std::vector<std::vector<char>> seen(q1 - q0, std::vector<char>(l.num_tokens(), 0));
      std::vector<int32_t> ranges = {s};
      for (int32_t a = f.parent[s]; a >= 0; a = f.parent[a]) ranges.push_back(a);
      for (int32_t ks : ranges) {
        const bool own = ks == s;
        const TokenRange all{f.segment_begin(ks), own ? q1 : f.segment_end(ks)};
        const TokenRange keys = SegmentMask::keys_in_window(f, w, ks, all, f.position(s, q0));
        for (int32_t k = all.begin; k < keys.begin; ++k)  // the cut keys: no row sees them
          for (int32_t q = q0; q < q1; ++q) ASSERT_FALSE(windowed_visible(f, window, q, k)) << q << " " << k;
        for (int32_t b = keys.begin; b < keys.end; b += kBlockN) {
          const int32_t e = std::min(b + kBlockN, keys.end);
          const TokenRange rows = SegmentMask::bwd_query_range(f, w, ks, b, e - 1);
          const BlockPair pair{{b, e}, f.position(ks, b), q0, q1 - 1, f.position(s, q0), f.position(s, q1 - 1), own};
          const dualkv::TileKind kind = SegmentMask::block_kind(pair, w);
          for (int32_t q = q0; q < q1; ++q) {
            const TokenRange r = SegmentMask::row_keys(pair, w, q, f.position(s, q));
            for (int32_t k = b; k < e; ++k) {
              const bool shown = r.begin <= k && k < r.end, expect = windowed_visible(f, window, q, k);
              ASSERT_EQ(shown, expect) << "q " << q << " k " << k;
              ASSERT_EQ(SegmentMask::visible(f, w, s, q, ks, k), expect);
              if (kind == dualkv::TileKind::kFull) ASSERT_TRUE(expect) << "a full block hides a pair";
              if (kind == dualkv::TileKind::kEmpty) ASSERT_FALSE(expect) << "an empty block shows a pair";
              if (expect) ASSERT_TRUE(rows.begin <= q && q < rows.end) << "bwd_query_range misses q " << q;
              seen[q - q0][k] += shown;
            }
          }
        }
      }
      for (int32_t q = q0; q < q1; ++q)
        for (int32_t k = 0; k < l.num_tokens(); ++k)
          ASSERT_EQ(seen[q - q0][k], windowed_visible(f, window, q, k) ? 1 : 0) << "q " << q << " k " << k;
    }
  }
  // bwd_query_range with the window: every query that sees a key of the block lies in it, for
  // blocks of every segment (also those no query tile above walked to).
  for (int32_t s = 0; s < l.num_segments(); ++s)
    for (int32_t k0 = f.segment_begin(s); k0 < f.segment_end(s); k0 += kBlockN) {
      const int32_t k1 = std::min(k0 + kBlockN, f.segment_end(s));
      const TokenRange rows = SegmentMask::bwd_query_range(f, w, s, k0, k1 - 1);
      for (int32_t q = 0; q < l.num_tokens(); ++q)
        for (int32_t k = k0; k < k1; ++k)
          if (windowed_visible(f, window, q, k)) ASSERT_TRUE(rows.begin <= q && q < rows.end) << q << " " << k;
    }
}

TEST(Mask, WindowPolicyReproducesTheWindowedRule) {
  std::mt19937 rng(1612);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<int32_t> lens, parents;
    random_forest(rng, 1 + trial % 3, 1 + trial % 4, 3, 30, &lens, &parents);
    HostLayout l(lens, parents);
    for (int32_t window : {1, 2, 5, 17, 64, 1000}) {
      SCOPED_TRACE(::testing::Message() << "trial " << trial << " window " << window);
      check_window(l, window);
    }
  }
}

// The score modifiers' formulas: the softcap and its derivative, and a sink folded into a row's
// softmax as one more key (its lse, the rescaling, and the sink's share of the row).
TEST(Mask, ScoreModifiers) {
  EXPECT_NEAR(dualkv::softcap_score(3.0, 2.0), 2.0 * std::tanh(1.5), 1e-15);
  const double s = 0.7, c = 1.3, h = 1e-6;
  const double numeric = (dualkv::softcap_score(s + h, c) - dualkv::softcap_score(s - h, c)) / (2 * h);
  EXPECT_NEAR(dualkv::softcap_grad(dualkv::softcap_score(s, c), c), numeric, 1e-9);
  const double scores[] = {0.5, -1.0, 2.0}, sink = 1.5;
  double m = 2.0, l = 0;
  for (double x : scores) l += std::exp(x - m);
  const double acc_before = l;  // an accumulator of ones, rescaled like the output
  const double rescale = dualkv::fold_sink(m, l, sink);
  double expect = std::exp(sink);
  for (double x : scores) expect += std::exp(x);
  EXPECT_NEAR(m + std::log(l), std::log(expect), 1e-14);
  EXPECT_NEAR(acc_before * rescale / l, (expect - std::exp(sink)) / expect, 1e-14);
  EXPECT_NEAR(dualkv::sink_probability(sink, m + std::log(l)), std::exp(sink) / expect, 1e-14);
  double m2 = 3.0, l2 = 2.0;  // a sink of -infinity changes nothing
  EXPECT_EQ(dualkv::fold_sink(m2, l2, -double(INFINITY)), 1.0);
  EXPECT_EQ(m2, 3.0);
  EXPECT_EQ(l2, 2.0);
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

namespace {

// External prefix segments: the prefixed KvWalk of every query tile visits each key the query sees
// once (an external ancestor's prefix rows, flagged `prefix`, then the other ancestors' and its own
// tokens as before), with the forward's tile kinds and apply step; a prefix tile is never diagonal.
// bwd_prefix_query_range is exactly the set of queries that see the prefix's rows.
void check_prefixed(const PrefixedLayout& l) {
  const dualkv_layout v = l.view();
  const dualkv_prefixes px = l.prefixes();
  const dualkv::ForestView f = dualkv::make_forest_view(v, px);
  const int32_t T = v.num_tokens, rows = px.num_prefix_rows;
  for (int32_t s = 0; s < v.num_segments; ++s) {
    if (f.is_external(s)) {
      const TokenRange r = SegmentMask::bwd_prefix_query_range(f, s);
      for (int32_t q = 0; q < T; ++q)
        ASSERT_EQ(r.begin <= q && q < r.end, SegmentMask::visible(f, f.segment_of(q), q, s, f.prefix_begin(s)))
            << "segment " << s << " query " << q;
      continue;
    }
    for (int32_t q0 = f.segment_begin(s); q0 < f.segment_end(s); q0 += kBlockM) {
      const int32_t q1 = std::min(q0 + kBlockM, f.segment_end(s));
      // seen[q][k]: tokens k < T, prefix rows at T + row
      std::vector<std::vector<char>> seen(q1 - q0, std::vector<char>(T + rows, 0));
      dualkv::KvWalk<kBlockN> walk;
      walk.init(l.offsets.data(), l.parent.data(), l.seg_prefix.data(), l.prefix_offsets.data(), s, q1);
      do {
        const int32_t klen = walk.len();
        ASSERT_GE(klen, 1);
        ASSERT_FALSE(walk.prefix && walk.own);
        const TileKind kind = SegmentMask::fwd_tile_kind(walk.pos, walk.rest(), walk.own, q0, q1 - 1, kBlockN);
        if (walk.prefix) ASSERT_NE(kind, TileKind::kDiagonal);
        for (int32_t q = q0; q < q1; ++q)
          for (int32_t col = 0; col < kBlockN; ++col) {
            const bool hidden = SegmentMask::fwd_hidden(walk.pos, walk.rest(), walk.own, col, q);
            if (kind == TileKind::kFull) ASSERT_FALSE(hidden) << "a full tile hides a pair";
            if (!hidden) ++seen[q - q0][(walk.prefix ? T : 0) + walk.pos + col];
          }
      } while (walk.next(l.offsets.data(), l.parent.data(), l.seg_prefix.data(), l.prefix_offsets.data()));
      for (int32_t q = q0; q < q1; ++q) {
        int visible = 0;
        for (int32_t k = 0; k < T; ++k) {
          const bool expect = SegmentMask::visible(f, s, q, f.segment_of(k), k);
          ASSERT_EQ(seen[q - q0][k], expect ? 1 : 0) << "q " << q << " k " << k;
          visible += expect;
        }
        for (int32_t x = 0; x < v.num_segments; ++x) {
          if (!f.is_external(x)) continue;
          for (int32_t k = f.prefix_begin(x); k < f.prefix_end(x); ++k) {
            const bool expect = SegmentMask::visible(f, s, q, x, k);
            ASSERT_EQ(seen[q - q0][T + k], expect ? 1 : 0) << "q " << q << " prefix row " << k;
            visible += expect;
          }
        }
        ASSERT_EQ(visible, f.num_visible_keys(s, q));  // positions count the prefix rows
      }
    }
  }
}

}  // namespace

TEST(Mask, PrefixedWalkSeesExactlyTheVisibleKeys) {
  std::mt19937 rng(1701);
  for (int trial = 0; trial < 80; ++trial) {
    std::vector<int32_t> lens, parents;
    random_forest(rng, 1 + trial % 4, 1 + trial % 4, 3, 40, &lens, &parents);
    const int32_t S = int32_t(lens.size());
    std::vector<int32_t> prefix_of(S, -1), prefix_lens{1 + int32_t(rng() % 9)};  // prefix 0 unused
    for (int32_t s = 0; s < S; ++s)
      if (parents[s] == -1 && s + 1 < S && parents[s + 1] == s && rng() % 3 != 0) {
        prefix_of[s] = int32_t(prefix_lens.size());
        prefix_lens.push_back(lens[s]);
      }
    PrefixedLayout l(lens, parents, prefix_of, prefix_lens);
    ASSERT_EQ(l.derive(), DUALKV_OK) << dualkv_last_error();
    check_prefixed(l);
  }
}

namespace {

// f(layout, tile's ints) for each forward tile of the planner (dualkv_plan_inspect; tiles of sibling
// leaves among them) at each head dim, on `trials` forests of many short segments (most leaves pack).
template <typename F>
void for_each_plan_fwd_tile(uint32_t seed, int trials, std::initializer_list<int> head_dims, F&& f) {
  std::mt19937 rng(seed);
  for (int trial = 0; trial < trials; ++trial) {
    std::vector<int32_t> lens, parents;
    random_forest(rng, 1 + trial % 3, 1 + trial % 3, 6, trial % 2 ? 40 : 150, &lens, &parents);
    HostLayout l(lens, parents);
    for (int head_dim : head_dims) {
      SCOPED_TRACE("trial " + std::to_string(trial) + " D " + std::to_string(head_dim));
      const dualkv::testing::Inspected r = dualkv::testing::inspect(l, head_dim, 132);
      ASSERT_FALSE(r.plan.empty());
      const int32_t* fwd = r.plan.data() + r.plan[dualkv::kHdrFwdOffset];
      for (int i = 0; i < r.info.num_fwd_tiles; ++i) f(l, fwd + i * dualkv::kFwdItemInts);
    }
  }
}

// The planner's forward tiles, tiles of sibling leaves among them, walked and masked as the kernels
// do, at the plan's query tiles (128 rows up to D = 256, 64 at 512) and at 8- and 160-row KV tiles.
TEST(Mask, ForwardTilesOfThePlanIncludingSiblingLeaves) {
  int sibling_tiles = 0;
  for_each_plan_fwd_tile(2300, 24, {128, 512}, [&](const HostLayout& l, const int32_t* it) {
    sibling_tiles += SegmentMask::fwd_packs_siblings(l.offsets.data(), it[0], it[2]);
    check_forward_tile<8>(l, it[0], it[1], it[2]);
    check_forward_tile<160>(l, it[0], it[1], it[2]);
  });
  EXPECT_GT(sibling_tiles, 50);  // the check saw many tiles of siblings
}

// The sm90 forward's long-walk builds at D 128 / 256 walk each warpgroup's KV ranges only up to its
// own last row (kWalkToRows: init at e = the warpgroup's last row + 1), then resume the tile's walk up
// to q1 and drain the rest without computing. For a split e inside every plan tile (sibling tiles
// included) the two parts must be the tile's walk, tile for tile, and each tile the warpgroup computes
// must hide, for each of its rows, exactly the columns the full walk's tile hides. The splits: e
// from q0 + 1 to q1 - 1 in steps of 1 to 7 (splits of every width).
template <int BN>
void check_walk_to_rows(const HostLayout& l, int32_t s, int32_t q0, int32_t q1) {
  struct Tile {
    int32_t cur, pos, end;
    bool own;
  };
  const int32_t* off = l.offsets.data();
  const int32_t* parent = l.parent.data();
  std::vector<Tile> full;
  dualkv::KvWalk<BN> walk;
  walk.init(off, parent, s, q1);
  do full.push_back({walk.cur, walk.pos, walk.end, walk.own});
  while (walk.next(off, parent));

  for (int32_t e = q0 + 1; e < q1; e += 1 + (e - q0) % 7) {
    // The walk's current tile against the full walk's next: the same range and position; its end the
    // same once resumed, at most the full walk's before (a range cut at e).
    size_t i = 0;
    auto next_of_full = [&](bool resumed) -> const Tile* {
      if (i == full.size()) return nullptr;
      const Tile& t = full[i++];
      const bool same = walk.cur == t.cur && walk.pos == t.pos && walk.own == t.own &&
                        (resumed ? walk.end == t.end : walk.end <= t.end);
      return same ? &t : nullptr;
    };
    walk.init(off, parent, s, e);
    do {
      const Tile* t = next_of_full(false);
      ASSERT_NE(t, nullptr) << "the walk to e left the tile's walk at " << walk.pos;
      ASSERT_LT(walk.pos, e) << "the warpgroup computes a tile past its rows";
      for (int32_t q = q0; q < e; ++q)
        for (int32_t col = 0; col < BN; ++col)
          ASSERT_EQ(SegmentMask::fwd_hidden(walk.pos, walk.rest(), walk.own, col, q),
                    SegmentMask::fwd_hidden(t->pos, t->end - t->pos, t->own, col, q))
              << "row " << q << " column " << col << " of the tile at " << t->pos;
    } while (walk.next(off, parent));
    if (walk.resume(off, q1)) {
      do ASSERT_NE(next_of_full(true), nullptr) << "the resumed walk left the tile's walk at " << walk.pos;
      while (walk.next(off, parent));
    }
    ASSERT_EQ(i, full.size()) << "the two parts leave tiles of the walk out";
  }
}

TEST(Mask, WalkToRowsThenResumeIsTheTilesWalk) {
  int resumed = 0;
  for_each_plan_fwd_tile(2500, 16, {128}, [&](const HostLayout& l, const int32_t* it) {
    check_walk_to_rows<8>(l, it[0], it[1], it[2]);
    check_walk_to_rows<80>(l, it[0], it[1], it[2]);
    resumed += it[2] - it[1] > 1;
  });
  EXPECT_GT(resumed, 100);  // tiles with a split (148)
}

// The sm90 D-128 forward walks 160-row KV tiles against 128-row query tiles (issue 23,
// docs/notes/2026-12-02-fwd-long-layouts.md): KV tiles 1.25 times as wide as the query tiles, so a
// query tile's diagonal may span two KV tiles. The same check at that ratio (16 x 20), and at the
// kernel's own sizes on forests whose lengths sit around the 128- and 160-row edges.
TEST(Mask, ForwardWalkWithKvTilesWiderThanQueryTiles) {
  std::mt19937 rng(1600);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<int32_t> lens, parents;
    random_forest(rng, 1 + trial % 3, 1 + trial % 4, 3, 60, &lens, &parents);
    HostLayout l(lens, parents);
    SCOPED_TRACE(trial);
    check_forward<16, 20>(l);
  }
  const std::vector<std::vector<int32_t>> kernel_lens = {{161, 159, 320, 1}, {320, 481, 128}, {129, 160, 479}};
  for (const auto& lens : kernel_lens) {
    std::vector<int32_t> parents(lens.size(), 0);
    parents[0] = -1;
    HostLayout l(lens, parents);
    check_forward<128, 160>(l);
  }
}

}  // namespace
