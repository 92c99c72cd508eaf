// The exact CPU backend: forward (out, lse) and backward (dq, dk, dv) for any segment forest.
//
// This is the reference the GPU kernels are judged against and the backend CPU-only users run,
// so it favours being obviously right over being fast:
// - operands are first converted to contiguous accumulation-type arrays ([heads][T][D]);
// - the forward is query-outer: each query row computes its scores over the key ranges it sees
//   (every proper ancestor segment in full, then its own segment up to itself);
// - the backward recomputes probabilities from the forward's lse, in two passes: query-outer
//   for dq, key-outer for dk/dv. Every output element is written by exactly one work item in a
//   fixed order, so results are deterministic whatever the thread count.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <thread>
#include <type_traits>
#include <vector>

#include "dualkv/dualkv.h"
#include "dualkv/layout.h"
#include "internal.h"

namespace dualkv::detail {
namespace {

// ---- 16-bit float conversion (round to nearest even), bit-exact with the hardware formats ----

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays a (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {
    const float f = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal
    return sign ? -f : f;
  }
  const uint32_t bits = exp == 31 ? (sign | 0x7f800000u | (mant << 13))
                                  : (sign | ((exp + 112u) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return sign | (a > 0x7f800000u ? 0x7e00 : 0x7c00);  // NaN / inf
  if (a >= 0x477ff000u) return sign | 0x7c00;                              // rounds past 65504
  if (a < 0x38800000u) {  // below 2^-14: zero or a subnormal half, value = round(|f| * 2^24)
    return sign | static_cast<uint16_t>(std::nearbyint(std::fabs(f) * 16777216.0f));
  }
  const uint32_t mant = a & 0x7fffffu;
  uint32_t h = ((((a >> 23) - 112u)) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return sign | static_cast<uint16_t>(h);
}

template <typename Acc>
Acc load_element(const void* base, int64_t index, int32_t dtype) {
  switch (dtype) {
    case DUALKV_DTYPE_FLOAT32: return static_cast<Acc>(static_cast<const float*>(base)[index]);
    case DUALKV_DTYPE_FLOAT64: return static_cast<Acc>(static_cast<const double*>(base)[index]);
    case DUALKV_DTYPE_BFLOAT16: return static_cast<Acc>(bf16_to_float(static_cast<const uint16_t*>(base)[index]));
    default: return static_cast<Acc>(fp16_to_float(static_cast<const uint16_t*>(base)[index]));
  }
}

template <typename Acc>
void store_element(void* base, int64_t index, int32_t dtype, Acc value) {
  switch (dtype) {
    case DUALKV_DTYPE_FLOAT32: static_cast<float*>(base)[index] = static_cast<float>(value); break;
    case DUALKV_DTYPE_FLOAT64: static_cast<double*>(base)[index] = static_cast<double>(value); break;
    case DUALKV_DTYPE_BFLOAT16: static_cast<uint16_t*>(base)[index] = float_to_bf16(static_cast<float>(value)); break;
    default: static_cast<uint16_t*>(base)[index] = float_to_fp16(static_cast<float>(value)); break;
  }
}

// lse is float64 for float64 inputs and float32 otherwise.
inline int32_t lse_dtype(int32_t dtype) {
  return dtype == DUALKV_DTYPE_FLOAT64 ? DUALKV_DTYPE_FLOAT64 : DUALKV_DTYPE_FLOAT32;
}

// A strided [T, heads, D] operand converted to a contiguous [heads][T][D] array.
template <typename Acc>
std::vector<Acc> gather(const void* base, int32_t dtype, int64_t T, int64_t heads, int64_t D,
                        int64_t token_stride, int64_t head_stride) {
  std::vector<Acc> out(static_cast<size_t>(heads * T * D));
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t t = 0; t < T; ++t) {
      Acc* row = &out[static_cast<size_t>((h * T + t) * D)];
      const int64_t src = t * token_stride + h * head_stride;
      for (int64_t d = 0; d < D; ++d) row[d] = load_element<Acc>(base, src + d, dtype);
    }
  return out;
}

// Runs fn(item) for item in [0, n) on up to `threads` threads, dynamically scheduled. Items must
// write disjoint outputs; each item is processed by one thread in a fixed order.
template <typename Fn>
void parallel_for(int64_t n, int32_t threads, Fn&& fn) {
  int64_t workers = threads > 0 ? threads : std::max(1u, std::thread::hardware_concurrency());
  workers = std::min<int64_t>(workers, n);
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto body = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(workers - 1));
  for (int64_t w = 1; w < workers; ++w) pool.emplace_back(body);
  body();
  for (std::thread& t : pool) t.join();
}

struct TokenRange {
  int32_t begin, end;
};

// Token ranges of s's proper ancestors, root first.
std::vector<TokenRange> ancestor_ranges(const ForestView& f, int32_t s) {
  std::vector<TokenRange> ranges;
  for (int32_t a = f.parent[s]; a >= 0; a = f.parent[a]) ranges.push_back({f.segment_begin(a), f.segment_end(a)});
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

template <typename Acc>
Acc dot(const Acc* a, const Acc* b, int64_t D) {
  Acc sum = 0;
  for (int64_t d = 0; d < D; ++d) sum += a[d] * b[d];
  return sum;
}

template <typename Acc>
void forward(const dualkv_fwd_params& p) {
  const ForestView f = make_forest_view(p.layout);
  const int64_t T = f.num_tokens, H = p.num_heads, Hk = p.num_kv_heads, D = p.head_dim;
  const int64_t group = H / Hk;
  const Acc scale = static_cast<Acc>(p.softmax_scale);
  const std::vector<Acc> q = gather<Acc>(p.q, p.dtype, T, H, D, p.q_token_stride, p.q_head_stride);
  const std::vector<Acc> k = gather<Acc>(p.k, p.dtype, T, Hk, D, p.k_token_stride, p.k_head_stride);
  const std::vector<Acc> v = gather<Acc>(p.v, p.dtype, T, Hk, D, p.v_token_stride, p.v_head_stride);
  const std::vector<Chunk> chunks = segment_chunks(f, kChunk);

  parallel_for(static_cast<int64_t>(chunks.size()) * H, p.num_threads, [&](int64_t item) {
    const Chunk c = chunks[static_cast<size_t>(item / H)];
    const int64_t h = item % H, g = h / group;
    std::vector<TokenRange> ranges = ancestor_ranges(f, c.segment);
    ranges.push_back({f.segment_begin(c.segment), 0});  // own segment; end set per query
    std::vector<Acc> scores, acc(static_cast<size_t>(D));
    for (int32_t t = c.begin; t < c.end; ++t) {
      ranges.back().end = t + 1;
      const Acc* qt = &q[static_cast<size_t>((h * T + t) * D)];
      scores.clear();
      Acc row_max = -INFINITY;
      for (const TokenRange& r : ranges)
        for (int32_t j = r.begin; j < r.end; ++j) {
          const Acc s = scale * dot(qt, &k[static_cast<size_t>((g * T + j) * D)], D);
          scores.push_back(s);
          row_max = std::max(row_max, s);
        }
      std::fill(acc.begin(), acc.end(), Acc(0));
      Acc sum = 0;
      size_t idx = 0;
      for (const TokenRange& r : ranges)
        for (int32_t j = r.begin; j < r.end; ++j) {
          const Acc w = std::exp(scores[idx++] - row_max);
          sum += w;
          const Acc* vj = &v[static_cast<size_t>((g * T + j) * D)];
          for (int64_t d = 0; d < D; ++d) acc[static_cast<size_t>(d)] += w * vj[d];
        }
      const int64_t o = t * p.out_token_stride + h * p.out_head_stride;
      for (int64_t d = 0; d < D; ++d) store_element<Acc>(p.out, o + d, p.dtype, acc[static_cast<size_t>(d)] / sum);
      if (p.lse) store_element<Acc>(p.lse, h * p.lse_head_stride + t, lse_dtype(p.dtype), row_max + std::log(sum));
    }
  });
}

template <typename Acc>
void backward(const dualkv_bwd_params& p) {
  const ForestView f = make_forest_view(p.layout);
  const int64_t T = f.num_tokens, H = p.num_heads, Hk = p.num_kv_heads, D = p.head_dim;
  const int64_t group = H / Hk;
  const Acc scale = static_cast<Acc>(p.softmax_scale);
  const int32_t ldt = lse_dtype(p.dtype);
  const std::vector<Acc> q = gather<Acc>(p.q, p.dtype, T, H, D, p.q_token_stride, p.q_head_stride);
  const std::vector<Acc> k = gather<Acc>(p.k, p.dtype, T, Hk, D, p.k_token_stride, p.k_head_stride);
  const std::vector<Acc> v = gather<Acc>(p.v, p.dtype, T, Hk, D, p.v_token_stride, p.v_head_stride);
  const std::vector<Acc> dout = gather<Acc>(p.dout, p.dtype, T, H, D, p.dout_token_stride, p.dout_head_stride);

  // lse and delta_i = rowsum(dO_i * O_i) - dlse_i, the softmax-backward correction per row.
  std::vector<Acc> lse(static_cast<size_t>(H * T)), delta(static_cast<size_t>(H * T));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t) {
      const size_t i = static_cast<size_t>(h * T + t);
      lse[i] = load_element<Acc>(p.lse, h * p.lse_head_stride + t, ldt);
      Acc s = 0;
      const int64_t o = t * p.out_token_stride + h * p.out_head_stride;
      for (int64_t d = 0; d < D; ++d) s += dout[i * D + d] * load_element<Acc>(p.out, o + d, p.dtype);
      if (p.dlse) s -= load_element<Acc>(p.dlse, h * p.dlse_head_stride + t, ldt);
      delta[i] = s;
    }
  const std::vector<Chunk> chunks = segment_chunks(f, kChunk);

  // dq: query-outer, like the forward.
  parallel_for(static_cast<int64_t>(chunks.size()) * H, p.num_threads, [&](int64_t item) {
    const Chunk c = chunks[static_cast<size_t>(item / H)];
    const int64_t h = item % H, g = h / group;
    std::vector<TokenRange> ranges = ancestor_ranges(f, c.segment);
    ranges.push_back({f.segment_begin(c.segment), 0});
    std::vector<Acc> dq(static_cast<size_t>(D));
    for (int32_t t = c.begin; t < c.end; ++t) {
      ranges.back().end = t + 1;
      const size_t row = static_cast<size_t>(h * T + t);
      const Acc* qt = &q[row * D];
      const Acc* dot_ = &dout[row * D];
      std::fill(dq.begin(), dq.end(), Acc(0));
      for (const TokenRange& r : ranges)
        for (int32_t j = r.begin; j < r.end; ++j) {
          const Acc* kj = &k[static_cast<size_t>((g * T + j) * D)];
          const Acc prob = std::exp(scale * dot(qt, kj, D) - lse[row]);
          const Acc ds = prob * (dot(dot_, &v[static_cast<size_t>((g * T + j) * D)], D) - delta[row]);
          for (int64_t d = 0; d < D; ++d) dq[static_cast<size_t>(d)] += ds * kj[d];
        }
      const int64_t o = t * p.dq_token_stride + h * p.dq_head_stride;
      for (int64_t d = 0; d < D; ++d) store_element<Acc>(p.dq, o + d, p.dtype, scale * dq[static_cast<size_t>(d)]);
    }
  });

  // dk, dv: key-outer. Key chunk [kb, ke) of segment s is seen by the queries of s at or after
  // each key (causal) and by every token of s's descendants, the contiguous token range
  // [segment_end(s), subtree_token_end(s)), from all query heads of the kv head.
  parallel_for(static_cast<int64_t>(chunks.size()) * Hk, p.num_threads, [&](int64_t item) {
    const Chunk c = chunks[static_cast<size_t>(item / Hk)];
    const int64_t g = item % Hk;
    const int32_t n = c.end - c.begin;
    std::vector<Acc> dk(static_cast<size_t>(n * D), Acc(0)), dv(static_cast<size_t>(n * D), Acc(0));
    const TokenRange query_ranges[2] = {{c.begin, f.segment_end(c.segment)},
                                        {f.segment_end(c.segment), f.subtree_token_end(c.segment)}};
    for (int64_t h = g * group; h < (g + 1) * group; ++h)
      for (const TokenRange& r : query_ranges)
        for (int32_t t = r.begin; t < r.end; ++t) {
          const size_t row = static_cast<size_t>(h * T + t);
          const Acc* qt = &q[row * D];
          const Acc* dot_ = &dout[row * D];
          const int32_t last_key = std::min(c.end, t < f.segment_end(c.segment) ? t + 1 : c.end);
          for (int32_t j = c.begin; j < last_key; ++j) {
            const size_t kv = static_cast<size_t>((g * T + j) * D);
            const Acc prob = std::exp(scale * dot(qt, &k[kv], D) - lse[row]);
            const Acc ds = prob * (dot(dot_, &v[kv], D) - delta[row]);
            Acc* dkj = &dk[static_cast<size_t>((j - c.begin) * D)];
            Acc* dvj = &dv[static_cast<size_t>((j - c.begin) * D)];
            for (int64_t d = 0; d < D; ++d) {
              dvj[d] += prob * dot_[d];
              dkj[d] += ds * qt[d];
            }
          }
        }
    for (int32_t j = c.begin; j < c.end; ++j) {
      const int64_t ok = j * p.dk_token_stride + g * p.dk_head_stride;
      const int64_t ov = j * p.dv_token_stride + g * p.dv_head_stride;
      for (int64_t d = 0; d < D; ++d) {
        store_element<Acc>(p.dk, ok + d, p.dtype, scale * dk[static_cast<size_t>((j - c.begin) * D + d)]);
        store_element<Acc>(p.dv, ov + d, p.dtype, dv[static_cast<size_t>((j - c.begin) * D + d)]);
      }
    }
  });
}

bool use_fp64(int32_t dtype, int32_t flags) {
  return dtype == DUALKV_DTYPE_FLOAT64 || (flags & DUALKV_FLAG_ACCUMULATE_FP64);
}

template <typename Fn>
dualkv_status guarded(const char* what, Fn&& fn) {
  try {
    fn();
    return DUALKV_OK;
  } catch (const std::bad_alloc&) {
    return fail(DUALKV_ERROR_INTERNAL, "%s (cpu): out of host memory", what);
  } catch (const std::exception& e) {
    return fail(DUALKV_ERROR_INTERNAL, "%s (cpu): %s", what, e.what());
  }
}

}  // namespace

size_t cpu_fwd_workspace_bytes(const dualkv_fwd_params&) { return 0; }
size_t cpu_bwd_workspace_bytes(const dualkv_bwd_params&) { return 0; }

dualkv_status cpu_fwd(const dualkv_fwd_params& p) {
  return guarded("fwd", [&] { use_fp64(p.dtype, p.flags) ? forward<double>(p) : forward<float>(p); });
}

dualkv_status cpu_bwd(const dualkv_bwd_params& p) {
  return guarded("bwd", [&] { use_fp64(p.dtype, p.flags) ? backward<double>(p) : backward<float>(p); });
}

}  // namespace dualkv::detail
