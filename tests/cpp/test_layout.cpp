#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "forest_testing.h"

using dualkv::ForestView;
using dualkv::testing::HostLayout;
using dualkv::testing::random_forest;

namespace {

// Ancestor test by walking parents: an independent check of the DFS-range shortcut.
bool walk_is_ancestor(const std::vector<int32_t>& parent, int32_t a, int32_t s) {
  for (int32_t x = parent[s]; x >= 0; x = parent[x])
    if (x == a) return true;
  return false;
}

TEST(Layout, GrpoGroupDerivedArrays) {
  // Two groups: prompt 5 with responses 3, 1; prompt 2 with response 4.
  HostLayout l({5, 3, 1, 2, 4}, {-1, 0, 0, -1, 3});
  EXPECT_EQ(l.subtree_end, (std::vector<int32_t>{3, 2, 3, 5, 5}));
  EXPECT_EQ(l.position_offset, (std::vector<int32_t>{0, 5, 5, 0, 2}));
  EXPECT_EQ(l.depth, (std::vector<int32_t>{0, 1, 1, 0, 1}));
  EXPECT_EQ(l.max_depth, 2);
  std::vector<int32_t> pos(l.num_tokens());
  const dualkv_layout v = l.view();
  ASSERT_EQ(dualkv_layout_position_ids(&v, pos.data()), DUALKV_OK);
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 5, 0, 1, 2, 3, 4, 5}));
  int64_t pairs = 0;
  ASSERT_EQ(dualkv_layout_visible_pairs(&v, &pairs), DUALKV_OK);
  // prompt 15 + resp (3*5+6) + (1*5+1) + prompt 3 + resp (4*2+10)
  EXPECT_EQ(pairs, 15 + 21 + 6 + 3 + 18);
}

TEST(Layout, VisibilityMatchesParentWalkOnRandomForests) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<int32_t> lengths, parents;
    random_forest(rng, 1 + trial % 4, 1 + trial % 4, 3, 5, &lengths, &parents);
    HostLayout l(lengths, parents);
    const dualkv_layout v = l.view();
    const ForestView f = dualkv::make_forest_view(v);
    int64_t pairs = 0;
    for (int i = 0; i < l.num_tokens(); ++i) {
      const int32_t si = f.segment_of(i);
      ASSERT_TRUE(l.offsets[si] <= i && i < l.offsets[si + 1]);
      int visible = 0;
      for (int j = 0; j < l.num_tokens(); ++j) {
        const int32_t sj = f.segment_of(j);
        const bool expect = sj == si ? j <= i : walk_is_ancestor(parents, sj, si);
        ASSERT_EQ(f.visible(si, i, sj, j), expect) << "trial " << trial << " q " << i << " k " << j;
        visible += expect;
      }
      ASSERT_EQ(f.num_visible_keys(si, i), visible);
      pairs += visible;
      // position = number of visible keys - 1 = ancestors' lengths + offset in segment
      ASSERT_EQ(f.position(si, i), visible - 1);
    }
    int64_t counted = 0;
    ASSERT_EQ(dualkv_layout_visible_pairs(&v, &counted), DUALKV_OK);
    ASSERT_EQ(counted, pairs);
    for (int32_t s = 0; s < l.num_segments(); ++s)
      for (int32_t a = 0; a < l.num_segments(); ++a)
        ASSERT_EQ(f.is_proper_ancestor(a, s), walk_is_ancestor(parents, a, s));
  }
}

struct BadLayout {
  std::string name;
  std::vector<int32_t> offsets, parent;
  int64_t tokens;
  std::string message;  // a fragment the error must contain
};

TEST(Layout, MalformedLayoutsAreRejectedWithAReason) {
  const std::vector<BadLayout> cases = {
      {"empty segment", {0, 3, 3, 5}, {-1, 0, 0}, 5, "empty"},
      {"decreasing offsets", {0, 4, 2, 6}, {-1, 0, 0}, 6, "not increasing"},
      {"first offset not zero", {1, 3, 5}, {-1, 0}, 5, "seg_offsets[0]"},
      {"offsets do not match T", {0, 3, 5}, {-1, 0}, 7, "does not match"},
      {"parent out of range", {0, 3, 5}, {-1, 7}, 5, "out of range"},
      {"parent below -1", {0, 3, 5}, {-1, -2}, 5, "out of range"},
      {"parent after child", {0, 3, 5, 6}, {-1, 2, -1}, 6, "before its child"},
      {"self parent", {0, 3, 5}, {-1, 1}, 5, "before its child"},
      {"subtree not contiguous", {0, 2, 4, 6}, {-1, -1, 0}, 6, "not contiguous"},
      {"subtree not contiguous, deeper", {0, 1, 2, 3, 4}, {-1, 0, -1, 1}, 4, "not contiguous"},
      {"no tokens", {0}, {}, 0, "num_segments"},
  };
  for (const BadLayout& c : cases) {
    const int32_t S = int32_t(c.parent.size());
    std::vector<int32_t> end(std::max(S, 1)), pos(std::max(S, 1)), depth(std::max(S, 1));
    const dualkv_status st = dualkv_layout_derive(c.offsets.data(), c.parent.data(), S, c.tokens,
                                                  end.data(), pos.data(), depth.data(), nullptr);
    EXPECT_EQ(st, DUALKV_ERROR_INVALID_LAYOUT) << c.name;
    EXPECT_NE(std::string(dualkv_last_error()).find(c.message), std::string::npos)
        << c.name << ": " << dualkv_last_error();
  }
}

TEST(Layout, TokenCountBeyond32BitsIsRejected) {
  std::vector<int32_t> offsets = {0, 5}, parent = {-1};
  EXPECT_EQ(dualkv_layout_derive(offsets.data(), parent.data(), 1, int64_t(1) << 32, nullptr, nullptr,
                                 nullptr, nullptr),
            DUALKV_ERROR_INVALID_LAYOUT);
  EXPECT_NE(std::string(dualkv_last_error()).find("32-bit"), std::string::npos);
}

}  // namespace
