// The host planner through the C ABI (dualkv_plan_inspect): on random forests, the plan's items
// cover exactly the work the mask policy defines, in the documented format and order.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "dualkv/mask.h"
#include "forest_testing.h"
#include "plan_format.h"
#include "plan_testing.h"
#include "tile_size.h"

using dualkv::testing::cuda_request;
using dualkv::testing::HostLayout;
using dualkv::testing::Inspected;
using dualkv::testing::inspect;
using dualkv::testing::inspect_request;
using dualkv::testing::inspect_windowed;
using dualkv::testing::PrefixedLayout;
using dualkv::testing::random_forest;

namespace {

// Every structural property of a plan, checked against the layout it was built for (with its
// external prefixes px, or none: NULL).
void check_plan(const dualkv_layout& v, const dualkv_prefixes* px, const Inspected& r, const std::string& what) {
  SCOPED_TRACE(what);
  const dualkv_prefixes none{0, 0, nullptr, nullptr};
  const dualkv::ForestView f = dualkv::make_forest_view(v, px != nullptr ? *px : none);
  struct Shape {
    int32_t S, T;
    int32_t num_segments() const { return S; }
    int32_t num_tokens() const { return T; }
  } const l{v.num_segments, v.num_tokens};
  const dualkv_plan_info& info = r.info;
  const int32_t* p = r.plan.data();
  ASSERT_EQ(p[dualkv::kHdrMagic], dualkv::kPlanMagic);
  ASSERT_EQ(p[dualkv::kHdrS], l.num_segments());
  ASSERT_EQ(p[dualkv::kHdrT], l.num_tokens());
  ASSERT_EQ(p[dualkv::kHdrTotalLen], info.plan_len);
  ASSERT_EQ(p[dualkv::kHdrNumSlots], info.num_split_slots);
  ASSERT_EQ(static_cast<int32_t>(info.plan_key & dualkv::kPlanSlotMask), info.num_split_slots);

  // Forward tiles: one per (segment, fwd_block_m rows), or one per run of short leaf siblings (whole
  // segments with one parent, or roots, up to fwd_block_m rows together; never under a window),
  // covering every token once, sorted by work (the keys the tile walks) descending.
  std::vector<int> covered(l.num_tokens(), 0);
  const int32_t* fwd = p + p[dualkv::kHdrFwdOffset];
  int32_t prev_work = INT32_MAX;
  int64_t row_keys = 0;  // keys walked, summed over the forward's query rows (a tile's rows walk its work)
  for (int i = 0; i < info.num_fwd_tiles; ++i) {
    const int32_t s = fwd[i * dualkv::kFwdItemInts], q0 = fwd[i * dualkv::kFwdItemInts + 1],
                  q1 = fwd[i * dualkv::kFwdItemInts + 2], work = fwd[i * dualkv::kFwdItemInts + 3];
    ASSERT_TRUE(f.segment_begin(s) <= q0 && q0 < q1);
    ASSERT_LE(q1 - q0, info.fwd_block_m);
    ASSERT_EQ((q0 - f.segment_begin(s)) % info.fwd_block_m, 0);
    if (q1 > f.segment_end(s)) {  // siblings: whole short leaves of s's parent, from s on
      ASSERT_EQ(p[dualkv::kHdrWindow], 0);
      ASSERT_EQ(q0, f.segment_begin(s));
      for (int32_t x = s; x < l.num_segments() && f.segment_begin(x) < q1; ++x) {
        ASSERT_EQ(v.seg_parent[x], v.seg_parent[s]) << "tile " << i << " segment " << x;
        ASSERT_EQ(v.seg_subtree_end[x], x + 1) << "not a leaf: " << x;
        ASSERT_LE(f.segment_end(x), q1) << "segment " << x << " cut";
      }
    }
    ASSERT_EQ(work, f.num_visible_keys(s, q1 - 1));
    ASSERT_LE(work, prev_work);
    prev_work = work;
    row_keys += static_cast<int64_t>(work) * (q1 - q0);
    for (int32_t q = q0; q < q1; ++q) ++covered[q];
  }
  for (int32_t t = 0; t < l.num_tokens(); ++t) ASSERT_EQ(covered[t], 1) << "token " << t;
  // The key's long-walk bit: the forward's rows walk at least fwd_long_walk_keys(D) keys on average.
  if (std::getenv("DUALKV_CUDA_LONG_WALK_KEYS") == nullptr)
    ASSERT_EQ((info.plan_key & dualkv::kPlanLongWalksBit) != 0,
              row_keys >= dualkv::fwd_long_walk_keys(p[dualkv::kHdrHeadDim]) * static_cast<int64_t>(l.num_tokens()));
  // The key's ragged-tiles bit: fewer than kFwdRaggedFillPercent of the forward tiles' rows hold tokens.
  ASSERT_EQ((info.plan_key & dualkv::kPlanRaggedTilesBit) != 0,
            100 * static_cast<int64_t>(l.num_tokens()) <
                dualkv::kFwdRaggedFillPercent * static_cast<int64_t>(info.num_fwd_tiles) * info.fwd_block_m);

  // Backward items: per KV tile, the query ranges of its items tile the policy's range exactly;
  // a tile with one item writes dK/dV (slot -1), a split tile's items write consecutive slots that
  // its reduction sums.
  std::map<std::pair<int32_t, int32_t>, std::vector<std::array<int32_t, 4>>> by_tile;  // (s, k0) -> (k1, qa, qb, slot)
  // Order (no window): one segment's items together, longest first; segments by their longest item.
  const int32_t* bwd = p + p[dualkv::kHdrBwdOffset];
  int32_t prev_len = INT32_MAX, prev_seg = -1, prev_seg_longest = INT32_MAX;
  std::vector<char> seg_done(l.num_segments(), 0);
  for (int i = 0; i < info.num_bwd_items; ++i) {
    const int32_t* it = bwd + i * dualkv::kBwdItemInts;
    if (p[dualkv::kHdrWindow] == 0) {
      if (it[0] != prev_seg) {
        ASSERT_FALSE(seg_done[it[0]]) << "segment " << it[0] << "'s items not together";
        if (prev_seg >= 0) seg_done[prev_seg] = 1;
        ASSERT_LE(it[4] - it[3], prev_seg_longest) << "segments not by their longest item";
        prev_seg = it[0];
        prev_seg_longest = it[4] - it[3];
      } else {
        ASSERT_LE(it[4] - it[3], prev_len) << "not longest-first within segment " << it[0];
      }
    }
    prev_len = it[4] - it[3];
    ASSERT_LE(it[4] - it[3], std::max(info.bwd_split_rows, 1));
    by_tile[{it[0], it[1]}].push_back({it[2], it[3], it[4], it[5]});
  }
  // KV tiles: every segment's keys (an external segment's prefix rows, when a token sees them) in
  // bwd_block_n tiles from its first key.
  auto query_range = [&](int32_t s, int32_t k0) {
    return f.is_external(s) ? dualkv::SegmentMask::bwd_prefix_query_range(f, s)
                            : dualkv::SegmentMask::bwd_query_range(f, s, k0);
  };
  int32_t n_tiles = 0;
  for (int32_t s = 0; s < l.num_segments(); ++s) {
    if (f.is_external(s) && query_range(s, 0).end <= query_range(s, 0).begin) continue;
    for (int32_t k0 = f.keys_begin(s); k0 < f.keys_end(s); k0 += info.bwd_block_n) ++n_tiles;
  }
  ASSERT_EQ(static_cast<int32_t>(by_tile.size()), n_tiles);
  std::map<std::pair<int32_t, int32_t>, std::array<int32_t, 3>> reductions;  // (s, k0) -> (k1, slot0, n)
  const int32_t* red = p + p[dualkv::kHdrRedOffset];
  for (int i = 0; i < info.num_reductions; ++i) {
    const int32_t* it = red + i * dualkv::kRedItemInts;
    reductions[{it[0], it[1]}] = {it[2], it[3], it[4]};
  }
  std::vector<int> slot_used(info.num_split_slots, 0);
  for (auto& [key, items] : by_tile) {
    const auto [s, k0] = key;
    ASSERT_TRUE(f.keys_begin(s) <= k0 && k0 < f.keys_end(s)) << "KV tile " << k0 << " of segment " << s;
    ASSERT_EQ((k0 - f.keys_begin(s)) % info.bwd_block_n, 0);
    const dualkv::TokenRange range = query_range(s, k0);
    std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a[1] < b[1]; });
    int32_t next = range.begin;
    for (const auto& it : items) {
      ASSERT_EQ(it[0], std::min(k0 + info.bwd_block_n, f.keys_end(s)));
      ASSERT_EQ(it[1], next) << "gap or overlap in the query range of KV tile " << k0;
      next = it[2];
    }
    ASSERT_EQ(next, range.end);
    const bool split = items.size() > 1;
    ASSERT_EQ(reductions.count(key), split ? 1u : 0u);
    for (size_t i = 0; i < items.size(); ++i) {
      if (!split) {
        ASSERT_EQ(items[i][3], -1);
      } else {
        const auto& r = reductions[key];
        ASSERT_EQ(r[2], static_cast<int32_t>(items.size()));
        ASSERT_EQ(items[i][3], r[1] + static_cast<int32_t>(i));  // slots in query order
        ++slot_used[items[i][3]];
      }
    }
  }
  for (int32_t k = 0; k < info.num_split_slots; ++k) ASSERT_EQ(slot_used[k], 1) << "slot " << k;
}
void check_plan(const HostLayout& l, const Inspected& r, const std::string& what) {
  check_plan(l.view(), nullptr, r, what);
}

TEST(Plan, RandomForestsEveryTiling) {
  std::mt19937 rng(77);
  for (int trial = 0; trial < 60; ++trial) {
    std::vector<int32_t> lens, parents;
    random_forest(rng, 1 + trial % 3, 1 + trial % 4, 4, 300, &lens, &parents);
    HostLayout l(lens, parents);
    for (int D : {64, 256, 512})
      for (int sms : {1, 7, 132}) check_plan(l, inspect(l, D, sms), "trial " + std::to_string(trial));
    // The Hopper family's 192-row forward tiles at D = 64 (tile_size.h fwd_block_m).
    const Inspected h = inspect_request(l.view(), cuda_request(64, 0, nullptr, DUALKV_PLAN_TILES_SM90), 132);
    check_plan(l, h, "trial " + std::to_string(trial) + " sm90 tiles");
    EXPECT_EQ(h.info.fwd_block_m, 192);
  }
}

// The two kernel families' plans (dualkv_plan_request.tiles) differ in the forward query tiles at
// D = 64 without a window only, and the key says which a plan has (the dispatcher learns it from the key); the
// backward items are the same. DEVICE is PORTABLE without a device, and a request of the size
// before `tiles` was appended is a DEVICE request.
TEST(Plan, KernelFamiliesDifferInForwardTilesAtHeadDim64Only) {
  std::vector<int32_t> lens{1000}, parents{-1};
  for (int i = 0; i < 6; ++i) {
    lens.push_back(150 + 70 * i);
    parents.push_back(0);
  }
  HostLayout l(lens, parents);
  const dualkv_layout v = l.view();
  auto plan_of = [&](int D, int32_t tiles) { return inspect_request(v, cuda_request(D, 0, nullptr, tiles), 132); };
  auto bwd_part = [](const Inspected& r) {
    return std::vector<int32_t>(r.plan.begin() + r.plan[dualkv::kHdrBwdOffset], r.plan.end());
  };
  const Inspected p64 = plan_of(64, DUALKV_PLAN_TILES_PORTABLE), h64 = plan_of(64, DUALKV_PLAN_TILES_SM90);
  check_plan(l, h64, "sm90 tiles");
  EXPECT_EQ(p64.info.fwd_block_m, 128);
  EXPECT_EQ(h64.info.fwd_block_m, 192);
  EXPECT_EQ(h64.info.num_fwd_tiles, (1000 + 191) / 192 + 1 + 2 + 2 + 2 + 3 + 3);  // 150, 220, .. 500 rows
  EXPECT_NE(p64.info.plan_key >> dualkv::kPlanKeyLowBits, h64.info.plan_key >> dualkv::kPlanKeyLowBits);
  EXPECT_EQ(p64.info.num_bwd_items, h64.info.num_bwd_items);
  EXPECT_EQ(bwd_part(p64), bwd_part(h64));
  EXPECT_EQ(plan_of(64, DUALKV_PLAN_TILES_DEVICE).plan, p64.plan);
  for (int D : {128, 256, 512}) {
    SCOPED_TRACE(D);
    const Inspected p = plan_of(D, DUALKV_PLAN_TILES_PORTABLE), h = plan_of(D, DUALKV_PLAN_TILES_SM90);
    EXPECT_EQ(p.plan, h.plan);
    EXPECT_EQ(p.info.plan_key, h.info.plan_key);
  }
  // Cut to a window, both families' plans have 128-row tiles at D = 64 (tile_size.h fwd_block_m).
  const Inspected pw = inspect_request(v, cuda_request(64, 128, nullptr, DUALKV_PLAN_TILES_PORTABLE), 132),
                  hw = inspect_request(v, cuda_request(64, 128, nullptr, DUALKV_PLAN_TILES_SM90), 132);
  EXPECT_EQ(hw.info.fwd_block_m, 128);
  EXPECT_EQ(pw.plan, hw.plan);
  EXPECT_EQ(pw.info.plan_key, hw.info.plan_key);
  // The request without `tiles` (its struct_size then) is DEVICE's; an unknown family is refused.
  dualkv_plan_request req = cuda_request(64, 0, nullptr, DUALKV_PLAN_TILES_SM90);
  req.struct_size = offsetof(dualkv_plan_request, tiles);
  EXPECT_EQ(inspect_request(v, req, 132).plan, p64.plan);
  req = cuda_request(64, 0, nullptr, 3);
  dualkv_plan_info info{};
  info.struct_size = sizeof(info);
  EXPECT_EQ(dualkv_plan_inspect_ex(&v, &req, 132, &info, nullptr, 0), DUALKV_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dualkv_last_error()).find("tiles"), std::string::npos);
}

TEST(Plan, GrpoGroupTilesAndSplits) {
  // One prompt of 20000 tokens and 8 responses of 3000: the prompt's KV tiles are seen by the
  // whole group (44000 queries), longer than the split length, so they are split.
  std::vector<int32_t> lens{20000}, parents{-1};
  for (int i = 0; i < 8; ++i) {
    lens.push_back(3000);
    parents.push_back(0);
  }
  HostLayout l(lens, parents);
  const Inspected r = inspect(l, 128, 132);
  check_plan(l, r, "grpo");
  EXPECT_EQ(r.info.fwd_block_m, 128);
  EXPECT_EQ(r.info.bwd_block_n, 128);
  EXPECT_EQ(r.info.bwd_block_m, 64);
  EXPECT_EQ(r.info.num_fwd_tiles, (20000 + 127) / 128 + 8 * ((3000 + 127) / 128));
  EXPECT_GT(r.info.num_reductions, 0);
  EXPECT_GE(r.info.bwd_split_rows, 8192);
  EXPECT_EQ(r.info.bwd_split_rows % 64, 0);
  // Fewer SMs: a longer split length, never shorter than 8192 rows.
  const Inspected one = inspect(l, 128, 1);
  EXPECT_GE(one.info.bwd_split_rows, r.info.bwd_split_rows);
  EXPECT_EQ(one.info.num_reductions, 0);
  // Head dim 256: 64-row KV tiles.
  EXPECT_EQ(inspect(l, 256, 132).info.bwd_block_n, 64);
  // Head dim 512 (tile_size.h): 64-row query tiles, 32-row KV tiles, 64-row backward steps, so
  // twice the forward tiles and four times the KV tiles; split lengths still multiples of 64. Four
  // times the KV tiles make four times the work per SM, whose split length (total / 132 rows)
  // then exceeds the group's 44000 queries: nothing is split on 132 SMs.
  const Inspected d512 = inspect(l, 512, 132);
  check_plan(l, d512, "grpo d512");
  EXPECT_EQ(d512.info.fwd_block_m, 64);
  EXPECT_EQ(d512.info.bwd_block_n, 32);
  EXPECT_EQ(d512.info.bwd_block_m, 64);
  EXPECT_EQ(d512.info.num_fwd_tiles, (20000 + 63) / 64 + 8 * ((3000 + 63) / 64));
  EXPECT_EQ(d512.info.num_bwd_items, (20000 + 31) / 32 + 8 * ((3000 + 31) / 32));
  EXPECT_EQ(d512.info.bwd_split_rows % 64, 0);
  EXPECT_GT(d512.info.bwd_split_rows, 44000);
  EXPECT_EQ(d512.info.num_reductions, 0);
}

TEST(Plan, ShortLeafSiblingsShareForwardTiles) {
  // A prompt of 300 and responses 10, 20 | 100, 5 | 200 | 30, 30, 30 | 127, 1 (| = a new tile at
  // 128 rows): runs of whole short leaves, greedily up to fwd_block_m rows; a response of 200 is
  // tiled alone; the prompt (with children) in its own tiles. Then two short roots (a varlen
  // pair), one tile. Under a window no tile packs.
  HostLayout l({300, 10, 20, 100, 5, 200, 30, 30, 30, 127, 1, 40, 50},
               {-1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1});
  const Inspected r = inspect(l, 128, 132);
  check_plan(l, r, "siblings");
  EXPECT_EQ(r.info.num_fwd_tiles, 3 + 1 + 1 + 2 + 1 + 1 + 1);
  std::set<std::array<int32_t, 3>> tiles;
  const int32_t* fwd = r.plan.data() + r.plan[dualkv::kHdrFwdOffset];
  for (int i = 0; i < r.info.num_fwd_tiles; ++i)
    tiles.insert({fwd[i * dualkv::kFwdItemInts], fwd[i * dualkv::kFwdItemInts + 1], fwd[i * dualkv::kFwdItemInts + 2]});
  const std::vector<int32_t>& off = l.offsets;
  for (const auto& [s, t] : std::vector<std::pair<int32_t, int32_t>>{{1, 3}, {3, 5}, {6, 9}, {9, 11}, {11, 13}})
    EXPECT_EQ(tiles.count({s, off[s], off[t]}), 1u) << "segments " << s << ".." << t - 1;
  // Head dim 512: 64-row query tiles, so 100 + 5 no longer fit one; 30 + 30 do, 127 is long.
  const Inspected d512 = inspect(l, 512, 132);
  check_plan(l, d512, "siblings d512");
  // Under a window every tile is one segment's (windowed plans: no sibling tiles).
  const Inspected windowed = inspect_windowed(l, 128, 64, 132);
  const int32_t* wf = windowed.plan.data() + windowed.plan[dualkv::kHdrFwdOffset];
  for (int i = 0; i < windowed.info.num_fwd_tiles; ++i)
    EXPECT_LE(wf[i * dualkv::kFwdItemInts + 2], off[wf[i * dualkv::kFwdItemInts] + 1]) << "windowed tile " << i;
}

TEST(Plan, HeadDim512ForcedSplitsAndOneTokenSegments) {
  // Segments of 1, 31, 32, 33, 63, 64, 65 tokens around the 512 tiles (32 KV rows, 64 query rows),
  // under forced 64-row splits: the items still cover exactly the visible pairs.
  HostLayout l({65, 1, 31, 32, 33, 63, 64, 1}, {-1, 0, 0, 2, 3, 0, -1, 6});
  for (const char* split : {"", "64", "128"}) {
    if (*split) setenv("DUALKV_CUDA_SPLIT_ROWS", split, 1);
    const Inspected r = inspect(l, 512, 132);
    unsetenv("DUALKV_CUDA_SPLIT_ROWS");
    check_plan(l, r, std::string("d512 split ") + split);
    if (*split) {
      EXPECT_GT(r.info.num_split_slots, 0) << split;
    }
  }
}

TEST(Plan, SplitRowsFromTheEnvironment) {
  HostLayout l({300, 200, 1}, {-1, 0, 0});
  setenv("DUALKV_CUDA_SPLIT_ROWS", "64", 1);
  const Inspected r = inspect(l, 128, 132);
  unsetenv("DUALKV_CUDA_SPLIT_ROWS");
  check_plan(l, r, "forced splits");
  EXPECT_EQ(r.info.bwd_split_rows, 64);
  EXPECT_GT(r.info.num_split_slots, 0);
}

// The key's long-walk bit (tile_size.h fwd_long_kv_walks): set for a group whose responses read a
// 16K prompt (rows walk ~12.9K keys on average), clear for short groups (~0.8K); the threshold
// moves with DUALKV_CUDA_LONG_WALK_KEYS; the bit is outside the hash and the slot count.
TEST(Plan, LongForwardWalksSetTheKeysLongWalkBit) {
  std::vector<int32_t> long_lens{16384}, short_lens{512}, long_parents{-1}, short_parents{-1};
  for (int i = 0; i < 8; ++i) long_lens.push_back(2048), long_parents.push_back(0);
  for (int i = 0; i < 64; ++i) short_lens.push_back(256), short_parents.push_back(0);
  HostLayout longer(long_lens, long_parents), shorter(short_lens, short_parents);
  for (int d : {64, 128, 256}) {
    SCOPED_TRACE(d);
    const Inspected a = inspect(longer, d, 132), b = inspect(shorter, d, 132);
    check_plan(longer, a, "long walks");
    check_plan(shorter, b, "short walks");
    EXPECT_NE(a.info.plan_key & dualkv::kPlanLongWalksBit, 0u);
    EXPECT_EQ(b.info.plan_key & dualkv::kPlanLongWalksBit, 0u);
  }
  for (const char* ignored : {"-5", "lots", "", "12x"}) {  // not a count >= 0: the default threshold
    setenv("DUALKV_CUDA_LONG_WALK_KEYS", ignored, 1);
    EXPECT_EQ(inspect(shorter, 128, 132).info.plan_key & dualkv::kPlanLongWalksBit, 0u) << ignored;
    EXPECT_NE(inspect(longer, 128, 132).info.plan_key & dualkv::kPlanLongWalksBit, 0u) << ignored;
  }
  setenv("DUALKV_CUDA_LONG_WALK_KEYS", "0", 1);
  const Inspected every = inspect(shorter, 128, 132);
  setenv("DUALKV_CUDA_LONG_WALK_KEYS", "9223372036854775807", 1);  // no overflow in the rule
  const Inspected none = inspect(longer, 128, 132);
  unsetenv("DUALKV_CUDA_LONG_WALK_KEYS");
  EXPECT_NE(every.info.plan_key & dualkv::kPlanLongWalksBit, 0u);
  EXPECT_EQ(none.info.plan_key & dualkv::kPlanLongWalksBit, 0u);
  const Inspected a = inspect(longer, 128, 132), b = inspect(shorter, 128, 132);
  EXPECT_EQ(every.info.plan_key & ~dualkv::kPlanLongWalksBit, b.info.plan_key);
  EXPECT_EQ(none.info.plan_key, a.info.plan_key & ~dualkv::kPlanLongWalksBit);
  EXPECT_EQ(static_cast<int32_t>(none.info.plan_key & dualkv::kPlanSlotMask), a.info.num_split_slots);
}

TEST(Plan, KeyNamesLayoutAndTiling) {
  HostLayout a({100, 50}, {-1, 0}), b({100, 51}, {-1, 0});
  const uint64_t ka = inspect(a, 128, 132).info.plan_key >> dualkv::kPlanKeyLowBits;
  EXPECT_EQ(ka, inspect(a, 128, 132).info.plan_key >> dualkv::kPlanKeyLowBits);
  EXPECT_NE(ka, inspect(b, 128, 132).info.plan_key >> dualkv::kPlanKeyLowBits);  // T differs
  EXPECT_NE(ka, inspect(a, 256, 132).info.plan_key >> dualkv::kPlanKeyLowBits);  // head dim and tiling
  EXPECT_NE(inspect(a, 256, 132).info.plan_key >> dualkv::kPlanKeyLowBits,
            inspect(a, 512, 132).info.plan_key >> dualkv::kPlanKeyLowBits);  // head dim and tiling
  EXPECT_NE(ka, inspect(a, 64, 132).info.plan_key >> dualkv::kPlanKeyLowBits);   // head dim
}

// External prefix segments (plan version 3): every prefix row is in exactly one KV tile per
// segment that references it (one, by the layout's rule), the tile's items' query ranges tile that
// segment's subtree exactly (whole or split), an unused prefix's rows are in none; the key names the
// prefix table.
TEST(Plan, PrefixItemsCoverEveryPrefixRowOfEachReferencingSegment) {
  std::mt19937 rng(1717);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<int32_t> lens, parents;
    random_forest(rng, 1 + trial % 4, 1 + trial % 3, 4, 300, &lens, &parents);
    const int32_t S = int32_t(lens.size());
    // Roots with children become external, taking prefixes 1..E in a shuffled order (long enough
    // for several KV tiles); prefix 0 is unused.
    std::vector<int32_t> prefix_of(S, -1), external;
    for (int32_t s = 0; s < S; ++s)
      if (parents[s] == -1 && s + 1 < S && parents[s + 1] == s && rng() % 4 != 0) external.push_back(s);
    std::vector<int32_t> order(external.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = int32_t(i) + 1;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int32_t> prefix_lens(external.size() + 1);
    prefix_lens[0] = 1 + int32_t(rng() % 200);
    for (size_t i = 0; i < external.size(); ++i) {
      prefix_of[external[i]] = order[i];
      prefix_lens[order[i]] = 1 + int32_t(rng() % 400);
    }
    PrefixedLayout l(lens, parents, prefix_of, prefix_lens);
    ASSERT_EQ(l.derive(), DUALKV_OK) << dualkv_last_error();
    const dualkv_layout v = l.view();
    const dualkv_prefixes px = l.prefixes();
    const dualkv::ForestView f = dualkv::make_forest_view(v, px);
    for (int D : {64, 256, 512})
      for (const char* split : {"", "64"}) {
        if (*split) setenv("DUALKV_CUDA_SPLIT_ROWS", split, 1);
        const Inspected r = inspect(v, &px, D, 132);
        unsetenv("DUALKV_CUDA_SPLIT_ROWS");
        const std::string what = "trial " + std::to_string(trial) + " D " + std::to_string(D) + " split " + split;
        check_plan(v, &px, r, what);
        // Prefix rows: covered once by the items of the one segment that holds them (rows of
        // unused prefix 0: never), each item's queries that segment's subtree.
        std::vector<int> row_tiles(size_t(px.num_prefix_rows), 0);
        const int32_t* bwd = r.plan.data() + r.plan[dualkv::kHdrBwdOffset];
        for (int i = 0; i < r.info.num_bwd_items; ++i) {
          const int32_t* it = bwd + i * dualkv::kBwdItemInts;
          if (!f.is_external(it[0])) continue;
          ASSERT_GE(it[3], f.segment_begin(it[0])) << what;
          ASSERT_LE(it[4], f.subtree_token_end(it[0])) << what;
          if (it[3] != f.segment_begin(it[0])) continue;  // count each tile once: its first split
          for (int32_t k = it[1]; k < it[2]; ++k) ++row_tiles[size_t(k)];
        }
        for (int32_t k = 0; k < px.num_prefix_rows; ++k)
          ASSERT_EQ(row_tiles[size_t(k)], k < prefix_lens[0] ? 0 : 1) << what << ": prefix row " << k;
        // Forced 64-row splits cut a prefix tile whose subtree has more tokens.
        bool long_subtree = false, split_prefix_item = false;
        for (int32_t x : external) long_subtree |= f.subtree_token_end(x) - f.segment_begin(x) > 64;
        for (int i = 0; i < r.info.num_bwd_items; ++i) {
          const int32_t* it = bwd + i * dualkv::kBwdItemInts;
          split_prefix_item |= f.is_external(it[0]) && it[5] >= 0;
        }
        if (*split) EXPECT_EQ(split_prefix_item, long_subtree) << what;
      }
    // The key names the prefix table: the same forest with another table (one more row in the
    // unused prefix) has another key.
    if (!external.empty()) {
      std::vector<int32_t> more = prefix_lens;
      ++more[0];
      PrefixedLayout m(lens, parents, prefix_of, more);
      ASSERT_EQ(m.derive(), DUALKV_OK) << dualkv_last_error();
      const dualkv_layout mv = m.view();
      const dualkv_prefixes mp = m.prefixes();
      EXPECT_NE(inspect(v, &px, 128, 132).info.plan_key >> dualkv::kPlanKeyLowBits,
                inspect(mv, &mp, 128, 132).info.plan_key >> dualkv::kPlanKeyLowBits);
      // Without the table the forest is refused (its external segments hold no tokens).
      dualkv_plan_info info{};
      info.struct_size = sizeof(info);
      EXPECT_NE(dualkv_plan_inspect(&v, 128, 132, &info, nullptr, 0), DUALKV_OK);
      // A window together with the table is refused by type, naming both (the kernels run either
      // alone).
      const dualkv_plan_request windowed{sizeof(dualkv_plan_request), DUALKV_DEVICE_CUDA, 0, DUALKV_DTYPE_BFLOAT16,
                                         128, 64, &px};
      EXPECT_EQ(dualkv_plan_inspect_ex(&v, &windowed, 132, &info, nullptr, 0), DUALKV_ERROR_UNSUPPORTED);
      EXPECT_NE(std::string(dualkv_last_error()).find("sliding window"), std::string::npos) << dualkv_last_error();
      EXPECT_NE(std::string(dualkv_last_error()).find("external prefix"), std::string::npos) << dualkv_last_error();
    }
  }
}

// ---- plans cut to a sliding window (mask modifiers, issue 16; plan_format.h) ----

// A windowed plan against brute force over the pairs: forward work = the keys the walk visits
// (the forest-visible keys of the tile's last query within W of its first query: a superset of
// every pair the tile needs); per KV tile, the items' query ranges are disjoint and their union is
// exactly the queries that see some key of the tile through the window; each item's distance
// bias gives every pair's distance (or, for an un-windowed range, no pair of it is hidden); split
// slots and reductions as without a window.
void check_windowed_plan(const HostLayout& l, const Inspected& r, int32_t window, const std::string& what) {
  SCOPED_TRACE(what + " window " + std::to_string(window));
  const dualkv_layout v = l.view();
  const dualkv::ForestView f = dualkv::make_forest_view(v);
  const dualkv::PositionWindow w{window};
  const dualkv_plan_info& info = r.info;
  const int32_t* p = r.plan.data();
  const int32_t T = l.num_tokens();
  ASSERT_EQ(p[dualkv::kHdrWindow], window);
  ASSERT_GT(p[dualkv::kHdrBwdBiasOffset], 0);
  ASSERT_EQ(p[dualkv::kHdrBwdBiasOffset] + info.num_bwd_items, info.plan_len);
  std::vector<int32_t> seg(T);
  for (int32_t t = 0; t < T; ++t) seg[t] = f.segment_of(t);

  const int32_t* fwd = p + p[dualkv::kHdrFwdOffset];
  std::vector<int> covered(T, 0);
  for (int i = 0; i < info.num_fwd_tiles; ++i) {
    const int32_t* it = fwd + i * dualkv::kFwdItemInts;
    const int32_t s = it[0], q0 = it[1], q1 = it[2];
    int32_t expect = 0;
    for (int32_t k = 0; k < T; ++k)
      if (f.visible(s, q1 - 1, seg[k], k) && !w.hides(int64_t(f.position(s, q0)) - f.position(seg[k], k))) ++expect;
    ASSERT_EQ(it[3], expect) << "forward tile " << q0;
    for (int32_t q = q0; q < q1; ++q) ++covered[q];
  }
  for (int32_t t = 0; t < T; ++t) ASSERT_EQ(covered[t], 1) << "token " << t;

  struct Item { int32_t k1, qa, qb, slot, bias; };
  std::map<std::pair<int32_t, int32_t>, std::vector<Item>> by_tile;
  const int32_t* bwd = p + p[dualkv::kHdrBwdOffset];
  const int32_t* bias = p + p[dualkv::kHdrBwdBiasOffset];
  for (int i = 0; i < info.num_bwd_items; ++i) {
    const int32_t* it = bwd + i * dualkv::kBwdItemInts;
    ASSERT_LT(it[3], it[4]);
    ASSERT_LE(it[4] - it[3], std::max(info.bwd_split_rows, 1));
    by_tile[{it[0], it[1]}].push_back({it[2], it[3], it[4], it[5], bias[i]});
  }
  std::map<std::pair<int32_t, int32_t>, std::array<int32_t, 3>> reductions;
  const int32_t* red = p + p[dualkv::kHdrRedOffset];
  for (int i = 0; i < info.num_reductions; ++i) {
    const int32_t* it = red + i * dualkv::kRedItemInts;
    reductions[{it[0], it[1]}] = {it[2], it[3], it[4]};
  }
  std::vector<int> slot_used(info.num_split_slots, 0);
  int32_t n_tiles = 0;
  for (int32_t s = 0; s < l.num_segments(); ++s)
    for (int32_t k0 = f.segment_begin(s); k0 < f.segment_end(s); k0 += info.bwd_block_n, ++n_tiles) {
      const int32_t k1 = std::min(k0 + info.bwd_block_n, f.segment_end(s));
      auto found = by_tile.find({s, k0});
      ASSERT_NE(found, by_tile.end()) << "KV tile " << k0 << " has no item";
      std::vector<Item>& items = found->second;
      std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.qa < b.qa; });
      std::vector<int> in_item(T, 0);
      for (const Item& it : items) {
        ASSERT_EQ(it.k1, k1);
        for (int32_t q = it.qa; q < it.qb; ++q) {
          ++in_item[q];
          for (int32_t k = k0; k < k1; ++k) {
            if (!f.visible(seg[q], q, s, k)) continue;
            const int64_t dist = int64_t(f.position(seg[q], q)) - f.position(s, k);
            if (it.bias == -T)
              ASSERT_FALSE(w.hides(dist)) << "un-windowed item hides pair " << q << ", " << k;
            else
              ASSERT_EQ(dist, int64_t(q - k) + it.bias) << "bias of the item at " << it.qa;
          }
        }
      }
      for (int32_t q = 0; q < T; ++q) {
        bool sees = false;
        for (int32_t k = k0; k < k1 && !sees; ++k) sees = dualkv::SegmentMask::visible(f, w, seg[q], q, s, k);
        ASSERT_EQ(in_item[q], sees ? 1 : 0) << "query " << q << " of KV tile " << k0;
      }
      const bool split = items.size() > 1;
      ASSERT_EQ(reductions.count({s, k0}), split ? 1u : 0u);
      for (size_t i = 0; i < items.size(); ++i) {
        if (!split) {
          ASSERT_EQ(items[i].slot, -1);
        } else {
          const auto& rd = reductions[{s, k0}];
          ASSERT_EQ(rd[2], static_cast<int32_t>(items.size()));
          ASSERT_EQ(items[i].slot, rd[1] + static_cast<int32_t>(i));
          ++slot_used[items[i].slot];
        }
      }
    }
  ASSERT_EQ(static_cast<int32_t>(by_tile.size()), n_tiles);
  for (int32_t k = 0; k < info.num_split_slots; ++k) ASSERT_EQ(slot_used[k], 1) << "slot " << k;
}

TEST(Plan, WindowedPlansCoverExactlyTheWindowedPairs) {
  std::mt19937 rng(1616);
  for (int trial = 0; trial < 24; ++trial) {
    std::vector<int32_t> lens, parents;
    random_forest(rng, 1 + trial % 3, 1 + trial % 4, 4, 200, &lens, &parents);
    HostLayout l(lens, parents);
    for (int32_t window : {1, 7, 64, 128, 1000})
      for (int D : {64, 256, 512}) {
        const std::string what = "trial " + std::to_string(trial) + " D " + std::to_string(D);
        check_windowed_plan(l, inspect_windowed(l, D, window, 132), window, what);
      }
    setenv("DUALKV_CUDA_SPLIT_ROWS", "64", 1);
    check_windowed_plan(l, inspect_windowed(l, 128, 100, 132), 100, "trial " + std::to_string(trial) + " split 64");
    unsetenv("DUALKV_CUDA_SPLIT_ROWS");
  }
}

// The kernels' windowed walk (mask.h KvWalk::init_windowed / next_windowed) visits, per forward tile
// of a windowed plan, exactly the keys the plan's work counts (forest-visible from the tile's last
// query, within W of its first), each once, in whole tiles of BN but at a range's end.
TEST(Plan, WindowedKvWalkVisitsThePlannedKeys) {
  constexpr int BN = 64;
  std::mt19937 rng(2024);
  for (int trial = 0; trial < 24; ++trial) {
    std::vector<int32_t> lens, parents;
    random_forest(rng, 1 + trial % 3, 1 + trial % 4, 4, 200, &lens, &parents);
    HostLayout l(lens, parents);
    const dualkv_layout v = l.view();
    const dualkv::ForestView f = dualkv::make_forest_view(v);
    std::vector<int32_t> seg(l.num_tokens());
    for (int32_t t = 0; t < l.num_tokens(); ++t) seg[t] = f.segment_of(t);
    for (int32_t window : {1, 7, 64, 128, 1000}) {
      SCOPED_TRACE("trial " + std::to_string(trial) + " window " + std::to_string(window));
      const Inspected r = inspect_windowed(l, 128, window, 132);
      const int32_t* fwd = r.plan.data() + r.plan[dualkv::kHdrFwdOffset];
      for (int i = 0; i < r.info.num_fwd_tiles; ++i) {
        const int32_t* it = fwd + i * dualkv::kFwdItemInts;
        const int32_t s = it[0], q0 = it[1], q1 = it[2];
        const int32_t first_pos = static_cast<int32_t>(dualkv::PositionWindow{window}.first_position(f.position(s, q0)));
        dualkv::KvWalk<BN> w;
        w.init_windowed(v.seg_offsets, v.seg_parent, v.seg_position_offset, s, q1, first_pos);
        std::vector<int> seen(l.num_tokens(), 0);
        int32_t visited = 0;
        do {
          ASSERT_GT(w.len(), 0);
          ASSERT_TRUE(w.len() == BN || w.pos + w.len() == w.end);
          for (int32_t k = w.pos; k < w.pos + w.len(); ++k) {
            ASSERT_TRUE(f.visible(s, q1 - 1, seg[k], k)) << "key " << k;
            ASSERT_LT(int64_t(f.position(s, q0)) - f.position(seg[k], k), window) << "key " << k;
            ASSERT_EQ(seen[k]++, 0) << "key " << k << " twice";
            ASSERT_EQ(w.own, seg[k] == s);
          }
          visited += w.len();
        } while (w.next_windowed(v.seg_offsets, v.seg_parent, v.seg_position_offset, first_pos));
        ASSERT_EQ(visited, it[3]) << "forward tile " << q0;
      }
    }
  }
}

TEST(Plan, WindowZeroIsThePlainPlanAndTheKeyNamesTheWindow) {
  HostLayout l({300, 200, 1, 90}, {-1, 0, 0, 2});
  const Inspected plain = inspect(l, 128, 132), zero = inspect_windowed(l, 128, 0, 132);
  EXPECT_EQ(plain.plan, zero.plan);
  EXPECT_EQ(plain.info.plan_key, zero.info.plan_key);
  const uint64_t k0 = plain.info.plan_key >> dualkv::kPlanKeyLowBits;
  const uint64_t k64 = inspect_windowed(l, 128, 64, 132).info.plan_key >> dualkv::kPlanKeyLowBits;
  const uint64_t k65 = inspect_windowed(l, 128, 65, 132).info.plan_key >> dualkv::kPlanKeyLowBits;
  EXPECT_NE(k0, k64);
  EXPECT_NE(k64, k65);
}

TEST(Plan, WindowedWorkScalesWithTheWindow) {
  // A GRPO group, prompt 4096 and 4 responses of 1024: with W = 128 the forward walks and the
  // backward ranges shrink to about W + a tile per query tile / KV tile.
  HostLayout l({4096, 1024, 1024, 1024, 1024}, {-1, 0, 0, 0, 0});
  auto totals = [&](int32_t window) {
    const Inspected r = window > 0 ? inspect_windowed(l, 128, window, 132) : inspect(l, 128, 132);
    int64_t fwd = 0, bwd = 0;
    const int32_t* p = r.plan.data();
    for (int i = 0; i < r.info.num_fwd_tiles; ++i) fwd += p[p[dualkv::kHdrFwdOffset] + i * dualkv::kFwdItemInts + 3];
    for (int i = 0; i < r.info.num_bwd_items; ++i) {
      const int32_t* it = p + p[dualkv::kHdrBwdOffset] + i * dualkv::kBwdItemInts;
      bwd += it[4] - it[3];
    }
    return std::make_pair(fwd, bwd);
  };
  const auto [fwd_full, bwd_full] = totals(0);
  const auto [fwd_w, bwd_w] = totals(128);
  const int64_t tiles = 4096 / 128 + 4 * 1024 / 128;
  EXPECT_LE(fwd_w, tiles * (128 + 128));  // at most W + BM keys per tile
  EXPECT_LE(bwd_w, tiles * (128 + 128 + 4 * 128));  // own range + the responses' first W rows near the prompt's end
  EXPECT_LT(fwd_w * 10, fwd_full);
  EXPECT_LT(bwd_w * 10, bwd_full);
}

// The backward order of a windowed plan (plan.cpp, order_windowed_items): items longer than any
// window-cut range (W + BN - 1 rows) first, longest first; then the rest in token order of their
// query range (qa, then k0), but for a tail of at least num_sms * (longest of them) / 4 rows,
// minimal, ordered by length class (eighths of that longest, descending) and then token order.
// Checked against its statement on the items of the plan, whatever their order, so a plan that
// moves, drops or adds items fails too (the coverage test above checks the items themselves).
void check_windowed_order(const Inspected& r, int32_t window, int sms, const std::string& what) {
  SCOPED_TRACE(what + " window " + std::to_string(window) + " sms " + std::to_string(sms));
  struct It { int32_t qa, qb, k0; };
  const int32_t* p = r.plan.data();
  std::vector<It> items;
  for (int i = 0; i < r.info.num_bwd_items; ++i) {
    const int32_t* it = p + p[dualkv::kHdrBwdOffset] + i * dualkv::kBwdItemInts;
    items.push_back({it[3], it[4], it[1]});
  }
  auto len = [](const It& a) { return int64_t(a.qb) - a.qa; };
  const int64_t windowed_max = int64_t(window) + r.info.bwd_block_n - 1;
  size_t i = 0;
  for (; i < items.size() && len(items[i]) > windowed_max; ++i)
    if (i > 0) ASSERT_LE(len(items[i]), len(items[i - 1])) << "long items not longest-first at " << i;
  const size_t first_rest = i;
  int64_t longest = 0;
  for (size_t j = first_rest; j < items.size(); ++j) {
    ASSERT_LE(len(items[j]), windowed_max) << "a long item after the first short one, at " << j;
    longest = std::max(longest, len(items[j]));
  }
  if (first_rest == items.size()) return;
  // The tail: the shortest suffix of the token-ordered rest holding num_sms * longest / 4 rows.
  std::vector<It> rest(items.begin() + first_rest, items.end());
  auto token_less = [](const It& a, const It& b) { return a.qa != b.qa ? a.qa < b.qa : a.k0 < b.k0; };
  std::sort(rest.begin(), rest.end(), token_less);
  const int64_t tail_rows = int64_t(sms) * longest / 4;
  size_t tail = rest.size();
  for (int64_t rows = 0; tail > 0 && rows < tail_rows;) rows += len(rest[--tail]);
  const size_t tail_at = first_rest + tail;
  for (size_t j = first_rest; j < tail_at; ++j)
    ASSERT_TRUE(items[j].qa == rest[j - first_rest].qa && items[j].k0 == rest[j - first_rest].k0)
        << "not in token order at " << j;
  auto size_class = [&](const It& a) { return (len(a) * 8 + longest - 1) / longest; };
  std::vector<It> expect_tail(rest.begin() + tail, rest.end());
  std::stable_sort(expect_tail.begin(), expect_tail.end(), [&](const It& a, const It& b) {
    return size_class(a) != size_class(b) ? size_class(a) > size_class(b) : token_less(a, b);
  });
  for (size_t j = tail_at; j < items.size(); ++j)
    ASSERT_TRUE(items[j].qa == expect_tail[j - tail_at].qa && items[j].k0 == expect_tail[j - tail_at].k0)
        << "tail out of order at " << j;
}

TEST(Plan, WindowedBackwardItemsRunInTokenOrderThenEndShort) {
  std::mt19937 rng(1602);
  for (int trial = 0; trial < 12; ++trial) {
    std::vector<int32_t> lens, parents;
    random_forest(rng, 1 + trial % 3, 1 + trial % 4, 4, 400, &lens, &parents);
    HostLayout l(lens, parents);
    for (int32_t window : {7, 128, 1000})
      for (int D : {64, 128, 256})
        for (int sms : {1, 132})
          check_windowed_order(inspect_windowed(l, D, window, sms), window, sms,
                               "trial " + std::to_string(trial) + " D " + std::to_string(D));
  }
  // The GRPO group of issue 16's benchmark: prompt 4096, 16 responses of 1024, W = 1024. No range
  // is un-windowed (the responses outlast the window), so every item is in the token-ordered part:
  // the KV tiles that see one response (its own 8 and the prompt's last 8) are adjacent, and the
  // plan ends on its shortest items.
  std::vector<int32_t> lens{4096}, parents{-1};
  for (int i = 0; i < 16; ++i) {
    lens.push_back(1024);
    parents.push_back(0);
  }
  HostLayout g(lens, parents);
  const Inspected r = inspect_windowed(g, 128, 1024, 132);
  check_windowed_order(r, 1024, 132, "grpo");
  const int32_t* p = r.plan.data();
  std::vector<std::pair<int32_t, int32_t>> ranges;  // (qa, qb) in plan order
  for (int i = 0; i < r.info.num_bwd_items; ++i) {
    const int32_t* it = p + p[dualkv::kHdrBwdOffset] + i * dualkv::kBwdItemInts;
    ranges.push_back({it[3], it[4]});
  }
  // Response 3's rows [4096 + 3 * 1024, + 1024): the 16 items starting in them are consecutive.
  const int32_t r3 = 4096 + 3 * 1024;
  std::vector<int> at;
  for (size_t i = 0; i < ranges.size(); ++i)
    if (ranges[i].first >= r3 && ranges[i].first < r3 + 1024) at.push_back(static_cast<int>(i));
  ASSERT_EQ(at.size(), 16u);
  EXPECT_EQ(at.back() - at.front(), 15);
  // The last: response 15's last KV tile (its 128 own queries), of the shortest class.
  EXPECT_EQ(ranges.back(), std::make_pair(4096 + 15 * 1024 + 896, 4096 + 16 * 1024));
}

TEST(Plan, BadArgumentsAreErrors) {
  HostLayout l({10}, {-1});
  const dualkv_layout v = l.view();
  dualkv_plan_info info{};
  info.struct_size = sizeof(info);
  EXPECT_EQ(dualkv_plan_inspect(nullptr, 64, 1, &info, nullptr, 0), DUALKV_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dualkv_plan_inspect(&v, 64, 1, nullptr, nullptr, 0), DUALKV_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dualkv_plan_inspect(&v, 0, 1, &info, nullptr, 0), DUALKV_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dualkv_plan_inspect(&v, 64, 0, &info, nullptr, 0), DUALKV_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(dualkv_plan_inspect(&v, 64, 1, &info, nullptr, 0), DUALKV_OK);
  std::vector<int32_t> plan(info.plan_len + 1);
  EXPECT_EQ(dualkv_plan_inspect(&v, 64, 1, &info, plan.data(), info.plan_len + 1), DUALKV_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dualkv_last_error()).find("plan_len"), std::string::npos);
  dualkv_plan_info old{};
  old.struct_size = sizeof(old) - 8;
  EXPECT_EQ(dualkv_plan_inspect(&v, 64, 1, &old, nullptr, 0), DUALKV_ERROR_VERSION);
  std::vector<int32_t> stale = l.subtree_end;
  stale[0] = 0;
  dualkv_layout bad = v;
  bad.seg_subtree_end = stale.data();
  EXPECT_EQ(dualkv_plan_inspect(&bad, 64, 1, &info, nullptr, 0), DUALKV_ERROR_INVALID_LAYOUT);
  dualkv_plan_request req{sizeof(dualkv_plan_request), DUALKV_DEVICE_CUDA, 0, DUALKV_DTYPE_BFLOAT16, 64, -1};
  EXPECT_EQ(dualkv_plan_inspect_ex(&v, &req, 1, &info, nullptr, 0), DUALKV_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dualkv_last_error()).find("window"), std::string::npos);
  req.window = 8;
  req.struct_size = sizeof(req) - 4;
  EXPECT_EQ(dualkv_plan_inspect_ex(&v, &req, 1, &info, nullptr, 0), DUALKV_ERROR_VERSION);
  EXPECT_EQ(dualkv_plan_inspect_ex(&v, nullptr, 1, &info, nullptr, 0), DUALKV_ERROR_INVALID_ARGUMENT);
  int64_t len = 0;
  uint64_t key = 0;
  req.struct_size = sizeof(req);
  req.device = DUALKV_DEVICE_CPU;
  EXPECT_EQ(dualkv_plan_size_ex(&v, &req, &len, &key), DUALKV_OK);  // the CPU backend needs no plan
  EXPECT_EQ(len, 0);
}

// The window kernels pack query heads only on ragged tiles (sm90/fwd_launch.cuh): a GRPO group of
// whole tiles (3,072 and 768 rows: 64, 128 and 192 divide both) is full, with or without a window;
// responses of 50 rows (under a window one per tile; without, 1-3 siblings share one) or of a tile
// plus one row are ragged.
TEST(Plan, RaggedForwardTilesSetTheKeysRaggedBit) {
  auto group = [](int32_t prompt, int32_t response, int n) {
    std::vector<int32_t> lens{prompt}, parents{-1};
    for (int i = 0; i < n; ++i) lens.push_back(response), parents.push_back(0);
    return HostLayout(lens, parents);
  };
  const HostLayout full = group(3072, 768, 8), short_ones = group(384, 50, 8), plus_one = group(4096, 129, 8);
  for (int d : {64, 128, 256}) {
    for (int32_t window : {0, 128, 1024}) {
      SCOPED_TRACE(std::to_string(d) + " window " + std::to_string(window));
      const Inspected f = inspect_windowed(full, d, window, 132), s = inspect_windowed(short_ones, d, window, 132),
                      o = inspect_windowed(plus_one, d, window, 132);
      if (window == 0) {  // check_plan reads unwindowed plans (its walk lengths ignore a window)
        check_plan(full, f, "full");
        check_plan(short_ones, s, "short responses");
        check_plan(plus_one, o, "a tile plus one");
      }
      EXPECT_EQ(f.info.plan_key & dualkv::kPlanRaggedTilesBit, 0u);
      EXPECT_NE(s.info.plan_key & dualkv::kPlanRaggedTilesBit, 0u);
      EXPECT_NE(o.info.plan_key & dualkv::kPlanRaggedTilesBit, 0u);
    }
  }
}

}  // namespace

// A windowed plan whose KV tile is seen by more query ranges than the plan key can count as split
// slots (one per range: each child of the prompt is its own range, with its own distance bias) is
// refused with a clear error; before, the planner doubled the split length until it overflowed
// (SIGFPE).
TEST(Plan, TooManySplitSlotsIsAnError) {
  constexpr int32_t kChildren = (1 << 20) + 16;  // more ranges than any key can count
  std::vector<int32_t> lens(kChildren + 1, 1), parents(kChildren + 1, 0);
  lens[0] = 64;
  parents[0] = -1;
  HostLayout l(lens, parents);
  const dualkv_layout v = l.view();
  const dualkv_plan_request req = dualkv::testing::cuda_request(128, 64, nullptr);  // hides pairs: ranges per child
  dualkv_plan_info info{};
  info.struct_size = sizeof(info);
  EXPECT_EQ(dualkv_plan_inspect_ex(&v, &req, 132, &info, nullptr, 0), DUALKV_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(dualkv_last_error()).find("split slots"), std::string::npos) << dualkv_last_error();
}
