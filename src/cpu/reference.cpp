// The fp64 reference of the CPU backend (float64 inputs, DUALKV_FLAG_ACCUMULATE_FP64): the
// attention the GPU kernels and the blocked path are judged against, written to be obviously
// right rather than fast:
// - operands are first converted to contiguous fp64 arrays ([heads][T][D]);
// - the forward is query-outer: each query row computes its scores over the key ranges it sees
//   (every proper ancestor segment, then its own segment up to itself, each cut to the window by
//   the mask policy), softcapped, and its lse over them and the head's sink; the keys of an
//   external prefix segment are rows of the prefix buffers;
// - the backward recomputes probabilities from the forward's lse, in two passes: query-outer
//   for dq, key-outer for dk/dv (and the prefix rows' gradients, added to prefix_dk/prefix_dv);
//   the sinks' gradient comes from lse and delta. Every output element is written by exactly one
//   work item in a fixed order, so results are deterministic whatever the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/backends.h"
#include "cpu/convert.h"
#include "cpu/parallel.h"
#include "dualkv/layout.h"
#include "dualkv/mask.h"

namespace dualkv::detail::cpu {
namespace {

// A strided [T, heads, D] operand converted to a contiguous [heads][T][D] array.
std::vector<double> gather(const void* base, int32_t dtype, int64_t T, int64_t heads, int64_t D,
                           int64_t token_stride, int64_t head_stride) {
  std::vector<double> out(static_cast<size_t>(heads * T * D));
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t t = 0; t < T; ++t) {
      double* row = &out[static_cast<size_t>((h * T + t) * D)];
      const int64_t src = t * token_stride + h * head_stride;
      for (int64_t d = 0; d < D; ++d) row[d] = load_element<double>(base, src + d, dtype);
    }
  return out;
}

// Keys of one segment: tokens, or an external segment's prefix rows (ForestView::keys_begin).
struct KeyRange {
  int32_t segment;
  TokenRange keys;
};

// Key ranges of s's proper ancestors, root first.
std::vector<KeyRange> ancestor_ranges(const ForestView& f, int32_t s) {
  std::vector<KeyRange> ranges;
  for (int32_t a = f.parent[s]; a >= 0; a = f.parent[a])
    ranges.push_back({a, TokenRange{f.keys_begin(a), f.keys_end(a)}});
  std::reverse(ranges.begin(), ranges.end());
  return ranges;
}

// Work items of `chunk` consecutive tokens that never straddle a segment.
struct Chunk {
  int32_t segment, begin, end;
};

std::vector<Chunk> segment_chunks(const ForestView& f, int32_t chunk) {
  std::vector<Chunk> chunks;
  for (int32_t s = 0; s < f.num_segments; ++s)
    for (int32_t b = f.segment_begin(s); b < f.segment_end(s); b += chunk)
      chunks.push_back({s, b, std::min(b + chunk, f.segment_end(s))});
  return chunks;
}

constexpr int32_t kChunk = 32;

double dot(const double* a, const double* b, int64_t D) {
  double sum = 0;
  for (int64_t d = 0; d < D; ++d) sum += a[d] * b[d];
  return sum;
}

// What both directions share: the forest, the sizes, the scores' scale and modifiers, and
// q, k, v and the prefix buffers' keys and values (empty without external prefixes) as fp64.
struct Problem {
  ForestView f;
  int64_t T, H, Hk, D, group, prefix_rows;
  double scale, softcap;
  PositionWindow window;
  std::vector<double> q, k, v, prefix_k, prefix_v;

  // Key / value j of segment s for kv head g: a token, or a prefix row of an external segment.
  const double* key(int32_t s, int64_t g, int32_t j) const {
    return f.is_external(s) ? &prefix_k[static_cast<size_t>((g * prefix_rows + j) * D)]
                            : &k[static_cast<size_t>((g * T + j) * D)];
  }
  const double* value(int32_t s, int64_t g, int32_t j) const {
    return f.is_external(s) ? &prefix_v[static_cast<size_t>((g * prefix_rows + j) * D)]
                            : &v[static_cast<size_t>((g * T + j) * D)];
  }
  // The (softcapped) score of query row `row` ([heads][T] index) against a key.
  double score(size_t row, const double* key) const {
    const double s = scale * dot(&q[row * D], key, D);
    return softcap > 0 ? softcap_score(s, softcap) : s;
  }
  // d score / d (scale * q.k) at a score.
  double score_grad(double s) const { return softcap > 0 ? softcap_grad(s, softcap) : 1.0; }
  // The keys of `r` that query t of segment s sees (r is an ancestor's range or s's keys up to t).
  TokenRange keys_seen(const KeyRange& r, int32_t s, int32_t t) const {
    return SegmentMask::keys_in_window(f, window, r.segment, r.keys, f.position(s, t));
  }
};

template <typename Params>
Problem make_problem(const Params& p) {
  const ForestView f = make_forest_view(p.layout, p.prefixes);
  const int64_t T = f.num_tokens, H = p.num_heads, Hk = p.num_kv_heads, D = p.head_dim;
  const int64_t rows = p.prefixes.num_prefixes ? p.prefixes.num_prefix_rows : 0;
  auto prefix = [&](const void* base, int64_t token_stride, int64_t head_stride) {
    return rows ? gather(base, p.dtype, rows, Hk, D, token_stride, head_stride) : std::vector<double>{};
  };
  return {f, T, H, Hk, D, H / Hk, rows, p.softmax_scale, p.softcap, PositionWindow{p.window},
          gather(p.q, p.dtype, T, H, D, p.q_token_stride, p.q_head_stride),
          gather(p.k, p.dtype, T, Hk, D, p.k_token_stride, p.k_head_stride),
          gather(p.v, p.dtype, T, Hk, D, p.v_token_stride, p.v_head_stride),
          prefix(p.prefix_k, p.prefix_k_token_stride, p.prefix_k_head_stride),
          prefix(p.prefix_v, p.prefix_v_token_stride, p.prefix_v_head_stride)};
}

}  // namespace

void reference_forward(const dualkv_fwd_params& p) {
  const Problem pr = make_problem(p);
  const ForestView& f = pr.f;
  const int64_t T = pr.T, H = pr.H, D = pr.D;
  const int32_t ldt = lse_dtype(p.dtype);
  const std::vector<Chunk> chunks = segment_chunks(f, kChunk);

  parallel_for(static_cast<int64_t>(chunks.size()) * H, p.num_threads, [&](int64_t item) {
    const Chunk c = chunks[static_cast<size_t>(item / H)];
    const int64_t h = item % H, g = h / pr.group;
    std::vector<KeyRange> ranges = ancestor_ranges(f, c.segment);
    ranges.push_back({c.segment, TokenRange{f.segment_begin(c.segment), 0}});  // own keys; end set per query
    std::vector<double> scores, acc(static_cast<size_t>(D));
    for (int32_t t = c.begin; t < c.end; ++t) {
      ranges.back().keys.end = t + 1;
      const size_t row = static_cast<size_t>(h * T + t);
      scores.clear();
      double row_max = -INFINITY;
      for (const KeyRange& r : ranges) {
        const TokenRange keys = pr.keys_seen(r, c.segment, t);
        for (int32_t j = keys.begin; j < keys.end; ++j) {
          scores.push_back(pr.score(row, pr.key(r.segment, g, j)));
          row_max = std::max(row_max, scores.back());
        }
      }
      double sum = 0;
      for (double s : scores) sum += std::exp(s - row_max);
      if (p.sinks) fold_sink(row_max, sum, load_element<double>(p.sinks, h, ldt));
      const double lse = row_max + std::log(sum);
      std::fill(acc.begin(), acc.end(), 0.0);
      size_t idx = 0;
      for (const KeyRange& r : ranges) {
        const TokenRange keys = pr.keys_seen(r, c.segment, t);
        for (int32_t j = keys.begin; j < keys.end; ++j) {
          const double w = std::exp(scores[idx++] - lse);
          const double* vj = pr.value(r.segment, g, j);
          for (int64_t d = 0; d < D; ++d) acc[static_cast<size_t>(d)] += w * vj[d];
        }
      }
      const int64_t o = t * p.out_token_stride + h * p.out_head_stride;
      for (int64_t d = 0; d < D; ++d) store_element<double>(p.out, o + d, p.dtype, acc[static_cast<size_t>(d)]);
      if (p.lse) store_element<double>(p.lse, h * p.lse_head_stride + t, ldt, lse);
    }
  });
}

void reference_backward(const dualkv_bwd_params& p) {
  const Problem pr = make_problem(p);
  const ForestView& f = pr.f;
  const int64_t T = pr.T, H = pr.H, Hk = pr.Hk, D = pr.D, group = pr.group;
  const std::vector<double>& q = pr.q;
  const int32_t ldt = lse_dtype(p.dtype);
  const std::vector<double> dout = gather(p.dout, p.dtype, T, H, D, p.dout_token_stride, p.dout_head_stride);

  // lse and delta_i = rowsum(dO_i * O_i) - dlse_i, the softmax-backward correction per row; and
  // d loss / d sink_h = -sum_i sink_probability(sink_h, lse_i) * delta_i over the head's rows.
  std::vector<double> lse(static_cast<size_t>(H * T)), delta(static_cast<size_t>(H * T));
  for (int64_t h = 0; h < H; ++h) {
    const double sink = p.sinks ? load_element<double>(p.sinks, h, ldt) : 0.0;
    double dsink = 0;
    for (int64_t t = 0; t < T; ++t) {
      const size_t i = static_cast<size_t>(h * T + t);
      lse[i] = load_element<double>(p.lse, h * p.lse_head_stride + t, ldt);
      double s = 0;
      const int64_t o = t * p.out_token_stride + h * p.out_head_stride;
      for (int64_t d = 0; d < D; ++d) s += dout[i * D + d] * load_element<double>(p.out, o + d, p.dtype);
      if (p.dlse) s -= load_element<double>(p.dlse, h * p.dlse_head_stride + t, ldt);
      delta[i] = s;
      if (p.sinks) dsink -= sink_probability(sink, lse[i]) * s;
    }
    if (p.sinks) store_element<double>(p.dsinks, h, ldt, dsink);
  }
  const std::vector<Chunk> chunks = segment_chunks(f, kChunk);

  // dq: query-outer, like the forward.
  parallel_for(static_cast<int64_t>(chunks.size()) * H, p.num_threads, [&](int64_t item) {
    const Chunk c = chunks[static_cast<size_t>(item / H)];
    const int64_t h = item % H, g = h / group;
    std::vector<KeyRange> ranges = ancestor_ranges(f, c.segment);
    ranges.push_back({c.segment, TokenRange{f.segment_begin(c.segment), 0}});
    std::vector<double> dq(static_cast<size_t>(D));
    for (int32_t t = c.begin; t < c.end; ++t) {
      ranges.back().keys.end = t + 1;
      const size_t row = static_cast<size_t>(h * T + t);
      const double* dot_ = &dout[row * D];
      std::fill(dq.begin(), dq.end(), 0.0);
      for (const KeyRange& r : ranges) {
        const TokenRange keys = pr.keys_seen(r, c.segment, t);
        for (int32_t j = keys.begin; j < keys.end; ++j) {
          const double* kj = pr.key(r.segment, g, j);
          const double s = pr.score(row, kj);
          const double ds = std::exp(s - lse[row]) * (dot(dot_, pr.value(r.segment, g, j), D) - delta[row]) *
                            pr.score_grad(s);
          for (int64_t d = 0; d < D; ++d) dq[static_cast<size_t>(d)] += ds * kj[d];
        }
      }
      const int64_t o = t * p.dq_token_stride + h * p.dq_head_stride;
      for (int64_t d = 0; d < D; ++d) store_element<double>(p.dq, o + d, p.dtype, pr.scale * dq[static_cast<size_t>(d)]);
    }
  });

  // dk, dv: key-outer. Key chunk [kb, ke) of segment s is seen by the queries of s at or after
  // each key (causal) and by the tokens of s's descendants (the contiguous token range
  // [segment_end(s), subtree_token_end(s))), from all query heads of the kv head; with a window
  // only by those within it: a descendant whose first token lies beyond it is skipped with its
  // subtree, which lies further along every path. The rows of an external segment's prefix (the
  // chunks after the token chunks) have no queries of their own segment; their gradients are
  // added to prefix_dk / prefix_dv.
  std::vector<Chunk> key_chunks = chunks;
  for (int32_t s = 0; s < f.num_segments; ++s)
    if (f.is_external(s))
      for (int32_t b = f.prefix_begin(s); b < f.prefix_end(s); b += kChunk)
        key_chunks.push_back({s, b, std::min(b + kChunk, f.prefix_end(s))});
  parallel_for(static_cast<int64_t>(key_chunks.size()) * Hk, p.num_threads, [&](int64_t item) {
    const Chunk c = key_chunks[static_cast<size_t>(item / Hk)];
    const bool prefix = f.is_external(c.segment);
    const int64_t g = item % Hk;
    const int32_t n = c.end - c.begin;
    std::vector<double> dk(static_cast<size_t>(n * D), 0.0), dv(static_cast<size_t>(n * D), 0.0);
    const int32_t k_last_pos = f.key_position(c.segment, c.end - 1);
    // The chunk's keys as the policy's row_keys takes them (only keys, k_pos and own are read).
    const BlockPair own{TokenRange{c.begin, c.end}, f.key_position(c.segment, c.begin), 0, 0, 0, 0, true};
    BlockPair ancestor = own;
    ancestor.own = false;
    // Accumulates query row t's contributions (all heads of kv head g) to the keys it sees; false
    // when it sees none.
    auto accumulate = [&](int32_t qs, int32_t t, const BlockPair& pair) {
      const TokenRange keys = SegmentMask::row_keys(pair, pr.window, t, f.position(qs, t));
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const size_t row = static_cast<size_t>(h * T + t);
        const double* qt = &q[row * D];
        const double* dot_ = &dout[row * D];
        for (int32_t j = keys.begin; j < keys.end; ++j) {
          const double s = pr.score(row, pr.key(c.segment, g, j));
          const double prob = std::exp(s - lse[row]);
          const double ds = prob * (dot(dot_, pr.value(c.segment, g, j), D) - delta[row]) * pr.score_grad(s);
          double* dkj = &dk[static_cast<size_t>((j - c.begin) * D)];
          double* dvj = &dv[static_cast<size_t>((j - c.begin) * D)];
          for (int64_t d = 0; d < D; ++d) {
            dvj[d] += prob * dot_[d];
            dkj[d] += ds * qt[d];
          }
        }
      }
      return keys.begin < keys.end;
    };
    const TokenRange seeing = SegmentMask::bwd_query_range(f, pr.window, c.segment, c.begin, c.end - 1);
    // its own queries (none for an external segment: seeing starts after it), then descendants'
    for (int32_t t = seeing.begin; t < std::min(seeing.end, f.segment_end(c.segment)); ++t)
      accumulate(c.segment, t, own);
    for (int32_t d = c.segment + 1; d < f.subtree_end[c.segment] && f.segment_begin(d) < seeing.end;) {
      if (pr.window.hides(f.position(d, f.segment_begin(d)) - k_last_pos)) {
        d = f.subtree_end[d];
        continue;
      }
      // The window closes within d at the first token that sees none of the chunk.
      for (int32_t t = f.segment_begin(d); t < f.segment_end(d) && accumulate(d, t, ancestor); ++t) {
      }
      ++d;
    }
    for (int32_t j = c.begin; j < c.end; ++j) {
      const double* dkj = &dk[static_cast<size_t>((j - c.begin) * D)];
      const double* dvj = &dv[static_cast<size_t>((j - c.begin) * D)];
      if (prefix) {  // accumulate into the caller's buffers
        const int64_t ok = j * p.prefix_dk_token_stride + g * p.prefix_dk_head_stride;
        const int64_t ov = j * p.prefix_dv_token_stride + g * p.prefix_dv_head_stride;
        for (int64_t d = 0; d < D; ++d) {
          store_element<double>(p.prefix_dk, ok + d, p.dtype,
                                load_element<double>(p.prefix_dk, ok + d, p.dtype) + pr.scale * dkj[d]);
          store_element<double>(p.prefix_dv, ov + d, p.dtype,
                                load_element<double>(p.prefix_dv, ov + d, p.dtype) + dvj[d]);
        }
      } else {
        const int64_t ok = j * p.dk_token_stride + g * p.dk_head_stride;
        const int64_t ov = j * p.dv_token_stride + g * p.dv_head_stride;
        for (int64_t d = 0; d < D; ++d) {
          store_element<double>(p.dk, ok + d, p.dtype, pr.scale * dkj[d]);
          store_element<double>(p.dv, ov + d, p.dtype, dvj[d]);
        }
      }
    }
  });
}

}  // namespace dualkv::detail::cpu
