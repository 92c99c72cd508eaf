// Forward kernel (sm80+ mma.sync path): one CTA works through (query tile, head) items taken from
// the plan in longest-work-first order. A query tile lies inside one segment s; it visits the KV
// tiles of every proper ancestor of s (full rectangles, masked only at a ragged end) and then the
// KV tiles of s up to its last query (causal mask on the diagonal tiles). Online softmax in fp32.
#pragma once

#include <cuda_runtime.h>
#include <math_constants.h>

#include "common.cuh"
#include "kv_walker.cuh"
#include "kernel_params.h"
#include "plan.h"

namespace dualkv::cuda {

template <int D, typename T>
struct FwdSmem {
  using C = FwdConfig<D>;
  T q[C::kBlockM * C::kPitch];
  T k[C::kBlockN * C::kPitch];
  T v[C::kBlockN * C::kPitch];
};

template <int D, typename T>
__global__ void __launch_bounds__(FwdConfig<D>::kThreads, 1)
fwd_kernel(const FwdArgs args) {
  using C = FwdConfig<D>;
  using Ops = TypeOps<T>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, P = C::kPitch, NT = C::kThreads, MI = C::kMI;
  constexpr int kNB = BN / 8;  // n8 blocks of S
  constexpr int kDB = D / 8;   // n8 blocks of O

  extern __shared__ __align__(16) unsigned char smem_raw[];
  FwdSmem<D, T>& sm = *reinterpret_cast<FwdSmem<D, T>*>(smem_raw);
  __shared__ int32_t s_item;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const LayoutPtrs& L = args.layout;
  const int32_t* plan = args.plan;
  if (plan[kHdrMagic] != kPlanMagic || plan[kHdrS] != L.num_segments || plan[kHdrT] != L.num_tokens)
    return;
  const int32_t n_tiles = plan[kHdrNumFwd];
  const int32_t* items = plan + plan[kHdrFwdOffset];
  const int H = args.num_heads;
  const int group = H / args.num_kv_heads;
  const int64_t n_items = static_cast<int64_t>(n_tiles) * H;

  const T* __restrict__ qg = static_cast<const T*>(args.q);
  const T* __restrict__ kg = static_cast<const T*>(args.k);
  const T* __restrict__ vg = static_cast<const T*>(args.v);
  T* __restrict__ og = static_cast<T*>(args.out);
  const int warp_row0 = warp * 16 * MI;  // first tile row of this warp

  while (true) {
    __syncthreads();  // the previous item is done with smem and s_item
    if (tid == 0) s_item = atomicAdd(args.counter, 1);
    __syncthreads();
    const int64_t item = s_item;
    if (item >= n_items) break;
    const int32_t tile = static_cast<int32_t>(item / H);
    const int h = static_cast<int>(item % H);
    const int hk = h / group;
    const int32_t seg = items[tile * kFwdItemInts + 0];
    const int32_t q0 = items[tile * kFwdItemInts + 1];
    const int32_t q1 = items[tile * kFwdItemInts + 2];

    const T* kh = kg + hk * args.k_hs;
    const T* vh = vg + hk * args.v_hs;

    KvWalker<BN> it;
    it.init(L, seg, q1);
    load_tile_async<D, BM, P, NT>(sm.q, qg + h * args.q_hs + static_cast<int64_t>(q0) * args.q_ts, args.q_ts,
                                  q1 - q0, tid);
    load_tile_async<D, BN, P, NT>(sm.k, kh + static_cast<int64_t>(it.pos) * args.k_ts, args.k_ts, it.len(), tid);
    cp_async_commit();

    float acc[MI][kDB][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int j = 0; j < kDB; ++j) acc[mi][j][0] = acc[mi][j][1] = acc[mi][j][2] = acc[mi][j][3] = 0.f;
    float row_max[MI][2], row_sum[MI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int r = 0; r < 2; ++r) { row_max[mi][r] = -CUDART_INF_F; row_sum[mi][r] = 0.f; }

    cp_async_wait_all();
    __syncthreads();

    bool more = true;
    while (more) {
      const int32_t kpos = it.pos, klen = it.len();
      const bool own = it.own;
      // V of this KV tile streams in while S is computed.
      load_tile_async<D, BN, P, NT>(sm.v, vh + static_cast<int64_t>(kpos) * args.v_ts, args.v_ts, klen, tid);
      cp_async_commit();

      float s[MI][kNB][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int j = 0; j < kNB; ++j) s[mi][j][0] = s[mi][j][1] = s[mi][j][2] = s[mi][j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) ldmatrix_x4(a[mi], a_frag_addr(sm.q, P, warp_row0 + mi * 16, kk * 16, lane));
#pragma unroll
        for (int nb = 0; nb < BN / 16; ++nb) {
          uint32_t b[4];
          ldmatrix_x4(b, bnk_frag_addr(sm.k, P, nb * 16, kk * 16, lane));
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            Ops::mma(s[mi][2 * nb], a[mi], b[0], b[1]);
            Ops::mma(s[mi][2 * nb + 1], a[mi], b[2], b[3]);
          }
        }
      }

      // Masking: ragged KV tile end, and the causal diagonal of the query's own segment.
      const bool need_mask = klen < BN || (own && kpos + BN - 1 > q0 + warp_row0);
      if (need_mask) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int j = 0; j < kNB; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int col = j * 8 + 2 * t4 + (e & 1);
              const int32_t qi = q0 + warp_row0 + mi * 16 + g + (e >> 1) * 8;
              if (col >= klen || (own && kpos + col > qi)) s[mi][j][e] = -CUDART_INF_F;
            }
      }

      // Online softmax (exp2 with the scale folded in).
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = row_max[mi][r];
#pragma unroll
          for (int j = 0; j < kNB; ++j) mx = fmaxf(mx, fmaxf(s[mi][j][2 * r], s[mi][j][2 * r + 1]));
          mx = warp_max4(mx);
          const float m_scaled = mx == -CUDART_INF_F ? 0.f : mx * args.scale_log2;
          const float alpha = exp2f(row_max[mi][r] * args.scale_log2 - m_scaled);
          row_max[mi][r] = mx;
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < kNB; ++j) {
            s[mi][j][2 * r] = exp2f(s[mi][j][2 * r] * args.scale_log2 - m_scaled);
            s[mi][j][2 * r + 1] = exp2f(s[mi][j][2 * r + 1] * args.scale_log2 - m_scaled);
            sum += s[mi][j][2 * r] + s[mi][j][2 * r + 1];
          }
          row_sum[mi][r] = row_sum[mi][r] * alpha + sum;
#pragma unroll
          for (int j = 0; j < kDB; ++j) {
            acc[mi][j][2 * r] *= alpha;
            acc[mi][j][2 * r + 1] *= alpha;
          }
        }

      cp_async_wait_all();
      __syncthreads();  // V landed; every warp is done reading K
      more = it.next(L);
      if (more) {
        load_tile_async<D, BN, P, NT>(sm.k, kh + static_cast<int64_t>(it.pos) * args.k_ts, args.k_ts, it.len(), tid);
        cp_async_commit();
      }

      // O += P V
      mma_frags_times_smem<T, MI, BN, D>(acc, s, sm.v, P, lane);
      cp_async_wait_all();
      __syncthreads();  // next K landed; every warp is done reading V
    }

    // Epilogue: normalise, write out and lse.
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float total = warp_sum4(row_sum[mi][r]);
        const float inv = total > 0.f ? 1.f / total : 0.f;
        const int32_t qi = q0 + warp_row0 + mi * 16 + g + r * 8;
        if (qi < q1) {
          T* orow = og + static_cast<int64_t>(qi) * args.o_ts + h * args.o_hs;
#pragma unroll
          for (int j = 0; j < kDB; ++j) {
            *reinterpret_cast<uint32_t*>(orow + j * 8 + 2 * t4) =
                Ops::pack(acc[mi][j][2 * r] * inv, acc[mi][j][2 * r + 1] * inv);
          }
          if (args.lse != nullptr && t4 == 0) {
            const float lse = total > 0.f ? row_max[mi][r] * args.scale + logf(total) : CUDART_INF_F;
            args.lse[h * args.lse_hs + qi] = lse;
          }
        }
      }
  }
}

template <int D, typename T>
cudaError_t launch_fwd_impl(const FwdArgs& args, int sms, cudaStream_t stream) {
  using C = FwdConfig<D>;
  const size_t smem = sizeof(FwdSmem<D, T>);
  auto kernel = fwd_kernel<D, T>;
  static int blocks_per_sm = [&] {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, C::kThreads, smem) != cudaSuccess || n < 1)
      n = 1;
    return n;
  }();
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  if ((err = cudaMemsetAsync(args.counter, 0, sizeof(int32_t), stream)) != cudaSuccess) return err;
  kernel<<<sms * blocks_per_sm, C::kThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace dualkv::cuda
