// The host planner (plan.h): forward query tiles, backward KV items with their query ranges and
// splits, split reductions; each list sorted longest-work-first.
#include "plan.h"

#include <algorithm>
#include <climits>
#include <cstdlib>

#include "dualkv/layout.h"
#include "dualkv/mask.h"
#include "internal.h"
#include "tile_size.h"

namespace dualkv::plan {

namespace {

uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t key_hash(int head_dim, int fwd_tile_rows, int32_t S, int32_t T, int32_t window, int32_t num_prefixes,
                  int32_t prefix_rows) {
  const PlanTiles ts = plan_tiles(head_dim);
  uint64_t h = mix64(static_cast<uint64_t>(kPlanVersion) << 48 | static_cast<uint64_t>(head_dim) << 32 |
                     static_cast<uint64_t>(fwd_tile_rows) << 16 | static_cast<uint64_t>(ts.bwd_block_n));
  h = mix64(h ^ (static_cast<uint64_t>(ts.bwd_block_m) << 40) ^ static_cast<uint64_t>(static_cast<uint32_t>(S)));
  h = mix64(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(T)) << 7));
  h = mix64(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(num_prefixes)) << 32 |
                 static_cast<uint64_t>(static_cast<uint32_t>(prefix_rows))));
  h = mix64(h ^ static_cast<uint64_t>(static_cast<uint32_t>(window)));
  return h >> kPlanKeyLowBits;
}

namespace {

// The keys a forward query tile of segment s (rows q0 .. q1 - 1) walks under window w: per range
// (the parent's, its parent's, ..., then its own up to q1) the part SegmentMask::keys_in_window
// leaves for its first query, up to the first ancestor the window cuts entirely (every range above
// lies further back).
int32_t fwd_work(const ForestView& f, PositionWindow w, int32_t s, int32_t q0, int32_t q1) {
  if (w.size <= 0) return f.num_visible_keys(s, q1 - 1);
  const int32_t q_pos = f.position(s, q0);
  int32_t work = 0;
  const TokenRange own = SegmentMask::keys_in_window(f, w, s, TokenRange{f.segment_begin(s), q1}, q_pos);
  work += own.end - own.begin;
  for (int32_t a = f.parent[s]; a >= 0; a = f.parent[a]) {
    const TokenRange r = SegmentMask::keys_in_window(f, w, a, TokenRange{f.keys_begin(a), f.keys_end(a)}, q_pos);
    if (r.begin >= r.end) break;
    work += r.end - r.begin;
  }
  return work;
}

// A contiguous query range that sees a KV tile, with the distance bias of its pairs (plan_format.h).
struct QueryRange {
  int32_t qa, qb, bias;
};

// The query ranges of the KV tile [k0, k1) of segment s under window w (plan_format.h): the whole
// range of SegmentMask::bwd_query_range when the window hides none of its pairs, else the own
// segment's part and each descendant's, cut to the window.
void bwd_ranges(const ForestView& f, PositionWindow w, int32_t s, int32_t k0, int32_t k1,
                std::vector<QueryRange>* out) {
  out->clear();
  const TokenRange all = SegmentMask::bwd_query_range(f, s, k0);
  if (w.size <= 0) {
    out->push_back({all.begin, all.end, 0});
    return;
  }
  const int32_t k_last = k1 - 1, k_pos = f.key_position(s, k_last);
  // The farthest pair of the whole range: its last query against the tile's first key (positions
  // only grow along a path, so every descendant's last token is at most its subtree's largest).
  int64_t farthest = int64_t(f.position(s, all.end - 1 < f.segment_end(s) ? all.end - 1 : f.segment_end(s) - 1));
  for (int32_t d = s + 1; d < f.subtree_end[s]; ++d)
    if (f.segment_length(d) > 0) farthest = std::max<int64_t>(farthest, f.position(d, f.segment_end(d) - 1));
  if (farthest - f.key_position(s, k0) < w.size) {
    out->push_back({all.begin, all.end, -f.num_tokens});
    return;
  }
  const TokenRange own = SegmentMask::bwd_query_range(f, w, s, k0, k_last);
  out->push_back({own.begin, std::min(own.end, f.segment_end(s)), 0});
  if (own.end <= f.segment_end(s)) return;  // the window closes within the segment
  for (int32_t d = s + 1; d < f.subtree_end[s];) {
    const TokenRange r = SegmentMask::queries_in_window(f, w, d, k_pos);
    if (f.position_offset[d] - int64_t(k_pos) >= w.size) {  // d starts past the window: so does its subtree
      d = f.subtree_end[d];
      continue;
    }
    if (r.end > r.begin) out->push_back({r.begin, r.end, SegmentMask::window_bias(f, d, s)});
    ++d;
  }
}

// The backward order of a plan cut to a sliding window (issue 16; plan_format.h). Longest-first
// alone, as without a window, runs together items of equal length, which under a window are the
// same KV-tile offset of different segments (tile j of every response of a group): items that
// share no query rows, so every Q, dO and dQ tile is fetched from HBM again by each of the ~W /
// BN + 1 KV tiles that see it (docs/notes/2026-12-02-window-bwd.md: the modelled L2 misses per
// step drop from 0.87 to 0.25 for a prompt of 4096 and 16 responses of 1024 under W = 1024 with
// 8 KV heads). The windowed order:
//   1. items longer than any window-cut range (`windowed_max` rows: pieces of a range the window
//      hides nothing of, up to the split length) first, longest first: they are the long poles;
//   2. the others in token order of their query range (qa, then k0), so that the CTAs running at
//      once hold the KV tiles that see the same query rows (a GRPO response and the prompt tiles
//      whose window reaches into it): their Q / dO / dQ stay in L2 between them;
//   3. but the last of those, num_sms * (longest of 2) / kTailKvHeads rows of them, by length
//      class (eighths of the longest, descending), then in token order: the schedule ends on short
//      items, which fill the CTAs the long ones leave idle (the balance longest-first gives).
// The order moves no work between items: the items, their slots and the reduction are those of
// any other order.
template <typename Item, typename LongestFirst>
void order_windowed_items(std::vector<Item>& items, int32_t windowed_max, int num_sms, LongestFirst longest_first) {
  // Kernels take Hk items per work entry (one per KV head); the plan is built without the head
  // counts, so the tail is sized for 4 KV heads, a compromise over the 2 - 8 of common GQA models:
  // fewer heads want a longer tail (balance), more a shorter one (L2); the note models both.
  constexpr int64_t kTailKvHeads = 4;
  constexpr int64_t kTailClasses = 8;
  auto len = [](const Item& b) { return static_cast<int64_t>(b.qb) - b.qa; };
  auto token_order = [](const Item& a, const Item& b) { return a.qa != b.qa ? a.qa < b.qa : a.k0 < b.k0; };
  const auto mid = std::stable_partition(items.begin(), items.end(),
                                         [&](const Item& b) { return len(b) > windowed_max; });
  std::stable_sort(items.begin(), mid, longest_first);
  std::stable_sort(mid, items.end(), token_order);
  int64_t longest = 0;
  for (auto it = mid; it != items.end(); ++it) longest = std::max(longest, len(*it));
  if (longest == 0) return;
  const int64_t tail_rows = static_cast<int64_t>(std::max(num_sms, 1)) * longest / kTailKvHeads;
  auto tail = items.end();
  for (int64_t rows = 0; tail != mid && rows < tail_rows;) rows += len(*--tail);
  auto size_class = [&](const Item& b) { return (len(b) * kTailClasses + longest - 1) / longest; };
  std::stable_sort(tail, items.end(), [&](const Item& a, const Item& b) {
    const int64_t ca = size_class(a), cb = size_class(b);
    return ca != cb ? ca > cb : token_order(a, b);
  });
}

}  // namespace

dualkv_status build(const dualkv_layout& l, const dualkv_prefixes* prefixes, int head_dim, TileFamily family,
                    int32_t window, int num_sms, Plan* out) {
  const PlanTiles ts = plan_tiles(head_dim);
  const int32_t fwd_m = fwd_block_m(head_dim, family, window > 0);
  const dualkv_prefixes none{0, 0, nullptr, nullptr};
  const dualkv_prefixes& px = prefixes != nullptr ? *prefixes : none;
  if (window > 0 && px.num_prefixes > 0)
    return detail::fail(DUALKV_ERROR_UNSUPPORTED,
                        "plan: a sliding window (%d) over a forest with external prefix segments is not "
                        "supported by the CUDA plan yet",
                        window);
  const ForestView f = make_forest_view(l, px);
  const PositionWindow w{window};
  const int32_t S = l.num_segments, T = l.num_tokens;
  const int32_t* off = l.seg_offsets;
  std::vector<int32_t> root(S);
  for (int32_t s = 0; s < S; ++s) root[s] = l.seg_parent[s] < 0 ? s : root[l.seg_parent[s]];

  // Forward query tiles; work = the keys the tile walks (for its last query). Short leaves with one
  // parent (or short roots) that follow each other share a tile, whole, up to fwd_m rows:
  // they share every ancestor, so the tile walks the ancestors once for all of them (a tile per
  // leaf walked them once per leaf: N responses of a few tokens each cost N walks of the prompt),
  // then each sibling's tokens as an own range (KvWalk), which the other siblings' rows do not see:
  // a row's arithmetic is the same as in a tile of its segment alone. Not under a window: the
  // siblings' rows share no window cut.
  struct Fwd { int32_t s, q0, q1, work; };
  std::vector<Fwd> fwd;
  auto packable = [&](int32_t s) {
    return w.size <= 0 && l.seg_subtree_end[s] == s + 1 && !f.is_external(s) && off[s + 1] - off[s] < fwd_m;
  };
  for (int32_t s = 0; s < S;) {
    if (packable(s)) {
      int32_t t = s + 1;
      while (t < S && packable(t) && l.seg_parent[t] == l.seg_parent[s] && off[t + 1] - off[s] <= fwd_m) ++t;
      fwd.push_back({s, off[s], off[t], fwd_work(f, w, s, off[s], off[t])});
      s = t;
      continue;
    }
    for (int32_t q0 = off[s]; q0 < off[s + 1]; q0 += fwd_m) {
      const int32_t q1 = std::min(q0 + fwd_m, off[s + 1]);
      fwd.push_back({s, q0, q1, fwd_work(f, w, s, q0, q1)});
    }
    ++s;
  }
  // Whether the forward's KV walks are long (tile_size.h fwd_long_kv_walks; the key's long-walk bit).
  // DUALKV_CUDA_LONG_WALK_KEYS moves the threshold (tests: 0 makes every walk long, a huge value none).
  int64_t fwd_rows = 0, fwd_row_keys = 0;
  for (const Fwd& it : fwd) {
    fwd_rows += it.q1 - it.q0;
    fwd_row_keys += static_cast<int64_t>(it.work) * (it.q1 - it.q0);
  }
  int64_t long_walk_keys = fwd_long_walk_keys(head_dim);
  if (const char* env = std::getenv("DUALKV_CUDA_LONG_WALK_KEYS")) {  // a count >= 0, else ignored
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    if (end != env && *end == '\0' && v >= 0) long_walk_keys = v;
  }
  const bool long_walks = fwd_long_kv_walks(fwd_row_keys, fwd_rows, long_walk_keys);
  // Whether the forward's query tiles are ragged (tile_size.h fwd_ragged_tiles; the key's ragged-tiles bit).
  const bool ragged_tiles = fwd_ragged_tiles(fwd_rows, static_cast<int64_t>(fwd.size()), fwd_m);
  std::stable_sort(fwd.begin(), fwd.end(), [&](const Fwd& a, const Fwd& b) {
    if (a.work != b.work) return a.work > b.work;
    if (root[a.s] != root[b.s]) return root[a.s] < root[b.s];
    const int32_t ra = a.q0 - off[a.s], rb = b.q0 - off[b.s];
    if (ra != rb) return ra < rb;
    return a.s < b.s;
  });

  // Backward KV tiles and the query ranges that see each (SegmentMask::bwd_query_range; with a
  // window, bwd_ranges): ranges [first, last) of `ranges`. An external segment's tiles are of its
  // prefix rows, seen by its whole subtree (bwd_prefix_query_range; no window: build refuses both).
  struct Kv { int32_t s, k0, k1, first, last; };
  std::vector<Kv> kv;
  std::vector<QueryRange> ranges, tile_ranges;
  int64_t total = 0;
  for (int32_t s = 0; s < S; ++s) {
    if (f.is_external(s)) {
      const TokenRange r = SegmentMask::bwd_prefix_query_range(f, s);
      if (r.end <= r.begin) continue;  // a prefix no token sees gets no gradient (its rows stay as they are)
      for (int32_t k0 = f.prefix_begin(s); k0 < f.prefix_end(s); k0 += ts.bwd_block_n) {
        kv.push_back({s, k0, std::min(k0 + ts.bwd_block_n, f.prefix_end(s)), static_cast<int32_t>(ranges.size()),
                      static_cast<int32_t>(ranges.size() + 1)});
        ranges.push_back({r.begin, r.end, 0});
        total += r.end - r.begin;
      }
      continue;
    }
    for (int32_t k0 = off[s]; k0 < off[s + 1]; k0 += ts.bwd_block_n) {
      const int32_t k1 = std::min(k0 + ts.bwd_block_n, off[s + 1]);
      bwd_ranges(f, w, s, k0, k1, &tile_ranges);
      kv.push_back({s, k0, k1, static_cast<int32_t>(ranges.size()),
                    static_cast<int32_t>(ranges.size() + tile_ranges.size())});
      for (const QueryRange& r : tile_ranges) {
        ranges.push_back(r);
        total += r.qb - r.qa;
      }
    }
  }
  // Items of a range of len rows at split length `split`.
  auto pieces = [](int64_t len, int64_t split) { return static_cast<int32_t>((len + split - 1) / split); };
  // Split length: ranges longer than this are cut into several work items (fp32 partials reduced
  // in a fixed order).
  int64_t split = std::max<int64_t>(8192, (total + num_sms - 1) / std::max(num_sms, 1));
  if (const char* env = std::getenv("DUALKV_CUDA_SPLIT_ROWS")) {
    const long long v = std::atoll(env);
    if (v > 0) split = v;
  }
  split = (split + ts.bwd_block_m - 1) / ts.bwd_block_m * ts.bwd_block_m;
  // Keep the slot count encodable in the key.
  while (true) {
    int64_t slots = 0;
    for (const Kv& t : kv) {
      int64_t n = 0;
      for (int32_t i = t.first; i < t.last; ++i) n += pieces(ranges[i].qb - ranges[i].qa, split);
      if (n > 1) slots += n;
    }
    if (slots <= static_cast<int64_t>(kPlanSlotMask)) break;
    // Past `total` rows every range is one piece: the slots left are of KV tiles seen by several
    // window-cut ranges, which no split length merges (doubling on would overflow).
    if (split >= total)
      return detail::fail(DUALKV_ERROR_UNSUPPORTED,
                          "plan: %lld split slots (partial sums of KV tiles seen by several query ranges under the "
                          "window) exceed the plan key's %llu; split the batch",
                          static_cast<long long>(slots), static_cast<unsigned long long>(kPlanSlotMask));
    split *= 2;
  }

  struct Bwd { int32_t s, k0, k1, qa, qb, slot, bias; };
  struct Red { int32_t s, k0, k1, slot0, n; };
  std::vector<Bwd> bwd;
  std::vector<Red> red;
  int32_t n_slots = 0;
  for (const Kv& t : kv) {
    int32_t n = 0;
    for (int32_t i = t.first; i < t.last; ++i) n += pieces(ranges[i].qb - ranges[i].qa, split);
    if (n == 1) {
      const QueryRange& r = ranges[t.first];
      bwd.push_back({t.s, t.k0, t.k1, r.qa, r.qb, -1, r.bias});
    } else {
      // Slots in range order, each range's pieces in query order: the reduction's fixed order.
      red.push_back({t.s, t.k0, t.k1, n_slots, n});
      for (int32_t i = t.first; i < t.last; ++i) {
        const QueryRange& r = ranges[i];
        for (int64_t qa = r.qa; qa < r.qb; qa += split) {
          const int32_t qb = static_cast<int32_t>(std::min<int64_t>(qa + split, r.qb));
          bwd.push_back({t.s, t.k0, t.k1, static_cast<int32_t>(qa), qb, n_slots++, r.bias});
        }
      }
    }
  }
  auto longest_first = [&](const Bwd& a, const Bwd& b) {
    const int32_t wa = a.qb - a.qa, wb = b.qb - b.qa;
    if (wa != wb) return wa > wb;
    if (root[a.s] != root[b.s]) return root[a.s] < root[b.s];
    return a.k0 != b.k0 ? a.k0 < b.k0 : a.qa < b.qa;
  };
  if (w.size <= 0) {
    // One segment's items run together: segments by their longest item, longest first, then each
    // segment's items longest first. A segment's KV tiles see nested ranges of the same queries
    // (its own from k0 on, then its subtree), so the items running at once share their query rows
    // in L2. The global longest-first order interleaved equal-length items of different segments:
    // on long responses under a short prompt (rho ~ 1) the backward ran at 0.74x FA4 dense's rate.
    std::vector<int32_t> seg_longest(S, 0);
    for (const Bwd& b : bwd) seg_longest[b.s] = std::max(seg_longest[b.s], b.qb - b.qa);
    std::stable_sort(bwd.begin(), bwd.end(), [&](const Bwd& a, const Bwd& b) {
      if (a.s == b.s) return longest_first(a, b);
      if (seg_longest[a.s] != seg_longest[b.s]) return seg_longest[a.s] > seg_longest[b.s];
      return a.s < b.s;
    });
  } else {
    order_windowed_items(bwd, w.size + ts.bwd_block_n - 1, num_sms, longest_first);
  }

  const int64_t fwd_off = kHeaderInts;
  const int64_t bwd_off = fwd_off + static_cast<int64_t>(fwd.size()) * kFwdItemInts;
  const int64_t red_off = bwd_off + static_cast<int64_t>(bwd.size()) * kBwdItemInts;
  const int64_t bias_off = red_off + static_cast<int64_t>(red.size()) * kRedItemInts;
  const int64_t total_len = bias_off + (w.size > 0 ? static_cast<int64_t>(bwd.size()) : 0);
  if (total_len > INT32_MAX)
    return detail::fail(DUALKV_ERROR_UNSUPPORTED, "plan: layout too large for an int32 work plan");
  std::vector<int32_t>& d = out->data;
  d.assign(static_cast<size_t>(total_len), 0);
  d[kHdrMagic] = kPlanMagic;
  d[kHdrVersion] = kPlanVersion;
  d[kHdrS] = S;
  d[kHdrT] = T;
  d[kHdrNumFwd] = static_cast<int32_t>(fwd.size());
  d[kHdrNumBwd] = static_cast<int32_t>(bwd.size());
  d[kHdrNumRed] = static_cast<int32_t>(red.size());
  d[kHdrNumSlots] = n_slots;
  d[kHdrFwdOffset] = static_cast<int32_t>(fwd_off);
  d[kHdrBwdOffset] = static_cast<int32_t>(bwd_off);
  d[kHdrRedOffset] = static_cast<int32_t>(red_off);
  d[kHdrTotalLen] = static_cast<int32_t>(total_len);
  d[kHdrHeadDim] = head_dim;
  d[kHdrWindow] = w.size > 0 ? w.size : 0;
  d[kHdrBwdBiasOffset] = w.size > 0 ? static_cast<int32_t>(bias_off) : 0;
  for (size_t i = 0; i < fwd.size(); ++i) {
    int32_t* p = &d[fwd_off + i * kFwdItemInts];
    p[0] = fwd[i].s; p[1] = fwd[i].q0; p[2] = fwd[i].q1; p[3] = fwd[i].work;
  }
  for (size_t i = 0; i < bwd.size(); ++i) {
    int32_t* p = &d[bwd_off + i * kBwdItemInts];
    p[0] = bwd[i].s; p[1] = bwd[i].k0; p[2] = bwd[i].k1; p[3] = bwd[i].qa; p[4] = bwd[i].qb; p[5] = bwd[i].slot;
    if (w.size > 0) d[bias_off + i] = bwd[i].bias;
  }
  for (size_t i = 0; i < red.size(); ++i) {
    int32_t* p = &d[red_off + i * kRedItemInts];
    p[0] = red[i].s; p[1] = red[i].k0; p[2] = red[i].k1; p[3] = red[i].slot0; p[4] = red[i].n; p[5] = 0;
  }
  out->key = (key_hash(head_dim, fwd_m, S, T, w.size > 0 ? w.size : 0, px.num_prefixes,
                       px.num_prefixes > 0 ? px.num_prefix_rows : 0) << kPlanKeyLowBits) |
             (long_walks ? kPlanLongWalksBit : 0) | (ragged_tiles ? kPlanRaggedTilesBit : 0) |
             static_cast<uint64_t>(n_slots);
  out->split_rows = static_cast<int32_t>(std::min<int64_t>(split, INT32_MAX));
  return DUALKV_OK;
}

}  // namespace dualkv::plan
