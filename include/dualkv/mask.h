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
//      full, nearest first, then its own segment up to the tile's last query; a tile of sibling
//      leaves walks its first segment's ancestors, then each sibling's tokens), and the query range
//      a backward KV tile is seen by (bwd_query_range: its own causal queries, then every
//      descendant's tokens, contiguous in DFS order). The planner sizes work with them; the kernels
//      walk them.
//   3. Tile kinds: for a (query tile, KV tile) pair, kFull (every pair visible: no masking),
//      kRagged (the KV tile runs past the end of its range) or kDiagonal (the tile crosses the
//      causal diagonal of the query's own segment). Uniform per tile, so kernels branch on it.
//   4. Apply: the per-element test inside a tile that is not kFull (fwd_hidden, bwd_hidden).
//
// The mask modifiers live here too (the C ABI's "mask modifiers" block):
//   - a sliding window on positions (PositionWindow): key k is also hidden from query q when
//     pos(q) - pos(k) >= W, positions along the root-to-leaf path, so a response token near its
//     start still sees the tail of its prompt, exactly as in the unpacked row;
//   - a logit softcap (softcap_score): scores become c * tanh(s / c) before masking;
//   - attention sinks (fold_sink, sink_probability): a per-head logit in each row's softmax
//     denominator.
// The window has its own parts 1-4 below (the *_in_window / window-taking overloads); the CPU
// backend uses them. They number a segment's keys as ForestView::keys_begin does, so an external
// prefix segment's rows (layout.h) are cut at their positions like any ancestor's tokens. The GPU
// kernels use the forest-rule parts (with external prefixes: KvWalk's prefixed walk,
// bwd_prefix_query_range), softcap (SoftcapFromExp), sinks (fold_sink, sink_probability) and the
// window (KvWalk's windowed walk, window_shift / window_tile / window_hidden; the planner's cut);
// docs/notes/2026-12-01-mask-modifiers-kernel-plan.md is the plan they followed.
// docs/adding_kernels.md lists the call sites of a new modifier.
#ifndef DUALKV_MASK_H_
#define DUALKV_MASK_H_

#include <math.h>
#include <stdint.h>

#include "dualkv/layout.h"

namespace dualkv {

enum class TileKind : int32_t {
  kFull = 0,      // every (query, key) pair of the tile pair is visible
  kRagged = 1,    // the KV tile runs past the end of its range: columns past it are hidden
  kDiagonal = 2,  // the tile pair crosses the causal diagonal of the query's segment
  kWindow = 3,    // the sliding window hides some pairs (and the diagonal none)
  kEmpty = 4,     // no pair is visible: the tile pair is skipped
};

// A half-open token range [begin, end).
struct TokenRange {
  int32_t begin;
  int32_t end;
};

// A sliding window on positions (transformers' `kv_idx > q_idx - sliding_window`): a key at
// distance pos(q) - pos(k) >= size from the query is hidden; size 0 is no window.
struct PositionWindow {
  int32_t size;

  DUALKV_HOST_DEVICE bool hides(int64_t distance) const { return size > 0 && distance >= size; }
  // The first position a query at position q_pos sees (below every position without a window).
  DUALKV_HOST_DEVICE int64_t first_position(int32_t q_pos) const {
    return size > 0 ? int64_t(q_pos) - size + 1 : int64_t(INT32_MIN);
  }
  // Keys r, the first at position begin_pos, less the prefix a query at q_pos does not see.
  DUALKV_HOST_DEVICE TokenRange cut(TokenRange r, int32_t begin_pos, int32_t q_pos) const {
    const int64_t first = int64_t(r.begin) + (first_position(q_pos) - begin_pos);
    if (first > r.begin) r.begin = first < r.end ? int32_t(first) : r.end;
    return r;
  }
};

// A key block against the query rows that see it, for the block-shaped parts of the policy
// (block_kind, row_keys): keys `keys` of one segment, the first at position k_pos; query rows from
// token q_first to q_last at positions q_pos_min..q_pos_max (rows may belong to several sibling
// segments, which share their ancestors' positions); `own`: the keys lie in the rows' own segment
// (then every row is in that segment), so the causal rule k <= q applies.
struct BlockPair {
  TokenRange keys;
  int32_t k_pos;
  int32_t q_first, q_last;
  int32_t q_pos_min, q_pos_max;
  bool own;

  DUALKV_HOST_DEVICE int32_t key_position(int32_t k) const { return k_pos + (k - keys.begin); }
};

// The KV ranges a forward query tile of segment `seg` (last query q1 - 1) sees, walked in tiles
// of BN tokens: the parent's tokens, its parent's, ... up to the root (full), then the segment's
// own tokens up to q1. A tile of sibling leaves (q1 past seg's end) walks its first segment's
// ancestors and then each sibling's tokens as an own range of its own (cur the sibling, end its
// last token + 1): every row meets its own keys in the same KV tiles, at the same columns, as in a
// tile of its segment alone, and the other siblings' ranges hide all its columns (fwd_hidden), so
// its arithmetic is the same bits whichever siblings share its tile. Host and device; the kernels
// keep one walk per query tile.
template <int BN>
struct KvWalk {
  int32_t seg;      // query segment (a tile of siblings: the first)
  int32_t cur;      // segment of the current KV range
  int32_t pos;      // first token of the current KV tile
  int32_t end;      // end of the current KV range (exclusive)
  int32_t own_end;  // q1
  bool own;         // the current range is the query segment itself (or one of the tile's siblings)
  bool prefix;      // the current range is an external segment's prefix rows (pos, end: rows of the
                    // prefix buffers, not tokens); only the walk with prefixes below sets and reads
                    // it (the plain walk leaves it alone: its kernels keep their code)

  DUALKV_HOST_DEVICE void init(const int32_t* offsets, const int32_t* parent, int32_t s, int32_t q1) {
    seg = s;
    own_end = q1;
    const int32_t a = parent[s];
    if (a >= 0) {
      cur = a; pos = offsets[a]; end = offsets[a + 1]; own = false;
    } else {
      enter_own(offsets, s);
    }
  }
  // Tokens of the current KV tile (BN but at the end of a range).
  DUALKV_HOST_DEVICE int32_t len() const { return end - pos < BN ? end - pos : BN; }
  // Keys of the current range from the tile's first on (len() at the range's last tile, more than
  // BN before it): the forward mask's `krem`, which also places the range's end.
  DUALKV_HOST_DEVICE int32_t rest() const { return end - pos; }
  // Advances to the next KV tile; false when every range is done.
  DUALKV_HOST_DEVICE bool next(const int32_t* offsets, const int32_t* parent) {
    pos += BN;
    if (pos < end) return true;
    if (own) return next_sibling(offsets);
    const int32_t a = parent[cur];
    if (a >= 0) {
      cur = a; pos = offsets[a]; end = offsets[a + 1];
    } else {
      enter_own(offsets, seg);
    }
    return true;
  }
  // After next() returned false on a walk init'ed up to e (a warpgroup's last row + 1, e < q1: the
  // sm90 forward's long-walk builds stop each warpgroup at its rows), the rest of the walk up to
  // q1: the tiles the walk init'ed up to q1 has after the last one walked (the same positions; the
  // last one walked may hold more keys in that walk). False if there are none.
  DUALKV_HOST_DEVICE bool resume(const int32_t* offsets, int32_t q1) {
    own_end = q1;
    const int32_t e = offsets[cur + 1];
    end = e < q1 ? e : q1;
    if (pos < end) return true;
    return next_sibling(offsets);
  }

 private:
  // The own range of segment s: its tokens up to q1.
  DUALKV_HOST_DEVICE void enter_own(const int32_t* offsets, int32_t s) {
    const int32_t e = offsets[s + 1];
    cur = s; pos = offsets[s]; end = e < own_end ? e : own_end; own = true;
  }
  // In a tile of siblings, the next sibling's own range; false at q1.
  DUALKV_HOST_DEVICE bool next_sibling(const int32_t* offsets) {
    if (end >= own_end) return false;
    enter_own(offsets, cur + 1);
    return true;
  }

 public:
  // ---- the same walk under a sliding window (issue 16; the forward kernels' windowed tiles) ----
  // `first_pos`: the first position the tile's first query q0 sees,
  // PositionWindow::first_position(pos(q0)) (every query of the tile sees at most the keys from
  // there on). Each range starts at SegmentMask::keys_in_window's begin for it, and the walk stops
  // at the first ancestor the window cuts entirely (every range above lies further back). The
  // struct's fields are those of the plain walk (the portable forward keeps two walks in shared
  // memory); the caller keeps first_pos. The planner's forward work (plan.cpp) is the sum of
  // len() over this walk's tiles.
  DUALKV_HOST_DEVICE void init_windowed(const int32_t* offsets, const int32_t* parent, const int32_t* position_offset,
                                        int32_t s, int32_t q1, int32_t first_pos) {
    seg = s;
    own_end = q1;
    if (!enter_ancestor_windowed(offsets, parent[s], position_offset, first_pos))
      enter_own_windowed(offsets, position_offset, first_pos);
  }
  DUALKV_HOST_DEVICE bool next_windowed(const int32_t* offsets, const int32_t* parent, const int32_t* position_offset,
                                        int32_t first_pos) {
    pos += BN;
    if (pos < end) return true;
    if (own) return false;
    if (!enter_ancestor_windowed(offsets, parent[cur], position_offset, first_pos))
      enter_own_windowed(offsets, position_offset, first_pos);
    return true;
  }
  // Segment a's tokens from the window's first position on, if a exists and the window leaves any.
  DUALKV_HOST_DEVICE bool enter_ancestor_windowed(const int32_t* offsets, int32_t a, const int32_t* position_offset,
                                                  int32_t first_pos) {
    if (a < 0) return false;
    const int32_t skip = first_pos - position_offset[a];
    const int32_t begin = skip > 0 ? offsets[a] + skip : offsets[a];
    if (skip > 0 && (skip >= offsets[a + 1] - offsets[a])) return false;
    cur = a; pos = begin; end = offsets[a + 1]; own = false;
    return true;
  }
  // The query segment's tokens from the window's first position up to own_end (never empty: the
  // first query sees itself). A windowed plan has no tiles of siblings (plan.cpp).
  DUALKV_HOST_DEVICE void enter_own_windowed(const int32_t* offsets, const int32_t* position_offset,
                                             int32_t first_pos) {
    const int32_t skip = first_pos - position_offset[seg];
    cur = seg; pos = skip > 0 ? offsets[seg] + skip : offsets[seg]; end = own_end; own = true;
  }

  // The same walk over a forest with external prefix segments (layout.h: seg_prefix[s] the prefix
  // segment s holds or -1, prefix_offsets the prefixes' rows): an external ancestor contributes its
  // prefix rows [prefix_offsets[e], prefix_offsets[e + 1]) instead of its (empty) token range, with
  // `prefix` set. An external segment is always a root, so it is the last ancestor the walk reaches
  // and is never the query segment itself (it has no tokens, so no query tile).
  DUALKV_HOST_DEVICE void init(const int32_t* offsets, const int32_t* parent, const int32_t* seg_prefix,
                               const int32_t* prefix_offsets, int32_t s, int32_t q1) {
    init(offsets, parent, s, q1);
    prefix = false;
    if (!own) enter_ancestor(offsets, seg_prefix, prefix_offsets, cur);
  }
  DUALKV_HOST_DEVICE bool next(const int32_t* offsets, const int32_t* parent, const int32_t* seg_prefix,
                               const int32_t* prefix_offsets) {
    pos += BN;
    if (pos < end) return true;
    if (own) return next_sibling(offsets);
    const int32_t a = parent[cur];
    if (a >= 0) {
      cur = a;
      enter_ancestor(offsets, seg_prefix, prefix_offsets, a);
    } else {
      enter_own(offsets, seg);
      prefix = false;
    }
    return true;
  }

 private:
  // The keys of ancestor a: its prefix rows when it is external, else its tokens.
  DUALKV_HOST_DEVICE void enter_ancestor(const int32_t* offsets, const int32_t* seg_prefix,
                                         const int32_t* prefix_offsets, int32_t a) {
    const int32_t e = seg_prefix[a];
    prefix = e >= 0;
    if (prefix) {
      pos = prefix_offsets[e]; end = prefix_offsets[e + 1];
    } else {
      pos = offsets[a]; end = offsets[a + 1];
    }
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
  // The queries that see the prefix rows of external segment x: every token of its subtree (it has
  // none of its own), each seeing every row, so no tile of the range is diagonal (the backward tile
  // kind is kFull, or kRagged at the prefix's last rows).
  DUALKV_HOST_DEVICE static TokenRange bwd_prefix_query_range(const ForestView& f, int32_t x) {
    return TokenRange{f.segment_begin(x), f.subtree_token_end(x)};
  }

  // 3./4. Forward: the KV tile at kpos (a tile of the KvWalk; `own`: it lies in an own range), with
  // krem keys left in its range from kpos on (KvWalk::rest(): the tile has min(krem, block_n) valid
  // keys and the range ends at kpos + krem), against query rows q_first .. q_last (rows up to the
  // tile's q1 - 1). The kind's conditions are predicates of their own: kernels branch on them (as
  // one uniform test per tile).
  //
  // A query tile of sibling leaves (the planner's packing of short leaves, plan_format.h): the tile
  // (seg, q0, q1) holds whole leaf segments seg, seg + 1, ... with one parent (or all roots), q1 past
  // seg's end. They share their ancestors, so the walk of seg serves every row; then each sibling's
  // own range (KvWalk), which the rows past its end (later siblings') do not see.
  DUALKV_HOST_DEVICE static bool fwd_packs_siblings(const int32_t* offsets, int32_t seg, int32_t q1) {
    return q1 > offsets[seg + 1];
  }
  DUALKV_HOST_DEVICE static bool fwd_ragged(int32_t krem, int32_t block_n) { return krem < block_n; }
  DUALKV_HOST_DEVICE static bool fwd_diagonal(int32_t kpos, int32_t krem, bool own, int32_t q_first, int32_t q_last,
                                              int32_t block_n) {
    return own && (kpos + block_n - 1 > q_first || q_last >= kpos + krem);
  }
  DUALKV_HOST_DEVICE static TileKind fwd_tile_kind(int32_t kpos, int32_t krem, bool own, int32_t q_first,
                                                   int32_t q_last, int32_t block_n) {
    if (fwd_ragged(krem, block_n)) return TileKind::kRagged;
    return fwd_diagonal(kpos, krem, own, q_first, q_last, block_n) ? TileKind::kDiagonal : TileKind::kFull;
  }
  // The columns of that KV tile query q sees are [0, fwd_visible_cols): each rule hides a suffix of
  // them (the range's end; in an own range the causal diagonal, and every column for a row past the
  // range's end, a later sibling's). Kernels take it once per row and tile, then one compare per
  // element (the three tests per element spilled 76-208 bytes in the D-128 forwards).
  DUALKV_HOST_DEVICE static int32_t fwd_visible_cols(int32_t kpos, int32_t krem, bool own, int32_t q) {
    if (!own) return krem;
    if (q >= kpos + krem) return 0;
    const int32_t diagonal = q - kpos + 1;
    return diagonal < krem ? diagonal : krem;
  }
  // Element (column col of that KV tile, query q) is hidden.
  DUALKV_HOST_DEVICE static bool fwd_hidden(int32_t kpos, int32_t krem, bool own, int32_t col, int32_t q) {
    return col >= fwd_visible_cols(kpos, krem, own, q);
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

  // ---- with a sliding window on positions ----

  // Keys are a segment's keys as ForestView::keys_begin/keys_end number them: its tokens, or an
  // external segment's prefix rows (seen like an ancestor's tokens, at their positions).

  // 1. The rule.
  DUALKV_HOST_DEVICE static bool visible(const ForestView& f, PositionWindow w, int32_t qs, int32_t q, int32_t ks,
                                         int32_t k) {
    return f.visible(qs, q, ks, k) && !w.hides(f.position(qs, q) - f.key_position(ks, k));
  }

  // 2. Trip counts. The keys of `keys` (keys of segment ks) that a query at position q_pos_min or
  // later may see: the window cuts a prefix off the range (empty when it cuts it all).
  DUALKV_HOST_DEVICE static TokenRange keys_in_window(const ForestView& f, PositionWindow w, int32_t ks,
                                                      TokenRange keys, int32_t q_pos_min) {
    return w.cut(keys, f.key_position(ks, keys.begin), q_pos_min);
  }
  // The queries that see keys [k0, k_last] of segment s: its own causal queries, then every
  // descendant's tokens (as bwd_query_range), unless the window closes within the segment itself:
  // then only the own queries up to k_last + W - 1 (descendants lie further along every path).
  // An external segment has no queries: its descendants' tokens, or none when the window closes
  // before the first of them (at the position after the prefix's last row).
  DUALKV_HOST_DEVICE static TokenRange bwd_query_range(const ForestView& f, PositionWindow w, int32_t s, int32_t k0,
                                                       int32_t k_last) {
    if (f.is_external(s)) {
      const int32_t first = f.segment_end(s);
      const bool closed = w.hides(int64_t(f.key_position(s, f.keys_end(s))) - f.key_position(s, k_last));
      return TokenRange{first, closed ? first : f.subtree_token_end(s)};
    }
    const int64_t last_seeing = int64_t(k_last) + (w.size > 0 ? w.size - 1 : int64_t(f.num_tokens));
    return TokenRange{k0, last_seeing < f.segment_end(s) - 1 ? int32_t(last_seeing + 1) : f.subtree_token_end(s)};
  }

  // The same, one query segment at a time, for a planner that cuts the descendants' part of that
  // range to the window (work items that never hold a pair the window hides in full): the tokens
  // of segment d (a descendant of the keys' segment) that see a key at position k_pos, a prefix of
  // d's tokens; empty when d starts past the window, and then so does every segment of d's subtree.
  DUALKV_HOST_DEVICE static TokenRange queries_in_window(const ForestView& f, PositionWindow w, int32_t d,
                                                         int32_t k_pos) {
    const int32_t begin = f.segment_begin(d), end = f.segment_end(d);
    if (w.size <= 0) return TokenRange{begin, end};
    const int64_t seeing = int64_t(k_pos) + w.size - f.position_offset[d];  // positions of d that see it
    return TokenRange{begin, seeing <= 0 ? begin : seeing >= end - begin ? end : begin + int32_t(seeing)};
  }
  // The distance of a query of segment qs to a key of segment ks in tokens: pos(q) - pos(k) =
  // (q - k) + window_bias(qs, ks); a work item of one query segment carries it for the apply step.
  DUALKV_HOST_DEVICE static int32_t window_bias(const ForestView& f, int32_t qs, int32_t ks) {
    return (f.position_offset[qs] - f.segment_begin(qs)) - (f.position_offset[ks] - f.keys_begin(ks));
  }

  // ---- the window in the CUDA kernels (issue 16): the same rule on token indices ----
  // A forward-style kernel's KV range of segment ks (from KvWalk: ks = walk.cur) against queries of
  // segment qs: pos(q) - pos(k) = (q - k) + shift, shift = window_bias on the raw layout arrays (the
  // kernels hold no ForestView; ks has tokens: a window with external prefixes is refused). The
  // backward items carry their shift as the plan's distance bias (plan_format.h).
  DUALKV_HOST_DEVICE static int32_t window_shift(const int32_t* offsets, const int32_t* position_offset, int32_t qs,
                                                 int32_t ks) {
    return (position_offset[qs] - offsets[qs]) - (position_offset[ks] - offsets[ks]);
  }
  // The first position the first query of a forward tile (token q0 of segment qs) sees: KvWalk's
  // init_windowed / next_windowed argument (clamped at 0, the first position of a root: the window
  // then cuts nothing, and the walk's int32 arithmetic stays in range for any W).
  DUALKV_HOST_DEVICE static int32_t window_first_position(const int32_t* offsets, const int32_t* position_offset,
                                                          int32_t qs, int32_t q0, int32_t w) {
    const int64_t first = PositionWindow{w}.first_position(position_offset[qs] + (q0 - offsets[qs]));
    return first > 0 ? int32_t(first) : 0;
  }
  // A tile's pairs need the window's apply when its farthest pair (last query, first key) is
  // hidden. q and k are token indices, or offsets from any common origin.
  DUALKV_HOST_DEVICE static bool window_tile(int32_t q_last, int32_t k_first, int32_t shift, int32_t w) {
    return (q_last - k_first) + shift >= w;
  }
  // Element (key k, query q) is hidden by the window (same conventions).
  DUALKV_HOST_DEVICE static bool window_hidden(int32_t k, int32_t q, int32_t shift, int32_t w) {
    return (q - k) + shift >= w;
  }

  // 3. Tile kinds of a key block against query rows (BlockPair), for any tile shape.
  DUALKV_HOST_DEVICE static TileKind block_kind(const BlockPair& b, PositionWindow w) {
    const int32_t k_last = b.keys.end - 1;
    if ((b.own && b.keys.begin > b.q_last) || w.hides(b.q_pos_min - b.key_position(k_last))) return TileKind::kEmpty;
    if (b.own && k_last > b.q_first) return TileKind::kDiagonal;
    return w.hides(b.q_pos_max - b.k_pos) ? TileKind::kWindow : TileKind::kFull;
  }

  // 4. Apply, one query row at a time: the keys of the block that query q (at position q_pos) sees,
  // a sub-range of b.keys: the window hides a prefix, the causal rule (own segment) a suffix.
  DUALKV_HOST_DEVICE static TokenRange row_keys(const BlockPair& b, PositionWindow w, int32_t q, int32_t q_pos) {
    TokenRange r{b.keys.begin, b.own && q + 1 < b.keys.end ? q + 1 : b.keys.end};
    if (r.end < r.begin) r.end = r.begin;  // a row before the block's first key sees none of it
    return w.cut(r, b.k_pos, q_pos);
  }
};

// ---- score modifiers: the same formula on every backend (F = float or double) ----

// The logit softcap c * tanh(s / c) (Gemma-2), applied to the scaled scores before masking.
template <typename F>
DUALKV_HOST_DEVICE F softcap_score(F s, F c) {
  return c * tanh(s / c);
}
// Its derivative at a capped score t = c * tanh(s / c): 1 - tanh^2 = 1 - (t / c)^2.
template <typename F>
DUALKV_HOST_DEVICE F softcap_grad(F capped, F c) {
  const F t = capped / c;
  return F(1) - t * t;
}

// The kernels' fp32 form of both, from e = exp(2 s / c) (which they get as one exp2 of the raw
// dot product times 2 log2(e) scale / c): tanh(s / c) = 1 - 2 / (e + 1). The kernels are built
// with fast math, where tanhf becomes the hardware's approximate tanh (relative error ~2^-11: a
// logit capped at 50 would move by ~0.02); this form keeps the capped score's absolute error at
// fp32 rounding (times c), and is exact at both ends (e = 0: -1; e = inf: 1).
struct SoftcapFromExp {
  float t;  // tanh(s / c)
  DUALKV_HOST_DEVICE explicit SoftcapFromExp(float e) : t(1.f - 2.f / (e + 1.f)) {}
  DUALKV_HOST_DEVICE float score(float c) const { return c * t; }  // softcap_score
  DUALKV_HOST_DEVICE float grad() const { return 1.f - t * t; }    // softcap_grad
};

// A sink logit (gpt-oss) folded into a row's softmax: one more key, of value zero, in the online
// softmax. The row's visible scores have maximum row_max and sum_j exp(s_j - row_max) = row_sum;
// both are updated to include the sink (the row's lse is then row_max + log(row_sum)), and the
// factor its accumulated output must be rescaled by is returned. A sink of -infinity changes
// nothing (factor 1, sum unchanged).
template <typename F>
DUALKV_HOST_DEVICE F fold_sink(F& row_max, F& row_sum, F sink) {
  const F m = row_max > sink ? row_max : sink;
  const F rescale = exp(row_max - m);
  row_sum = row_sum * rescale + exp(sink - m);
  row_max = m;
  return rescale;
}
// The sink's share of a row's softmax, exp(sink - lse): d lse / d sink, and with the row's
// delta = rowsum(dO * O) - dlse, the row's term of d loss / d sink is -sink_probability * delta.
template <typename F>
DUALKV_HOST_DEVICE F sink_probability(F sink, F lse) {
  return exp(sink - lse);
}

}  // namespace dualkv

#endif  // DUALKV_MASK_H_
