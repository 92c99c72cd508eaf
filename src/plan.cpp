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

uint64_t key_hash(int head_dim, int32_t S, int32_t T, int32_t num_prefixes, int32_t prefix_rows) {
  const PlanTiles ts = plan_tiles(head_dim);
  uint64_t h = mix64(static_cast<uint64_t>(kPlanVersion) << 48 | static_cast<uint64_t>(head_dim) << 32 |
                     static_cast<uint64_t>(ts.fwd_block_m) << 16 | static_cast<uint64_t>(ts.bwd_block_n));
  h = mix64(h ^ (static_cast<uint64_t>(ts.bwd_block_m) << 40) ^ static_cast<uint64_t>(static_cast<uint32_t>(S)));
  h = mix64(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(T)) << 7));
  h = mix64(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(num_prefixes)) << 32 |
                 static_cast<uint64_t>(static_cast<uint32_t>(prefix_rows))));
  return h >> kPlanSlotBits;
}

dualkv_status build(const dualkv_layout& l, const dualkv_prefixes* prefixes, int head_dim, int num_sms, Plan* out) {
  const PlanTiles ts = plan_tiles(head_dim);
  const dualkv_prefixes none{0, 0, nullptr, nullptr};
  const dualkv_prefixes& px = prefixes != nullptr ? *prefixes : none;
  const ForestView f = make_forest_view(l, px);
  const int32_t S = l.num_segments, T = l.num_tokens;
  const int32_t* off = l.seg_offsets;
  std::vector<int32_t> root(S);
  for (int32_t s = 0; s < S; ++s) root[s] = l.seg_parent[s] < 0 ? s : root[l.seg_parent[s]];

  // Forward query tiles; work = the keys the tile's last query sees.
  struct Fwd { int32_t s, q0, q1, work; };
  std::vector<Fwd> fwd;
  for (int32_t s = 0; s < S; ++s)
    for (int32_t q0 = off[s]; q0 < off[s + 1]; q0 += ts.fwd_block_m) {
      const int32_t q1 = std::min(q0 + ts.fwd_block_m, off[s + 1]);
      fwd.push_back({s, q0, q1, f.num_visible_keys(s, q1 - 1)});
    }
  std::stable_sort(fwd.begin(), fwd.end(), [&](const Fwd& a, const Fwd& b) {
    if (a.work != b.work) return a.work > b.work;
    if (root[a.s] != root[b.s]) return root[a.s] < root[b.s];
    const int32_t ra = a.q0 - off[a.s], rb = b.q0 - off[b.s];
    if (ra != rb) return ra < rb;
    return a.s < b.s;
  });

  // Backward KV tiles and the query range that sees each (SegmentMask::bwd_query_range); an external
  // segment's tiles are of its prefix rows, seen by its whole subtree (bwd_prefix_query_range).
  struct Kv { int32_t s, k0, k1, qbegin, qend; };
  std::vector<Kv> kv;
  int64_t total = 0;
  for (int32_t s = 0; s < S; ++s) {
    if (f.is_external(s)) {
      const TokenRange r = SegmentMask::bwd_prefix_query_range(f, s);
      if (r.end <= r.begin) continue;  // a prefix no token sees gets no gradient (its rows stay as they are)
      for (int32_t k0 = f.prefix_begin(s); k0 < f.prefix_end(s); k0 += ts.bwd_block_n) {
        kv.push_back({s, k0, std::min(k0 + ts.bwd_block_n, f.prefix_end(s)), r.begin, r.end});
        total += r.end - r.begin;
      }
      continue;
    }
    for (int32_t k0 = off[s]; k0 < off[s + 1]; k0 += ts.bwd_block_n) {
      const TokenRange r = SegmentMask::bwd_query_range(f, s, k0);
      kv.push_back({s, k0, std::min(k0 + ts.bwd_block_n, off[s + 1]), r.begin, r.end});
      total += r.end - r.begin;
    }
  }
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
      const int64_t n = (t.qend - t.qbegin + split - 1) / split;
      if (n > 1) slots += n;
    }
    if (slots <= static_cast<int64_t>(kPlanSlotMask)) break;
    split *= 2;
  }

  struct Bwd { int32_t s, k0, k1, qa, qb, slot; };
  struct Red { int32_t s, k0, k1, slot0, n; };
  std::vector<Bwd> bwd;
  std::vector<Red> red;
  int32_t n_slots = 0;
  for (const Kv& t : kv) {
    const int64_t len = t.qend - t.qbegin;
    const int32_t n = static_cast<int32_t>((len + split - 1) / split);
    if (n == 1) {
      bwd.push_back({t.s, t.k0, t.k1, t.qbegin, t.qend, -1});
    } else {
      red.push_back({t.s, t.k0, t.k1, n_slots, n});
      for (int32_t i = 0; i < n; ++i) {
        const int32_t qa = static_cast<int32_t>(t.qbegin + i * split);
        const int32_t qb = static_cast<int32_t>(std::min<int64_t>(qa + split, t.qend));
        bwd.push_back({t.s, t.k0, t.k1, qa, qb, n_slots + i});
      }
      n_slots += n;
    }
  }
  std::stable_sort(bwd.begin(), bwd.end(), [&](const Bwd& a, const Bwd& b) {
    const int32_t wa = a.qb - a.qa, wb = b.qb - b.qa;
    if (wa != wb) return wa > wb;
    if (root[a.s] != root[b.s]) return root[a.s] < root[b.s];
    return a.k0 != b.k0 ? a.k0 < b.k0 : a.qa < b.qa;
  });

  const int64_t fwd_off = kHeaderInts;
  const int64_t bwd_off = fwd_off + static_cast<int64_t>(fwd.size()) * kFwdItemInts;
  const int64_t red_off = bwd_off + static_cast<int64_t>(bwd.size()) * kBwdItemInts;
  const int64_t total_len = red_off + static_cast<int64_t>(red.size()) * kRedItemInts;
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
  for (size_t i = 0; i < fwd.size(); ++i) {
    int32_t* p = &d[fwd_off + i * kFwdItemInts];
    p[0] = fwd[i].s; p[1] = fwd[i].q0; p[2] = fwd[i].q1; p[3] = fwd[i].work;
  }
  for (size_t i = 0; i < bwd.size(); ++i) {
    int32_t* p = &d[bwd_off + i * kBwdItemInts];
    p[0] = bwd[i].s; p[1] = bwd[i].k0; p[2] = bwd[i].k1; p[3] = bwd[i].qa; p[4] = bwd[i].qb; p[5] = bwd[i].slot;
  }
  for (size_t i = 0; i < red.size(); ++i) {
    int32_t* p = &d[red_off + i * kRedItemInts];
    p[0] = red[i].s; p[1] = red[i].k0; p[2] = red[i].k1; p[3] = red[i].slot0; p[4] = red[i].n; p[5] = 0;
  }
  out->key = (key_hash(head_dim, S, T, px.num_prefixes, px.num_prefixes > 0 ? px.num_prefix_rows : 0) << kPlanSlotBits) | static_cast<uint64_t>(n_slots);
  out->split_rows = static_cast<int32_t>(std::min<int64_t>(split, INT32_MAX));
  return DUALKV_OK;
}

}  // namespace dualkv::plan
