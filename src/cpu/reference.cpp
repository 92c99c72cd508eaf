// The fp64 reference of the CPU backend (float64 inputs, DUALKV_FLAG_ACCUMULATE_FP64): the
// attention the GPU kernels and the blocked path are judged against, written to be obviously
// right rather than fast:
// - operands are first converted to contiguous fp64 arrays ([heads][T][D]);
// - the forward is query-outer: each query row computes its scores over the key ranges it sees
//   (every proper ancestor segment in full, then its own segment up to itself); the keys of an
//   external prefix segment are rows of the prefix buffers;
// - the backward recomputes probabilities from the forward's lse, in two passes: query-outer
//   for dq, key-outer for dk/dv (and the prefix rows' gradients, added to prefix_dk/prefix_dv).
//   Every output element is written by exactly one work item in a fixed order, so results are
//   deterministic whatever the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/backends.h"
#include "cpu/convert.h"
#include "cpu/parallel.h"
#include "dualkv/layout.h"

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

// Keys [begin, end) of one segment: tokens of k/v, or rows of the prefix buffers (`prefix`).
struct TokenRange {
  int32_t begin, end;
  bool prefix;
};

// Key ranges of s's proper ancestors, root first.
std::vector<TokenRange> ancestor_ranges(const ForestView& f, int32_t s) {
  std::vector<TokenRange> ranges;
  for (int32_t a = f.parent[s]; a >= 0; a = f.parent[a])
    ranges.push_back(f.is_external(a) ? TokenRange{f.prefix_begin(a), f.prefix_end(a), true}
                                      : TokenRange{f.segment_begin(a), f.segment_end(a), false});
  std::reverse(ranges.begin(), ranges.end());
  return ranges;
}

// Keys and values of a call as contiguous fp64 [Hk][rows][D] arrays: the tokens' and the prefix
// rows' (empty without external prefixes).
struct KeysValues {
  std::vector<double> k, v, prefix_k, prefix_v;
  int64_t T, prefix_rows, D;

  template <typename Params>
  KeysValues(const Params& p, int64_t T_, int64_t Hk)
      : k(gather(p.k, p.dtype, T_, Hk, p.head_dim, p.k_token_stride, p.k_head_stride)),
        v(gather(p.v, p.dtype, T_, Hk, p.head_dim, p.v_token_stride, p.v_head_stride)),
        T(T_), prefix_rows(p.prefixes.num_prefixes ? p.prefixes.num_prefix_rows : 0), D(p.head_dim) {
    if (prefix_rows) {
      prefix_k = gather(p.prefix_k, p.dtype, prefix_rows, Hk, D, p.prefix_k_token_stride, p.prefix_k_head_stride);
      prefix_v = gather(p.prefix_v, p.dtype, prefix_rows, Hk, D, p.prefix_v_token_stride, p.prefix_v_head_stride);
    }
  }
  // Key / value j of range r for kv head g.
  const double* key(const TokenRange& r, int64_t g, int32_t j) const {
    return r.prefix ? &prefix_k[static_cast<size_t>((g * prefix_rows + j) * D)] : &k[static_cast<size_t>((g * T + j) * D)];
  }
  const double* value(const TokenRange& r, int64_t g, int32_t j) const {
    return r.prefix ? &prefix_v[static_cast<size_t>((g * prefix_rows + j) * D)] : &v[static_cast<size_t>((g * T + j) * D)];
  }
};

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

}  // namespace

void reference_forward(const dualkv_fwd_params& p) {
  const ForestView f = make_forest_view(p.layout, p.prefixes);
  const int64_t T = f.num_tokens, H = p.num_heads, Hk = p.num_kv_heads, D = p.head_dim;
  const int64_t group = H / Hk;
  const double scale = p.softmax_scale;
  const std::vector<double> q = gather(p.q, p.dtype, T, H, D, p.q_token_stride, p.q_head_stride);
  const KeysValues kv(p, T, Hk);
  const std::vector<Chunk> chunks = segment_chunks(f, kChunk);

  parallel_for(static_cast<int64_t>(chunks.size()) * H, p.num_threads, [&](int64_t item) {
    const Chunk c = chunks[static_cast<size_t>(item / H)];
    const int64_t h = item % H, g = h / group;
    std::vector<TokenRange> ranges = ancestor_ranges(f, c.segment);
    ranges.push_back({f.segment_begin(c.segment), 0, false});  // own segment; end set per query
    std::vector<double> scores, acc(static_cast<size_t>(D));
    for (int32_t t = c.begin; t < c.end; ++t) {
      ranges.back().end = t + 1;
      const double* qt = &q[static_cast<size_t>((h * T + t) * D)];
      scores.clear();
      double row_max = -INFINITY;
      for (const TokenRange& r : ranges)
        for (int32_t j = r.begin; j < r.end; ++j) {
          const double s = scale * dot(qt, kv.key(r, g, j), D);
          scores.push_back(s);
          row_max = std::max(row_max, s);
        }
      std::fill(acc.begin(), acc.end(), 0.0);
      double sum = 0;
      size_t idx = 0;
      for (const TokenRange& r : ranges)
        for (int32_t j = r.begin; j < r.end; ++j) {
          const double w = std::exp(scores[idx++] - row_max);
          sum += w;
          const double* vj = kv.value(r, g, j);
          for (int64_t d = 0; d < D; ++d) acc[static_cast<size_t>(d)] += w * vj[d];
        }
      const int64_t o = t * p.out_token_stride + h * p.out_head_stride;
      for (int64_t d = 0; d < D; ++d) store_element<double>(p.out, o + d, p.dtype, acc[static_cast<size_t>(d)] / sum);
      if (p.lse) store_element<double>(p.lse, h * p.lse_head_stride + t, lse_dtype(p.dtype), row_max + std::log(sum));
    }
  });
}

void reference_backward(const dualkv_bwd_params& p) {
  const ForestView f = make_forest_view(p.layout, p.prefixes);
  const int64_t T = f.num_tokens, H = p.num_heads, Hk = p.num_kv_heads, D = p.head_dim;
  const int64_t group = H / Hk;
  const double scale = p.softmax_scale;
  const int32_t ldt = lse_dtype(p.dtype);
  const std::vector<double> q = gather(p.q, p.dtype, T, H, D, p.q_token_stride, p.q_head_stride);
  const KeysValues kv(p, T, Hk);
  const std::vector<double> dout = gather(p.dout, p.dtype, T, H, D, p.dout_token_stride, p.dout_head_stride);

  // lse and delta_i = rowsum(dO_i * O_i) - dlse_i, the softmax-backward correction per row.
  std::vector<double> lse(static_cast<size_t>(H * T)), delta(static_cast<size_t>(H * T));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t) {
      const size_t i = static_cast<size_t>(h * T + t);
      lse[i] = load_element<double>(p.lse, h * p.lse_head_stride + t, ldt);
      double s = 0;
      const int64_t o = t * p.out_token_stride + h * p.out_head_stride;
      for (int64_t d = 0; d < D; ++d) s += dout[i * D + d] * load_element<double>(p.out, o + d, p.dtype);
      if (p.dlse) s -= load_element<double>(p.dlse, h * p.dlse_head_stride + t, ldt);
      delta[i] = s;
    }
  const std::vector<Chunk> chunks = segment_chunks(f, kChunk);

  // dq: query-outer, like the forward.
  parallel_for(static_cast<int64_t>(chunks.size()) * H, p.num_threads, [&](int64_t item) {
    const Chunk c = chunks[static_cast<size_t>(item / H)];
    const int64_t h = item % H, g = h / group;
    std::vector<TokenRange> ranges = ancestor_ranges(f, c.segment);
    ranges.push_back({f.segment_begin(c.segment), 0, false});
    std::vector<double> dq(static_cast<size_t>(D));
    for (int32_t t = c.begin; t < c.end; ++t) {
      ranges.back().end = t + 1;
      const size_t row = static_cast<size_t>(h * T + t);
      const double* qt = &q[row * D];
      const double* dot_ = &dout[row * D];
      std::fill(dq.begin(), dq.end(), 0.0);
      for (const TokenRange& r : ranges)
        for (int32_t j = r.begin; j < r.end; ++j) {
          const double* kj = kv.key(r, g, j);
          const double prob = std::exp(scale * dot(qt, kj, D) - lse[row]);
          const double ds = prob * (dot(dot_, kv.value(r, g, j), D) - delta[row]);
          for (int64_t d = 0; d < D; ++d) dq[static_cast<size_t>(d)] += ds * kj[d];
        }
      const int64_t o = t * p.dq_token_stride + h * p.dq_head_stride;
      for (int64_t d = 0; d < D; ++d) store_element<double>(p.dq, o + d, p.dtype, scale * dq[static_cast<size_t>(d)]);
    }
  });

  // dk, dv: key-outer. Key chunk [kb, ke) of segment s is seen by the queries of s at or after
  // each key (causal) and by every token of s's descendants, the contiguous token range
  // [segment_end(s), subtree_token_end(s)), from all query heads of the kv head. The rows of an
  // external segment's prefix (the chunks after the token chunks) are seen by every token of its
  // subtree, in full; their gradients are added to prefix_dk / prefix_dv.
  std::vector<Chunk> key_chunks = chunks;
  const size_t num_token_chunks = key_chunks.size();
  for (int32_t s = 0; s < f.num_segments; ++s)
    if (f.is_external(s))
      for (int32_t b = f.prefix_begin(s); b < f.prefix_end(s); b += kChunk)
        key_chunks.push_back({s, b, std::min(b + kChunk, f.prefix_end(s))});
  parallel_for(static_cast<int64_t>(key_chunks.size()) * Hk, p.num_threads, [&](int64_t item) {
    const size_t chunk_index = static_cast<size_t>(item / Hk);
    const Chunk c = key_chunks[chunk_index];
    const bool prefix = chunk_index >= num_token_chunks;
    const TokenRange keys{c.begin, c.end, prefix};
    const int64_t g = item % Hk;
    const int32_t n = c.end - c.begin;
    std::vector<double> dk(static_cast<size_t>(n * D), 0.0), dv(static_cast<size_t>(n * D), 0.0);
    const TokenRange query_ranges[2] = {{prefix ? 0 : c.begin, prefix ? 0 : f.segment_end(c.segment), false},
                                        {f.segment_end(c.segment), f.subtree_token_end(c.segment), false}};
    for (int64_t h = g * group; h < (g + 1) * group; ++h)
      for (const TokenRange& r : query_ranges)
        for (int32_t t = r.begin; t < r.end; ++t) {
          const size_t row = static_cast<size_t>(h * T + t);
          const double* qt = &q[row * D];
          const double* dot_ = &dout[row * D];
          const int32_t last_key = std::min(c.end, t < f.segment_end(c.segment) ? t + 1 : c.end);
          for (int32_t j = c.begin; j < last_key; ++j) {
            const double prob = std::exp(scale * dot(qt, kv.key(keys, g, j), D) - lse[row]);
            const double ds = prob * (dot(dot_, kv.value(keys, g, j), D) - delta[row]);
            double* dkj = &dk[static_cast<size_t>((j - c.begin) * D)];
            double* dvj = &dv[static_cast<size_t>((j - c.begin) * D)];
            for (int64_t d = 0; d < D; ++d) {
              dvj[d] += prob * dot_[d];
              dkj[d] += ds * qt[d];
            }
          }
        }
    for (int32_t j = c.begin; j < c.end; ++j) {
      const double* dkj = &dk[static_cast<size_t>((j - c.begin) * D)];
      const double* dvj = &dv[static_cast<size_t>((j - c.begin) * D)];
      if (prefix) {  // accumulate into the caller's buffers
        const int64_t ok = j * p.prefix_dk_token_stride + g * p.prefix_dk_head_stride;
        const int64_t ov = j * p.prefix_dv_token_stride + g * p.prefix_dv_head_stride;
        for (int64_t d = 0; d < D; ++d) {
          store_element<double>(p.prefix_dk, ok + d, p.dtype, load_element<double>(p.prefix_dk, ok + d, p.dtype) + scale * dkj[d]);
          store_element<double>(p.prefix_dv, ov + d, p.dtype, load_element<double>(p.prefix_dv, ov + d, p.dtype) + dvj[d]);
        }
      } else {
        const int64_t ok = j * p.dk_token_stride + g * p.dk_head_stride;
        const int64_t ov = j * p.dv_token_stride + g * p.dv_head_stride;
        for (int64_t d = 0; d < D; ++d) {
          store_element<double>(p.dk, ok + d, p.dtype, scale * dkj[d]);
          store_element<double>(p.dv, ov + d, p.dtype, dvj[d]);
        }
      }
    }
  });
}

}  // namespace dualkv::detail::cpu
