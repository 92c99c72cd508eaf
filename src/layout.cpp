// Layout validation and derivation (host side). See include/dualkv/layout.h for the model.
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "dualkv/dualkv.h"
#include "dualkv/layout.h"
#include "internal.h"

using dualkv::detail::fail;

namespace {

// Checks the prefix table of a forest (dualkv_prefixes) and returns the number of prefixes in use
// by it (0 for none).
dualkv_status check_prefix_table(const dualkv_prefixes* p, int32_t* num_prefixes) {
  const dualkv_status bad = DUALKV_ERROR_INVALID_LAYOUT;
  *num_prefixes = 0;
  if (!p || p->num_prefixes == 0) return DUALKV_OK;
  if (p->num_prefixes < 0) return fail(bad, "layout: num_prefixes must be >= 0, got %d", p->num_prefixes);
  if (!p->seg_prefix || !p->prefix_offsets)
    return fail(bad, "layout: %d external prefixes but seg_prefix or prefix_offsets is NULL", p->num_prefixes);
  if (p->prefix_offsets[0] != 0) return fail(bad, "layout: prefix_offsets[0] must be 0, got %d", p->prefix_offsets[0]);
  for (int32_t e = 0; e < p->num_prefixes; ++e)
    if (p->prefix_offsets[e + 1] <= p->prefix_offsets[e])
      return fail(bad, "layout: external prefix %d is empty or prefix_offsets are not increasing "
                  "(prefix_offsets[%d]=%d, prefix_offsets[%d]=%d)", e, e, p->prefix_offsets[e], e + 1,
                  p->prefix_offsets[e + 1]);
  if (p->prefix_offsets[p->num_prefixes] != p->num_prefix_rows)
    return fail(bad, "layout: prefix_offsets[E]=%d does not match num_prefix_rows %d",
                p->prefix_offsets[p->num_prefixes], p->num_prefix_rows);
  *num_prefixes = p->num_prefixes;
  return DUALKV_OK;
}

}  // namespace

extern "C" DUALKV_API dualkv_status dualkv_layout_derive_prefixed(
    const int32_t* seg_offsets, const int32_t* seg_parent, int32_t num_segments, int64_t num_tokens,
    const dualkv_prefixes* prefixes, int32_t* seg_subtree_end, int32_t* seg_position_offset, int32_t* seg_depth,
    int32_t* max_depth) {
  dualkv::detail::clear_error();
  const dualkv_status bad = DUALKV_ERROR_INVALID_LAYOUT;
  if (num_segments < 1) return fail(bad, "layout: num_segments must be >= 1, got %d", num_segments);
  if (!seg_offsets || !seg_parent) return fail(bad, "layout: seg_offsets and seg_parent must not be NULL");
  if (num_tokens < 1 || num_tokens > std::numeric_limits<int32_t>::max())
    return fail(bad, "layout: num_tokens %lld must be in [1, 2^31-1] (32-bit token indexing)",
                static_cast<long long>(num_tokens));
  int32_t E = 0;
  if (dualkv_status st = check_prefix_table(prefixes, &E); st != DUALKV_OK) return st;
  // held_by[e]: the segment that holds prefix e (-1: none yet).
  std::vector<int32_t> held_by(static_cast<size_t>(E), -1);
  if (seg_offsets[0] != 0) return fail(bad, "layout: seg_offsets[0] must be 0, got %d", seg_offsets[0]);
  for (int32_t s = 0; s < num_segments; ++s) {
    const int32_t e = E > 0 ? prefixes->seg_prefix[s] : -1;
    if (e < -1 || e >= E)
      return fail(bad, "layout: segment %d references external prefix %d, but there are %d prefixes (valid: -1 "
                  "for none, 0..%d)", s, e, E, E - 1);
    if (e >= 0) {
      if (held_by[static_cast<size_t>(e)] >= 0)
        return fail(bad, "layout: external prefix %d is held by segments %d and %d; a prefix is held by one segment "
                    "(put all its children under it)", e, held_by[static_cast<size_t>(e)], s);
      held_by[static_cast<size_t>(e)] = s;
      if (seg_parent[s] != -1)
        return fail(bad, "layout: external segment %d (prefix %d) has parent %d; an external prefix segment must be a "
                    "root", s, e, seg_parent[s]);
      if (seg_offsets[s + 1] != seg_offsets[s])
        return fail(bad, "layout: external segment %d (prefix %d) holds %d tokens of q/k/v; its keys and values are "
                    "prefix rows, so seg_offsets[%d] must equal seg_offsets[%d]", s, e, seg_offsets[s + 1] - seg_offsets[s],
                    s + 1, s);
    } else if (seg_offsets[s + 1] <= seg_offsets[s]) {
      return fail(bad,
                  "layout: segment %d is empty or offsets are not increasing "
                  "(seg_offsets[%d]=%d, seg_offsets[%d]=%d); every segment needs >= 1 token%s",
                  s, s, seg_offsets[s], s + 1, seg_offsets[s + 1],
                  E > 0 ? "" : " (an external prefix segment needs its dualkv_prefixes)");
    }
  }
  if (seg_offsets[num_segments] != num_tokens)
    return fail(bad, "layout: seg_offsets[S]=%d does not match the number of tokens %lld",
                seg_offsets[num_segments], static_cast<long long>(num_tokens));

  // Walk the segments in order keeping the chain of open ancestors. In DFS pre-order a segment's
  // parent must be on that chain; popping past it closes subtrees for good, so a parent that was
  // already closed means its subtree is not contiguous.
  std::vector<int32_t> chain;  // open segments, root first
  std::vector<int32_t> subtree_end(num_segments), position_offset(num_segments), depth(num_segments);
  int64_t deepest = 0;
  // Keys a segment contributes to its descendants' positions: its tokens, or its prefix rows.
  auto length = [&](int32_t s) -> int64_t {
    const int32_t e = E > 0 ? prefixes->seg_prefix[s] : -1;
    return e >= 0 ? prefixes->prefix_offsets[e + 1] - prefixes->prefix_offsets[e] : seg_offsets[s + 1] - seg_offsets[s];
  };
  for (int32_t s = 0; s < num_segments; ++s) {
    const int32_t p = seg_parent[s];
    if (p < -1 || p >= num_segments)
      return fail(bad, "layout: seg_parent[%d]=%d is out of range [-1, %d)", s, p, num_segments);
    if (p >= s)
      return fail(bad, "layout: seg_parent[%d]=%d must come before its child (DFS pre-order)", s, p);
    while (!chain.empty() && chain.back() != p) {
      subtree_end[chain.back()] = s;
      chain.pop_back();
    }
    if (p != -1 && chain.empty())
      return fail(bad,
                  "layout: subtree of segment %d is not contiguous: its child %d comes after "
                  "segments outside the subtree",
                  p, s);
    const int64_t pos = p == -1 ? 0 : int64_t(position_offset[p]) + length(p);
    if (pos + length(s) > std::numeric_limits<int32_t>::max())
      return fail(bad, "layout: positions in segment %d exceed 2^31-1", s);
    position_offset[s] = static_cast<int32_t>(pos);
    depth[s] = p == -1 ? 0 : depth[p] + 1;
    deepest = depth[s] > deepest ? depth[s] : deepest;
    chain.push_back(s);
  }
  for (int32_t s : chain) subtree_end[s] = num_segments;
  for (int32_t e = 0; e < E; ++e) {
    const int32_t s = held_by[static_cast<size_t>(e)];
    if (s >= 0 && subtree_end[s] == s + 1)
      return fail(bad, "layout: external segment %d (prefix %d) has no children: no query would see its rows", s, e);
  }

  for (int32_t s = 0; s < num_segments; ++s) {
    if (seg_subtree_end) seg_subtree_end[s] = subtree_end[s];
    if (seg_position_offset) seg_position_offset[s] = position_offset[s];
    if (seg_depth) seg_depth[s] = depth[s];
  }
  if (max_depth) *max_depth = static_cast<int32_t>(deepest + 1);
  return DUALKV_OK;
}

extern "C" DUALKV_API dualkv_status dualkv_layout_derive(
    const int32_t* seg_offsets, const int32_t* seg_parent, int32_t num_segments, int64_t num_tokens,
    int32_t* seg_subtree_end, int32_t* seg_position_offset, int32_t* seg_depth,
    int32_t* max_depth) {
  return dualkv_layout_derive_prefixed(seg_offsets, seg_parent, num_segments, num_tokens, nullptr, seg_subtree_end,
                                       seg_position_offset, seg_depth, max_depth);
}

namespace dualkv::detail {

dualkv_status check_host_layout(const dualkv_layout& l, const dualkv_prefixes* prefixes) {
  if (!l.seg_offsets || !l.seg_parent || !l.seg_subtree_end || !l.seg_position_offset || !l.seg_depth)
    return fail(DUALKV_ERROR_INVALID_LAYOUT,
                "layout: a layout array is NULL (derived arrays come from dualkv_layout_derive)");
  if (l.num_segments < 1 || l.num_tokens < 1)
    return fail(DUALKV_ERROR_INVALID_LAYOUT, "layout: has %d segments and %d tokens; both must be >= 1",
                l.num_segments, l.num_tokens);
  std::vector<int32_t> end(l.num_segments), pos(l.num_segments), depth(l.num_segments);
  int32_t max_depth = 0;
  if (dualkv_status st = dualkv_layout_derive_prefixed(l.seg_offsets, l.seg_parent, l.num_segments, l.num_tokens,
                                                       prefixes, end.data(), pos.data(), depth.data(), &max_depth);
      st != DUALKV_OK)
    return st;
  if (std::memcmp(end.data(), l.seg_subtree_end, end.size() * 4) != 0 ||
      std::memcmp(pos.data(), l.seg_position_offset, pos.size() * 4) != 0 ||
      std::memcmp(depth.data(), l.seg_depth, depth.size() * 4) != 0 || max_depth != l.max_depth)
    return fail(DUALKV_ERROR_INVALID_LAYOUT,
                "layout: derived arrays do not match seg_offsets/seg_parent (stale or modified layout?)");
  return DUALKV_OK;
}

}  // namespace dualkv::detail

extern "C" DUALKV_API dualkv_status dualkv_layout_position_ids_prefixed(const dualkv_layout* host_layout,
                                                                        const dualkv_prefixes* prefixes,
                                                                        int32_t* out) {
  dualkv::detail::clear_error();
  if (!host_layout) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "position_ids: layout is NULL");
  if (dualkv_status st = dualkv::detail::check_host_layout(*host_layout, prefixes); st != DUALKV_OK) return st;
  if (!out) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "position_ids: out is NULL");
  const dualkv::ForestView f = dualkv::make_forest_view(*host_layout);
  for (int32_t s = 0; s < f.num_segments; ++s)
    for (int32_t t = f.segment_begin(s); t < f.segment_end(s); ++t) out[t] = f.position(s, t);
  return DUALKV_OK;
}

extern "C" DUALKV_API dualkv_status dualkv_layout_position_ids(const dualkv_layout* host_layout, int32_t* out) {
  return dualkv_layout_position_ids_prefixed(host_layout, nullptr, out);
}

extern "C" DUALKV_API dualkv_status dualkv_layout_visible_pairs_prefixed(const dualkv_layout* host_layout,
                                                                         const dualkv_prefixes* prefixes,
                                                                         int64_t* pairs) {
  dualkv::detail::clear_error();
  if (!host_layout) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "visible_pairs: layout is NULL");
  if (dualkv_status st = dualkv::detail::check_host_layout(*host_layout, prefixes); st != DUALKV_OK) return st;
  if (!pairs) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "visible_pairs: out is NULL");
  const dualkv::ForestView f = dualkv::make_forest_view(*host_layout);
  int64_t total = 0;
  for (int32_t s = 0; s < f.num_segments; ++s) {  // an external segment has no queries (length 0)
    const int64_t len = f.segment_length(s);
    total += len * f.position_offset[s] + len * (len + 1) / 2;
  }
  *pairs = total;
  return DUALKV_OK;
}

extern "C" DUALKV_API dualkv_status dualkv_layout_visible_pairs(const dualkv_layout* host_layout, int64_t* pairs) {
  return dualkv_layout_visible_pairs_prefixed(host_layout, nullptr, pairs);
}
