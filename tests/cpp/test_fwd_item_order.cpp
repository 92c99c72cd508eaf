// The Hopper forward's item order (src/cuda/fwd_item_order.h): every order the launcher can pick
// covers each (plan tile, query head) exactly once, the KV-head-major order keeps a KV head's
// query heads on one tile together, and the knobs parse as documented.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/fwd_item_order.h"
#include "dualkv/mask.h"
#include "forest_testing.h"
#include "plan_format.h"
#include "plan_testing.h"
#include "tile_size.h"

namespace {

using dualkv::cuda::choose_bwd_item_order;
using dualkv::cuda::choose_fwd_item_order;
using dualkv::cuda::clamp_fwd_window;
using dualkv::cuda::decode_fwd_item;
using dualkv::cuda::FwdItemOrder;
using dualkv::cuda::FwdItemRows;
using dualkv::cuda::choose_fwd_pack_shift;
using dualkv::cuda::fwd_item_rows;

struct Decoded {
  int32_t tile, h;
};

// The items of one launch in the order the CTAs take them (the kernel's clamp, then its decode).
std::vector<Decoded> decode_all(int32_t n_tiles, int32_t H, int32_t window, int32_t head_run) {
  const int32_t w = clamp_fwd_window(window, n_tiles);
  std::vector<Decoded> out(static_cast<size_t>(n_tiles) * H);
  for (int32_t i = 0; i < n_tiles * H; ++i) decode_fwd_item(i, n_tiles, H, w, head_run, out[i].tile, out[i].h);
  return out;
}

std::string where(int32_t n_tiles, int32_t H, int32_t window, int32_t head_run) {
  return "n_tiles " + std::to_string(n_tiles) + " H " + std::to_string(H) + " window " + std::to_string(window) +
         " head_run " + std::to_string(head_run);
}

TEST(FwdItemOrder, EveryOrderIsAPermutationOfTheItems) {
  const int32_t tile_counts[] = {1, 2, 3, 7, 16, 17, 33, 100, 256};
  const int32_t head_counts[] = {1, 2, 4, 6, 8, 12, 32, 64};
  const int32_t windows[] = {1, 2, 3, 5, 16, 33, 64, 255, 256, 1000, INT32_MAX};
  for (int32_t n_tiles : tile_counts)
    for (int32_t H : head_counts)
      for (int32_t head_run = 1; head_run <= H; ++head_run) {
        if (H % head_run != 0) continue;
        for (int32_t window : windows) {
          std::vector<int> seen(static_cast<size_t>(n_tiles) * H, 0);
          for (const Decoded& d : decode_all(n_tiles, H, window, head_run)) {
            ASSERT_TRUE(d.tile >= 0 && d.tile < n_tiles && d.h >= 0 && d.h < H)
                << where(n_tiles, H, window, head_run) << ": tile " << d.tile << " head " << d.h;
            ++seen[static_cast<size_t>(d.tile) * H + d.h];
          }
          for (size_t k = 0; k < seen.size(); ++k)
            ASSERT_EQ(seen[k], 1) << where(n_tiles, H, window, head_run) << ": tile " << k / H << " head " << k % H;
        }
      }
}

// head_run 1 is the order main had up to 2026-12-02 (query head outer, tiles inner, per window);
// decode_fwd_item with head_run 1 and window 16 reproduces it exactly (the A/B's baseline).
TEST(FwdItemOrder, HeadRunOneIsTheQueryHeadOuterOrder) {
  for (int32_t n_tiles : {5, 16, 37, 256})
    for (int32_t H : {1, 8, 32})
      for (int32_t window : {1, 16, 64}) {
        const std::vector<Decoded> got = decode_all(n_tiles, H, window, 1);
        for (int32_t i = 0; i < n_tiles * H; ++i) {
          const int32_t w = i / (window * H), r = i % (window * H), first = w * window;
          const int32_t cnt = std::min(window, n_tiles - first);
          ASSERT_EQ(got[i].h, r / cnt) << where(n_tiles, H, window, 1) << " item " << i;
          ASSERT_EQ(got[i].tile, first + r % cnt) << where(n_tiles, H, window, 1) << " item " << i;
        }
      }
}

// The default order (head_run = the GQA group, the whole plan as one window): the KV head never
// goes back over the items, so the CTAs running at once read one or two KV heads; each run of
// `group` consecutive items is one tile and the group's query heads in order; and each KV head's
// tiles come in the plan's order (longest work first).
TEST(FwdItemOrder, KvHeadMajorKeepsTheGroupOnOneTile) {
  for (int32_t n_tiles : {1, 9, 256})
    for (int32_t Hk : {1, 2, 8})
      for (int32_t group : {1, 4, 8}) {
        const int32_t H = Hk * group;
        const FwdItemOrder o = choose_fwd_item_order(H, Hk);
        ASSERT_EQ(o.head_run, group);
        const std::vector<Decoded> got = decode_all(n_tiles, H, o.window, o.head_run);
        for (int32_t i = 0; i < n_tiles * H; ++i) {
          const int32_t hk = i / (n_tiles * group), j = i % (n_tiles * group);
          ASSERT_EQ(got[i].h / group, hk) << where(n_tiles, H, o.window, o.head_run) << " item " << i;
          ASSERT_EQ(got[i].tile, j / group) << where(n_tiles, H, o.window, o.head_run) << " item " << i;
          ASSERT_EQ(got[i].h % group, j % group) << where(n_tiles, H, o.window, o.head_run) << " item " << i;
        }
      }
}

// A window of w tiles: window k's items (all heads) come before window k + 1's.
TEST(FwdItemOrder, WindowsRunInPlanOrder) {
  const int32_t n_tiles = 50, H = 8;
  for (int32_t head_run : {1, 2, 4, 8})
    for (int32_t window : {3, 16, 49}) {
      const std::vector<Decoded> got = decode_all(n_tiles, H, window, head_run);
      for (int32_t i = 1; i < n_tiles * H; ++i)
        ASSERT_LE(got[i - 1].tile / window, got[i].tile / window) << where(n_tiles, H, window, head_run);
    }
}

TEST(FwdItemOrder, DefaultIsKvHeadRunsOverTheWholePlan) {
  const FwdItemOrder def = choose_fwd_item_order(32, 8);
  EXPECT_EQ(def.window, INT32_MAX);
  EXPECT_EQ(def.head_run, 4);
  // MHA: a group of one; a KV head count that does not divide H (the API refuses it first) falls
  // back to query-head runs of one, still a permutation.
  EXPECT_EQ(choose_fwd_item_order(16, 16).head_run, 1);
  EXPECT_EQ(choose_fwd_item_order(12, 5).head_run, 1);
  EXPECT_EQ(choose_fwd_item_order(12, 0).head_run, 1);
  EXPECT_EQ(clamp_fwd_window(INT32_MAX, 256), 256);
  EXPECT_EQ(clamp_fwd_window(16, 256), 16);
  EXPECT_EQ(clamp_fwd_window(0, 256), 1);
  EXPECT_EQ(clamp_fwd_window(16, 0), 1);
}

// The backward's claim order over (work items, KV heads): windows of SMs / 2 work items with runs of
// two KV heads, so the first SMs claims (one wave of persistent CTAs) are SMs / 2 work items of two KV
// heads; an odd KV head count keeps a work item's heads together, which is the order before.
TEST(BwdItemOrder, RunsOfTwoKvHeadsOverHalfAWaveOfWorkItems) {
  const FwdItemOrder o = choose_bwd_item_order(132, 8);
  EXPECT_EQ(o.window, 66);
  EXPECT_EQ(o.head_run, 2);
  const int32_t n_work = 500, Hk = 8;
  const std::vector<Decoded> got = decode_all(n_work, Hk, o.window, o.head_run);
  for (int32_t i = 0; i < 132; ++i) {
    ASSERT_EQ(got[i].tile, i / 2) << "claim " << i;
    ASSERT_EQ(got[i].h, i % 2) << "claim " << i;
  }
  EXPECT_EQ(got[132].tile, 0);  // the window's next run: KV heads 2 and 3 of the same work items
  EXPECT_EQ(got[132].h, 2);
  for (int32_t Hk_odd : {1, 3, 5}) {
    const FwdItemOrder odd = choose_bwd_item_order(132, Hk_odd);
    EXPECT_EQ(odd.head_run, Hk_odd);
    const std::vector<Decoded> same = decode_all(40, Hk_odd, odd.window, odd.head_run);
    for (int32_t i = 0; i < 40 * Hk_odd; ++i) {
      ASSERT_EQ(same[i].tile, i / Hk_odd) << "Hk " << Hk_odd << " claim " << i;
      ASSERT_EQ(same[i].h, i % Hk_odd) << "Hk " << Hk_odd << " claim " << i;
    }
  }
  EXPECT_EQ(choose_bwd_item_order(1, 8).window, 1);
  EXPECT_EQ(choose_bwd_item_order(132, 0).head_run, 1);
}

// Packed query heads (fwd_item_rows): on the Hopper family's plans of random forests (short-leaf
// sibling tiles among them) at every head dim and group, the items of each tile cover each (token,
// head) of the tile once; an item's rows lie in its walk's first segment or the siblings after it;
// and every own KV tile the walk takes unmasked (the kernel's fast path: a full tile ending at or
// before q_diag) is wholly visible to every row of the item, which is what lets the kernels skip
// its mask. Shift 0 is the unpacked item: the tile of head h.
TEST(FwdItemRows, PackedItemsCoverTheTileOnceAndKeepTheUnmaskedTilesVisible) {
  std::mt19937 rng(23);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<int32_t> lens, parents;
    dualkv::testing::random_forest(rng, 1 + trial % 3, 1 + trial % 3, 6, trial % 2 ? 90 : 400, &lens, &parents);
    const dualkv::testing::HostLayout l(lens, parents);
    const std::vector<int32_t>& off = l.offsets;
    for (int D : {64, 128, 256}) {
      const dualkv::testing::Inspected r = dualkv::testing::inspect_request(
          l.view(), dualkv::testing::cuda_request(D, 0, nullptr, DUALKV_PLAN_TILES_SM90), 132);
      const int32_t* fwd = r.plan.data() + r.plan[dualkv::kHdrFwdOffset];
      const int32_t bm = r.info.fwd_block_m;
      for (int32_t shift = 0; shift <= 4; ++shift) {
        const int32_t G = 1 << shift;
        for (int t = 0; t < r.info.num_fwd_tiles; ++t) {
          const int32_t seg = fwd[t * dualkv::kFwdItemInts], q0 = fwd[t * dualkv::kFwdItemInts + 1],
                        q1 = fwd[t * dualkv::kFwdItemInts + 2];
          const std::string at = "trial " + std::to_string(trial) + " D " + std::to_string(D) + " shift " +
                                 std::to_string(shift) + " tile " + std::to_string(t);
          std::vector<int> covered(static_cast<size_t>(q1 - q0) * G, 0);
          for (int32_t h = 0; h < G; ++h) {
            const FwdItemRows it = fwd_item_rows(seg, q0, q1, off.data(), h, shift, bm);
            if (shift == 0) {
              ASSERT_TRUE(it.seg == seg && it.q0 == q0 && it.q1 == q1 && it.q_diag == q0 && it.head0 == h) << at;
            }
            if (it.q0 >= it.q1) {
              ASSERT_GE(it.q0, q1) << at << ": an empty item inside the tile";
              continue;
            }
            ASSERT_LE(it.q1 - it.q0, bm >> shift) << at;
            ASSERT_TRUE(it.q0 >= q0 && it.q1 <= q1) << at;
            ASSERT_TRUE(off[it.seg] <= it.q0 && it.q0 < off[it.seg + 1]) << at << ": item seg " << it.seg;
            ASSERT_EQ(it.head0, shift == 0 ? h : 0) << at;
            const bool one_segment = q1 <= off[seg + 1];
            ASSERT_EQ(it.q_diag, one_segment ? it.q0 : q0) << at;
            for (int32_t q = it.q0; q < it.q1; ++q)
              for (int32_t i = 0; i < G; ++i) ++covered[static_cast<size_t>(q - q0) * G + i];
            // The walk the kernels take for the item, and the tiles of it they leave unmasked.
            auto check_walk = [&](auto bn_tag) {
              constexpr int BN = decltype(bn_tag)::value;
              dualkv::KvWalk<BN> kv;
              kv.init(off.data(), l.parent.data(), it.seg, it.q1);
              do {
                if (kv.own && kv.rest() >= BN && kv.pos + BN - 1 <= it.q_diag)
                  for (int32_t q = it.q0; q < it.q1; ++q)
                    ASSERT_GE(dualkv::SegmentMask::fwd_visible_cols(kv.pos, kv.rest(), true, q), BN)
                        << at << ": row " << q << " of an unmasked own tile at " << kv.pos;
              } while (kv.next(off.data(), l.parent.data()));
            };
            check_walk(std::integral_constant<int, 64>{});
            check_walk(std::integral_constant<int, 80>{});
            check_walk(std::integral_constant<int, 128>{});
            check_walk(std::integral_constant<int, 160>{});
          }
          for (size_t k = 0; k < covered.size(); ++k)
            ASSERT_EQ(covered[k], 1) << at << ": token " << q0 + int32_t(k / G) << " head " << k % G;
        }
      }
    }
  }
}

TEST(FwdItemRows, PackShiftTakesGroupsOfTwoToSixteen) {
  EXPECT_EQ(choose_fwd_pack_shift(32, 8), 2);
  EXPECT_EQ(choose_fwd_pack_shift(16, 8), 1);
  EXPECT_EQ(choose_fwd_pack_shift(64, 8), 3);
  EXPECT_EQ(choose_fwd_pack_shift(32, 2), 4);
  EXPECT_EQ(choose_fwd_pack_shift(64, 2), 0);  // 32 heads per KV head: one head per item
  EXPECT_EQ(choose_fwd_pack_shift(8, 8), 0);
  EXPECT_EQ(choose_fwd_pack_shift(12, 4), 0);  // a group of 3
  EXPECT_EQ(choose_fwd_pack_shift(12, 5), 0);
  EXPECT_EQ(choose_fwd_pack_shift(12, 0), 0);
}

}  // namespace
