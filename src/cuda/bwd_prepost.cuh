// Backward pre- and post-processing, the same for every arch's main kernel (FA3's
// flash_bwd_preprocess / flash_bwd_postprocess, CUTLASS 88's sum_OdO / convert):
//   preprocess:   zero the work counters (and the fp32 dQ accumulator unless deterministic), then
//                 delta[h, t] = sum_d dO * O - dlse (16-byte loads, D / 8 lanes a row);
//   postprocess:  dQ = scale * the fp32 accumulator (unless deterministic: the main kernel's arch
//                 computes dQ itself then), and the fixed-order sum of the split items' fp32 dK/dV
//                 partials (only when the plan has splits);
//   with sinks (mask modifiers, issue 16), after the preprocess: dsinks[h] = -sum_t exp(sink_h -
//                 lse[h, t]) delta[h, t] (bwd_dsinks_kernel).
#pragma once

#include <cuda_runtime.h>

#include <stdint.h>

#include <algorithm>

#include "convert.cuh"
#include "dualkv/mask.h"
#include "kernel_params.h"
#include "plan_reader.cuh"
#include "tile_size.h"

namespace dualkv::cuda {

// Row r = t * H + h of a [T, H] walk: its token and head. 32-bit division where T * H fits (`small`,
// uniform across the grid): a 64-bit division is a long instruction sequence per row.
__device__ __forceinline__ void bwd_token_head(int64_t r, int H, bool small, int32_t* t, int* h) {
  if (small) {
    const uint32_t u = static_cast<uint32_t>(r), tt = u / static_cast<uint32_t>(H);
    *t = static_cast<int32_t>(tt);
    *h = static_cast<int>(u - tt * static_cast<uint32_t>(H));
  } else {
    *t = static_cast<int32_t>(r / H);
    *h = static_cast<int>(r % H);
  }
}

// The sum of the products of two 16-byte chunks (8 elements each), as a pairwise tree: 3
// roundings deep (the products of two 8- or 11-bit significands are exact in fp32).
template <typename T>
__device__ __forceinline__ float bwd_dot8(const uint4& a, const uint4& b) {
  using Ops = Convert<T>;
  const float2 a0 = Ops::unpack(a.x), a1 = Ops::unpack(a.y), a2 = Ops::unpack(a.z), a3 = Ops::unpack(a.w);
  const float2 b0 = Ops::unpack(b.x), b1 = Ops::unpack(b.y), b2 = Ops::unpack(b.z), b3 = Ops::unpack(b.w);
  return ((a0.x * b0.x + a0.y * b0.y) + (a1.x * b1.x + a1.y * b1.y)) +
         ((a2.x * b2.x + a2.y * b2.y) + (a3.x * b3.x + a3.y * b3.y));
}

// The preprocess's lanes a row (16-byte chunks, at most a warp) and rows a warp: the kernel's split
// and its launch's grid.
constexpr int bwd_preprocess_row_lanes(int head_dim) { return head_dim / 8 < 32 ? head_dim / 8 : 32; }
constexpr int bwd_preprocess_rows_per_warp(int head_dim) { return 32 / bwd_preprocess_row_lanes(head_dim); }

// delta[h, t] = sum_d dO * O - dlse with 16-byte loads: a row's D elements over D / 8 lanes, so a
// warp takes 32 / (D / 8) rows at a time up to D = 256 (above, one row in D / 256 chunks a lane).
// Every row of O and dO starts on 16 bytes (dispatch.cu check_rows). Before 2026-12-05 one warp took
// a row with 4-byte loads: 0.41 / 0.50 ms for D 64 / 128 on the long-responses class (H200; 1.7 /
// 2.8 TB/s of O and dO). A row's sum takes at most D / 32 + 6 roundings in sequence (a 3-deep tree
// per chunk, the shuffles, dlse; tests/gpu/cases.py dsinks_rounding_bound).
template <int D, typename T>
__global__ void bwd_preprocess_kernel(const BwdArgs args) {
  constexpr int kRowLanes = bwd_preprocess_row_lanes(D);
  constexpr int kRowsPerWarp = bwd_preprocess_rows_per_warp(D);
  const int lane = threadIdx.x & 31;
  const int sub = lane / kRowLanes, rl = lane % kRowLanes;
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int H = args.num_heads;
  const int64_t rows = static_cast<int64_t>(args.layout.num_tokens) * H;
  const bool small = rows <= static_cast<int64_t>(UINT32_MAX);
  const T* og = static_cast<const T*>(args.out);
  const T* dog = static_cast<const T*>(args.dout);
  for (int64_t r0 = (blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + (threadIdx.x >> 5)) * kRowsPerWarp;
       r0 < rows; r0 += warps_total * kRowsPerWarp) {
    const int64_t r = r0 + sub;
    int32_t t = 0;
    int h = 0;
    float sum = 0.f;
    if (r < rows) {
      bwd_token_head(r, H, small, &t, &h);
      const T* orow = og + t * args.o_ts + h * args.o_hs;
      const T* dorow = dog + t * args.do_ts + h * args.do_hs;
#pragma unroll
      for (int c = rl * 8; c < D; c += kRowLanes * 8)
        sum += bwd_dot8<T>(*reinterpret_cast<const uint4*>(orow + c), *reinterpret_cast<const uint4*>(dorow + c));
    }
#pragma unroll
    for (int off = kRowLanes / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (r < rows && rl == 0) {
      if (args.dlse != nullptr) sum -= args.dlse[h * args.dlse_hs + t];
      args.delta[static_cast<int64_t>(h) * args.layout.num_tokens + t] = sum;
    }
  }
}

// dQ = scale * the fp32 accumulator, 4 accumulator columns a thread: one 16-byte load and one 8-byte
// store, or in quad order two 4-byte stores (physical columns 16g + 4t' .. + 3 hold the pairs of
// logical columns 16g + 2t' and 16g + 8 + 2t'). dq's rows start on 16 bytes (dispatch.cu
// check_rows). Before 2026-12-05: 2 columns a thread and a 64-bit division by H per pair, 0.64 ms
// for D 128 on the long-responses class (H200).
// The accumulator's column order: kDqQuadOrder (the portable backward) keeps each 16-column group in
// mma.sync fragment quads, column 8b + 2t + e at 4t + 2b + e, so that a lane's four values of an
// accumulator row (columns 2t, 2t + 1 of both n8 blocks) are one 16-byte atomic (sm80/ptx.cuh
// atomic_add_quad); the Hopper kernels' is column order. Column pairs (e = 0, 1) stay adjacent
// either way.
template <int D, typename T, bool kDqQuadOrder>
__global__ void bwd_dq_convert_kernel(const BwdArgs args) {
  using Ops = Convert<T>;
  const int H = args.num_heads;
  const int64_t rows = static_cast<int64_t>(args.layout.num_tokens) * H;
  const bool small = rows <= static_cast<int64_t>(UINT32_MAX);
  const int64_t n = rows * (D / 4);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / (D / 4);
    const int d = static_cast<int>(i % (D / 4)) * 4;  // physical column of the accumulator
    int32_t t;
    int h;
    bwd_token_head(row, H, small, &t, &h);
    T* out = static_cast<T*>(args.dq) + t * args.dq_ts + h * args.dq_hs;
    const float4 v = *reinterpret_cast<const float4*>(args.dq_accum + row * D + d);
    const uint32_t lo = Ops::pack(v.x * args.scale, v.y * args.scale);
    const uint32_t hi = Ops::pack(v.z * args.scale, v.w * args.scale);
    if constexpr (kDqQuadOrder) {
      const int g = d & ~15, tq = (d & 15) >> 2;
      *reinterpret_cast<uint32_t*>(out + g + 2 * tq) = lo;
      *reinterpret_cast<uint32_t*>(out + g + 8 + 2 * tq) = hi;
    } else {
      *reinterpret_cast<uint2*>(out + d) = make_uint2(lo, hi);
    }
  }
}

// kPrefix (external prefix, issue 17): the plan may reduce prefix items, whose sums are ADDED into
// prefix_dk / prefix_dv (the caller's value plus the fp32 sum, rounded once).
// kRowChunks (plans cut to a sliding window, issue 16): each (reduction, KV head) is shared by
// kRowChunks blocks, each summing BN / kRowChunks of its rows (the same slots in the same order:
// the same bits). A windowed plan has few split tiles, each with many slots (one per child range
// its window reaches: 8 tiles of 17 slots for a prompt and 16 responses under W = 1024), so one
// block per (tile, head) left most SMs idle while the others read 17 x 128 KiB each
// (docs/notes/2026-12-02-window-bwd.md). 1: the kernel as before (bwd_reduce_kernel).
template <int D, typename T, bool kPrefix, int kRowChunks>
__device__ __forceinline__ void bwd_reduce(const BwdArgs& args) {
  using Ops = Convert<T>;
  constexpr int BN = plan_tiles(D).bwd_block_n;
  const int32_t* plan = args.plan;
  const LayoutPtrs& L = args.layout;
  if (!plan_matches(plan, L))
    return;
  const int32_t n_red = plan[kHdrNumRed];
  const int32_t* items = plan + plan[kHdrRedOffset];
  const int Hk = args.num_kv_heads;
  static_assert(BN % kRowChunks == 0, "bwd_reduce: row chunks must divide the KV tile");
  constexpr int kChunkRows = BN / kRowChunks;
  for (int64_t work = blockIdx.x; work < static_cast<int64_t>(n_red) * Hk * kRowChunks; work += gridDim.x) {
    const int64_t item = work / kRowChunks;
    const int32_t* it = items + (item / Hk) * kRedItemInts;
    const int hk = static_cast<int>(item % Hk);
    const int32_t k0 = it[1], k1 = it[2], slot0 = it[3], nsplit = it[4];
    const int klen = k1 - k0;
    // This block's (row, column pair) elements: rows [chunk kChunkRows, +kChunkRows) of the tile.
    const int chunk = static_cast<int>(work % kRowChunks);
    const int first = chunk * kChunkRows * (D / 2);
    const int end = kRowChunks == 1 ? klen * (D / 2) : min(klen, (chunk + 1) * kChunkRows) * (D / 2);
    for (int i = first + threadIdx.x; i < end; i += blockDim.x) {
      const int row = i / (D / 2), d = (i % (D / 2)) * 2;
      float2 sk = make_float2(0.f, 0.f), sv = make_float2(0.f, 0.f);
      for (int s = 0; s < nsplit; ++s) {  // fixed order: deterministic
        const float* base = args.partials + ((static_cast<int64_t>(slot0 + s) * Hk + hk) * 2) * BN * D;
        const float2 a = *reinterpret_cast<const float2*>(base + row * D + d);
        const float2 b = *reinterpret_cast<const float2*>(base + BN * D + row * D + d);
        sk.x += a.x; sk.y += a.y; sv.x += b.x; sv.y += b.y;
      }
      if constexpr (kPrefix) {
        if (is_prefix_item(L, it[0])) {
          uint32_t* pk = reinterpret_cast<uint32_t*>(static_cast<T*>(args.prefix_dk) + (k0 + row) * args.pdk_ts +
                                                     hk * args.pdk_hs + d);
          uint32_t* pv = reinterpret_cast<uint32_t*>(static_cast<T*>(args.prefix_dv) + (k0 + row) * args.pdv_ts +
                                                     hk * args.pdv_hs + d);
          const float2 ok = Ops::unpack(*pk), ov = Ops::unpack(*pv);
          *pk = Ops::pack(ok.x + sk.x * args.scale, ok.y + sk.y * args.scale);
          *pv = Ops::pack(ov.x + sv.x, ov.y + sv.y);
          continue;
        }
      }
      *reinterpret_cast<uint32_t*>(static_cast<T*>(args.dk) + (k0 + row) * args.dk_ts + hk * args.dk_hs + d) =
          Ops::pack(sk.x * args.scale, sk.y * args.scale);
      *reinterpret_cast<uint32_t*>(static_cast<T*>(args.dv) + (k0 + row) * args.dv_ts + hk * args.dv_hs + d) =
          Ops::pack(sv.x, sv.y);
    }
  }
}

template <int D, typename T, bool kPrefix>
__global__ void bwd_reduce_kernel(const BwdArgs args) {
  bwd_reduce<D, T, kPrefix, 1>(args);
}
// A windowed plan's reductions, kRowChunks blocks per (tile, head) (a kernel of its own: the
// plain one keeps its name and code).
template <int D, typename T, int kRowChunks>
__global__ void bwd_reduce_rows_kernel(const BwdArgs args) {
  bwd_reduce<D, T, false, kRowChunks>(args);
}

// d loss / d sink_h = -sum_t sink_probability(sink_h, lse[h, t]) delta[h, t], one block per head:
// each thread sums a fixed stride of rows, then a fixed tree over the threads, so the result is
// the same bits on every run (no atomics; the deterministic flag needs nothing more).
// (A template, as every kernel of this header, only so that each unit's copy is its own.)
constexpr int kDsinksThreads = 256;
template <int D, typename T>
__global__ void __launch_bounds__(kDsinksThreads) bwd_dsinks_kernel(const BwdArgs args) {
  __shared__ float part[kDsinksThreads];
  const int h = blockIdx.x;
  const int32_t T_ = args.layout.num_tokens;
  const float sink = args.sinks[h];
  const float* lse = args.lse + static_cast<int64_t>(h) * args.lse_hs;
  const float* delta = args.delta + static_cast<int64_t>(h) * T_;
  float sum = 0.f;
  for (int32_t t = threadIdx.x; t < T_; t += kDsinksThreads) sum += sink_probability(sink, lse[t]) * delta[t];
  part[threadIdx.x] = sum;
  __syncthreads();
  for (int n = kDsinksThreads / 2; n > 0; n >>= 1) {
    if (threadIdx.x < n) part[threadIdx.x] += part[threadIdx.x + n];
    __syncthreads();
  }
  if (threadIdx.x == 0) args.dsinks[h] = -part[0];
}

// The work counters (counters[0..3]: every arch's main and dQ kernels') and, unless deterministic,
// the fp32 dQ accumulator of `dq_bytes`, zeroed on `stream`: one memset when the accumulator
// follows the counters' 256 bytes (the workspace's order, dispatch.cu), else one each (a memset is
// a launch of its own: its host time counts per call).
inline cudaError_t zero_counters_and_dq_accum(const BwdArgs& args, size_t dq_bytes, cudaStream_t stream) {
  if (args.deterministic) return cudaMemsetAsync(args.counters, 0, 4 * sizeof(int32_t), stream);
  if (reinterpret_cast<const char*>(args.dq_accum) == reinterpret_cast<const char*>(args.counters) + kBwdCounterBytes)
    return cudaMemsetAsync(args.counters, 0, kBwdCounterBytes + dq_bytes, stream);
  cudaError_t err;
  if ((err = cudaMemsetAsync(args.counters, 0, 4 * sizeof(int32_t), stream)) != cudaSuccess) return err;
  return cudaMemsetAsync(args.dq_accum, 0, dq_bytes, stream);
}

template <int D, typename T>
cudaError_t launch_bwd_preprocess(const BwdArgs& args, int sms, cudaStream_t stream) {
  cudaError_t err;
  const int64_t T_ = args.layout.num_tokens;
  if ((err = zero_counters_and_dq_accum(args, sizeof(float) * T_ * args.num_heads * D, stream)) != cudaSuccess)
    return err;
  const int64_t rows = T_ * args.num_heads;
  constexpr int64_t kRowsPerBlock = 8 * bwd_preprocess_rows_per_warp(D);  // 8 warps
  const int blocks = static_cast<int>(
      std::min<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, static_cast<int64_t>(sms) * 16));
  bwd_preprocess_kernel<D, T><<<blocks, 256, 0, stream>>>(args);
  if (args.sinks != nullptr) {  // mask modifiers (issue 16): from delta, just computed
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    bwd_dsinks_kernel<D, T><<<args.num_heads, kDsinksThreads, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

// kWindowedPlan: the plan is cut to a sliding window (the kernels' Mods::kWindow): its split tiles
// are reduced in row chunks (bwd_reduce_rows_kernel). kDqQuadOrder: the main kernel accumulated dQ
// in quad order (bwd_dq_convert_kernel's comment: the accumulator's column order).
template <int D, typename T, bool kWindowedPlan, bool kDqQuadOrder>
cudaError_t launch_bwd_postprocess(const BwdArgs& args, int sms, cudaStream_t stream) {
  cudaError_t err;
  if (!args.deterministic) {
    const int64_t quads = static_cast<int64_t>(args.layout.num_tokens) * args.num_heads * (D / 4);
    const int blocks = static_cast<int>(std::min<int64_t>((quads + 255) / 256, static_cast<int64_t>(sms) * 32));
    bwd_dq_convert_kernel<D, T, kDqQuadOrder><<<blocks, 256, 0, stream>>>(args);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (args.n_slots > 0) {
    if constexpr (kWindowedPlan) {  // a window with external prefixes is refused (api.cpp)
      // Chunks of 16 rows (8 per 128-row tile): 1024 column pairs at D = 128, 4 per thread.
      constexpr int kChunks = plan_tiles(D).bwd_block_n >= 16 ? plan_tiles(D).bwd_block_n / 16 : 1;
      bwd_reduce_rows_kernel<D, T, kChunks><<<sms * 4, 256, 0, stream>>>(args);
    } else if (args.prefix_k != nullptr) {  // external prefix (issue 17)
      bwd_reduce_kernel<D, T, true><<<sms * 4, 256, 0, stream>>>(args);
    } else {
      bwd_reduce_kernel<D, T, false><<<sms * 4, 256, 0, stream>>>(args);
    }
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace dualkv::cuda
