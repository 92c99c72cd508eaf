// The segment forest and the visibility predicate, defined once for host and device code.
//
// Segments are stored in DFS pre-order: a parent precedes its children and a segment's whole
// subtree occupies the contiguous segment range [s, subtree_end[s]) right after it. Because of
// that, "a is an ancestor of s" is one comparison pair: a < s && s < subtree_end[a]. The CPU
// backend, the CUDA kernels' masking and the C++ tests all use the functions below; the Python
// reference (python/dualkv/reference.py) rebuilds the same mask independently to cross-check.
#ifndef DUALKV_LAYOUT_H_
#define DUALKV_LAYOUT_H_

#include <stdint.h>

#include "dualkv/dualkv.h"

#if defined(__CUDACC__)
#define DUALKV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DUALKV_HOST_DEVICE inline
#endif

namespace dualkv {

// A read-only view of a derived layout (dualkv_layout with every array filled in).
struct ForestView {
  int32_t num_segments;
  int32_t num_tokens;
  const int32_t* offsets;          // [S+1]
  const int32_t* parent;           // [S]
  const int32_t* subtree_end;      // [S]
  const int32_t* position_offset;  // [S]
  // External prefix segments (dualkv_prefixes): NULL when the forest has none.
  const int32_t* prefix;           // [S] prefix held by segment s, or -1
  const int32_t* prefix_offsets;   // [E+1] rows of each prefix in the prefix buffers

  DUALKV_HOST_DEVICE int32_t segment_begin(int32_t s) const { return offsets[s]; }
  DUALKV_HOST_DEVICE int32_t segment_end(int32_t s) const { return offsets[s + 1]; }
  DUALKV_HOST_DEVICE int32_t segment_length(int32_t s) const { return offsets[s + 1] - offsets[s]; }

  // First token after s's whole subtree: s's own tokens, then every descendant's, are the
  // contiguous token range [segment_begin(s), subtree_token_end(s)).
  DUALKV_HOST_DEVICE int32_t subtree_token_end(int32_t s) const { return offsets[subtree_end[s]]; }

  // An external segment holds no tokens (its range above is empty) but the prefix rows
  // [prefix_begin(s), prefix_end(s)) of the prefix buffers, all seen by every token of its subtree.
  DUALKV_HOST_DEVICE bool is_external(int32_t s) const { return prefix && prefix[s] >= 0; }
  DUALKV_HOST_DEVICE int32_t prefix_begin(int32_t s) const { return prefix_offsets[prefix[s]]; }
  DUALKV_HOST_DEVICE int32_t prefix_end(int32_t s) const { return prefix_offsets[prefix[s] + 1]; }

  // The keys segment s holds: its tokens, or an external segment's prefix rows; key k of them is
  // at position key_position(s, k) (positions continue along the path through either kind).
  DUALKV_HOST_DEVICE int32_t keys_begin(int32_t s) const { return is_external(s) ? prefix_begin(s) : segment_begin(s); }
  DUALKV_HOST_DEVICE int32_t keys_end(int32_t s) const { return is_external(s) ? prefix_end(s) : segment_end(s); }
  DUALKV_HOST_DEVICE int32_t key_position(int32_t s, int32_t k) const {
    return position_offset[s] + (k - keys_begin(s));
  }

  // True iff a is a proper ancestor of s.
  DUALKV_HOST_DEVICE bool is_proper_ancestor(int32_t a, int32_t s) const {
    return a < s && s < subtree_end[a];
  }

  // The visibility predicate of the attention contract: query token q (in segment qs) sees key
  // token k (in segment ks) iff ks is a proper ancestor of qs, or ks == qs and k <= q. (A key of
  // an external segment, a prefix row, is seen in full: ks has no queries, so ks != qs.)
  DUALKV_HOST_DEVICE bool visible(int32_t qs, int32_t q, int32_t ks, int32_t k) const {
    return ks == qs ? k <= q : is_proper_ancestor(ks, qs);
  }

  // Number of keys query token q of segment qs sees: all ancestors' tokens plus its own prefix.
  DUALKV_HOST_DEVICE int32_t num_visible_keys(int32_t qs, int32_t q) const {
    return position_offset[qs] + (q - offsets[qs]) + 1;
  }

  // RoPE position of token t of segment s.
  DUALKV_HOST_DEVICE int32_t position(int32_t s, int32_t t) const {
    return position_offset[s] + (t - offsets[s]);
  }

  // Segment holding token t (binary search over offsets; t must be in [0, T); the last of equal
  // offsets wins, so an external segment, which holds no token, is never the answer).
  DUALKV_HOST_DEVICE int32_t segment_of(int32_t t) const {
    int32_t lo = 0, hi = num_segments - 1;
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) >> 1;
      if (offsets[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
  }
};

DUALKV_HOST_DEVICE ForestView make_forest_view(const dualkv_layout& l) {
  return ForestView{l.num_segments, l.num_tokens, l.seg_offsets, l.seg_parent, l.seg_subtree_end,
                    l.seg_position_offset, nullptr, nullptr};
}

// The view of a forest that may have external prefix segments.
DUALKV_HOST_DEVICE ForestView make_forest_view(const dualkv_layout& l, const dualkv_prefixes& p) {
  ForestView f = make_forest_view(l);
  if (p.num_prefixes > 0) {
    f.prefix = p.seg_prefix;
    f.prefix_offsets = p.prefix_offsets;
  }
  return f;
}

}  // namespace dualkv

#endif  // DUALKV_LAYOUT_H_
