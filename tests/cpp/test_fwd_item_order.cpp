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

namespace {

using dualkv::cuda::choose_bwd_item_order;
using dualkv::cuda::choose_fwd_item_order;
using dualkv::cuda::clamp_fwd_window;
using dualkv::cuda::decode_fwd_item;
using dualkv::cuda::FwdItemOrder;

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

}  // namespace
