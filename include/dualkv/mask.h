// The segment mask policy: which (query, key) pairs of a segment forest attend, stated once for
// the planner, the kernels of every arch and the CPU backend (host and device code).
//
// Modelled on CUTLASS example 88's fusion policies (a visibility rule, trip counts, a per-tile
// kind and an apply step), for the forest rule of layout.h: key k is visible from query q iff k
// lies in a proper ancestor segment of q's segment, or in q's own segment at k <= q. Equivalently,
// in DFS token order: k <= q and q < subtree_token_end(segment of k).
//
// The four parts, and who uses them:
//   1. visible(): the elementwise rule (CPU backend, tests, dense references).
//   2. Trip counts: the KV ranges a forward query tile walks (KvWalk: every proper ancestor in
//      full, nearest first, then its own segment up to the tile's last query), and the query range
//      a backward KV tile is seen by (bwd_query_range: its own causal queries, then every
//      descendant's tokens, contiguous in DFS order). The planner sizes work with them; the kernels
//      walk them.
//   3. Tile kinds: for a (query tile, KV tile) pair, kFull (every pair visible: no masking),
//      kRagged (the KV tile runs past the end of its range) or kDiagonal (the tile crosses the
//      causal diagonal of the query's own segment). Uniform per tile, so kernels branch on it.
//   4. Apply: the per-element test inside a tile that is not kFull (fwd_hidden, bwd_hidden).
//
// A new mask modifier (sliding window on positions, a logit softcap, attention sinks, external
// prefix segments) goes here: the rule, the walks that skip tiles it hides, the tile kind that
// flags tiles it cuts, and the apply step; docs/adding_kernels.md lists the call sites.
#ifndef DUALKV_MASK_H_
#define DUALKV_MASK_H_

#include <stdint.h>

#include "dualkv/layout.h"

namespace dualkv {

enum class TileKind : int32_t {
  kFull = 0,      // every (query, key) pair of the tile pair is visible
  kRagged = 1,    // the KV tile runs past the end of its range: columns past it are hidden
  kDiagonal = 2,  // the tile pair crosses the causal diagonal of the query's segment
};

// A half-open token range [begin, end).
struct TokenRange {
  int32_t begin;
  int32_t end;
};

// The KV ranges a forward query tile of segment `seg` (last query q1 - 1) sees, walked in tiles
// of BN tokens: the parent's tokens, its parent's, ... up to the root (full), then the segment's
// own tokens up to q1. Host and device; the kernels keep one walk per query tile.
template <int BN>
struct KvWalk {
  int32_t seg;      // query segment
  int32_t cur;      // segment of the current KV range
  int32_t pos;      // first token of the current KV tile
  int32_t end;      // end of the current KV range (exclusive)
  int32_t own_end;  // q1
  bool own;         // the current range is the query segment itself

  DUALKV_HOST_DEVICE void init(const int32_t* offsets, const int32_t* parent, int32_t s, int32_t q1) {
    seg = s;
    own_end = q1;
    const int32_t a = parent[s];
    if (a >= 0) {
      cur = a; pos = offsets[a]; end = offsets[a + 1]; own = false;
    } else {
      cur = s; pos = offsets[s]; end = q1; own = true;
    }
  }
  // Tokens of the current KV tile (BN but at the end of a range).
  DUALKV_HOST_DEVICE int32_t len() const { return end - pos < BN ? end - pos : BN; }
  // Advances to the next KV tile; false when every range is done.
  DUALKV_HOST_DEVICE bool next(const int32_t* offsets, const int32_t* parent) {
    pos += BN;
    if (pos < end) return true;
    if (own) return false;
    const int32_t a = parent[cur];
    if (a >= 0) {
      cur = a; pos = offsets[a]; end = offsets[a + 1];
    } else {
      cur = seg; pos = offsets[seg]; end = own_end; own = true;
    }
    return true;
  }
};

struct SegmentMask {
  // 1. The rule: query q (segment qs) sees key k (segment ks).
  DUALKV_HOST_DEVICE static bool visible(const ForestView& f, int32_t qs, int32_t q, int32_t ks, int32_t k) {
    return f.visible(qs, q, ks, k);
  }

  // 2. Trip counts of the backward: the queries that see a KV tile starting at token k0 of segment
  // s (all of them see every key of the tile at or before them: the only rule left inside the
  // range is k <= q).
  DUALKV_HOST_DEVICE static TokenRange bwd_query_range(const ForestView& f, int32_t s, int32_t k0) {
    return TokenRange{k0, f.subtree_token_end(s)};
  }

  // 3./4. Forward: the KV tile at kpos with klen valid rows of block_n (a tile of the KvWalk;
  // `own`: it lies in the query's segment) against query rows from q_first on. The kind's two
  // conditions are predicates of their own: kernels branch on them (as one uniform test per tile).
  DUALKV_HOST_DEVICE static bool fwd_ragged(int32_t klen, int32_t block_n) { return klen < block_n; }
  DUALKV_HOST_DEVICE static bool fwd_diagonal(int32_t kpos, bool own, int32_t q_first, int32_t block_n) {
    return own && kpos + block_n - 1 > q_first;
  }
  DUALKV_HOST_DEVICE static TileKind fwd_tile_kind(int32_t kpos, int32_t klen, bool own, int32_t q_first,
                                                   int32_t block_n) {
    if (fwd_ragged(klen, block_n)) return TileKind::kRagged;
    return fwd_diagonal(kpos, own, q_first, block_n) ? TileKind::kDiagonal : TileKind::kFull;
  }
  // Element (column col of that KV tile, query q) is hidden.
  DUALKV_HOST_DEVICE static bool fwd_hidden(int32_t kpos, int32_t klen, bool own, int32_t col, int32_t q) {
    return col >= klen || (own && kpos + col > q);
  }

  // 3./4. Backward: KV rows up to k_last of a tile against the query tile from q_first on (queries
  // of the tile's bwd_query_range). Ragged: some of the rows lie past the KV tile's end (a kernel
  // that loads whole tiles must hide them; one that zero-fills them need not).
  DUALKV_HOST_DEVICE static bool bwd_diagonal(int32_t k_last, int32_t q_first) { return q_first < k_last; }
  DUALKV_HOST_DEVICE static TileKind bwd_tile_kind(int32_t k_last, int32_t q_first, bool ragged) {
    if (ragged) return TileKind::kRagged;
    return bwd_diagonal(k_last, q_first) ? TileKind::kDiagonal : TileKind::kFull;
  }
  // Element (key k, query q) is hidden. k and q may be given relative to any common origin (kernels
  // keep one running offset per thread instead of two token indices).
  DUALKV_HOST_DEVICE static bool bwd_hidden(int32_t k, int32_t q) { return k > q; }
};

}  // namespace dualkv

#endif  // DUALKV_MASK_H_
