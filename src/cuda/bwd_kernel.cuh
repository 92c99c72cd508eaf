// Backward kernels (sm80+ mma.sync path).
//
//   1. preprocess:  delta[h, t] = sum_d dO * O - dlse                      (one warp per row)
//   2. kv kernel:   KV-tile-outer. A KV tile [k0, k1) of segment s is seen exactly by the
//                   queries [k0, subtree_token_end(s)) (its own causal queries, then every
//                   descendant's tokens, contiguous in DFS order) with the single mask k <= q.
//                   dK/dV accumulate in registers over that range and over the H/Hk query heads
//                   of the KV head (GQA summed in fp32), so no atomics touch dK/dV. Very long
//                   ranges are split into work items writing fp32 partials, reduced in a fixed
//                   order by (4). In the default mode dQ is accumulated by fp32 atomics.
//   3. dq kernel:   deterministic mode only: query-tile-outer recomputation of dQ (no atomics),
//                   or the fp32 -> dtype conversion of the atomic accumulator in default mode.
//   4. reduce:      fixed-order sum of split partials into dK/dV.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <math_constants.h>

#include "common.cuh"
#include "fwd_kernel.cuh"
#include "kernel_params.h"
#include "plan.h"

namespace dualkv::cuda {

template <int D, typename T>
__global__ void bwd_preprocess_kernel(const BwdArgs args) {
  using Ops = TypeOps<T>;
  const int lane = threadIdx.x & 31;
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t rows = static_cast<int64_t>(args.layout.num_tokens) * args.num_heads;
  const T* og = static_cast<const T*>(args.out);
  const T* dog = static_cast<const T*>(args.dout);
  for (int64_t r = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5); r < rows; r += warps_total) {
    const int32_t t = static_cast<int32_t>(r / args.num_heads);
    const int h = static_cast<int>(r % args.num_heads);
    const T* orow = og + t * args.o_ts + h * args.o_hs;
    const T* dorow = dog + t * args.do_ts + h * args.do_hs;
    float sum = 0.f;
    for (int d = lane * 2; d < D; d += 64) {
      const float2 o = Ops::unpack(*reinterpret_cast<const uint32_t*>(orow + d));
      const float2 dd = Ops::unpack(*reinterpret_cast<const uint32_t*>(dorow + d));
      sum += o.x * dd.x + o.y * dd.y;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) {
      if (args.dlse != nullptr) sum -= args.dlse[h * args.dlse_hs + t];
      args.delta[static_cast<int64_t>(h) * args.layout.num_tokens + t] = sum;
    }
  }
}

template <int D, typename T>
struct BwdSmem {
  using C = BwdConfig<D>;
  T k[C::kBlockN * C::kPitch];
  T v[C::kBlockN * C::kPitch];
  T q[C::kBlockM * C::kPitch];
  T dout[C::kBlockM * C::kPitch];
  T pt[C::kBlockN * C::kPitchS];   // P^T  [kv][q]
  T dst[C::kBlockN * C::kPitchS];  // dS^T [kv][q]
  float lse[C::kBlockM];           // lse * log2(e); +inf for rows past the range
  float delta[C::kBlockM];
};

template <int D, typename T, bool kAtomicDq>
__global__ void __launch_bounds__(BwdConfig<D>::kThreads, 1)
bwd_kv_kernel(const BwdArgs args) {
  using C = BwdConfig<D>;
  using Ops = TypeOps<T>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, P = C::kPitch, PS = C::kPitchS, NT = C::kThreads;
  constexpr int MI = C::kMI;
  constexpr int kWR = C::kWarps / 2;  // row groups of 16 * MI rows
  constexpr int kHalfD = D / 2;
  constexpr int kDB = kHalfD / 8;  // n8 blocks per warp for dK/dV (each warp owns D/2 columns)
  constexpr int MQ = C::kMQ, kDW = D / C::kDC, kQB = kDW / 8;  // phase-4 (dQ) warp tile
  static_assert(BM == 64 && kWR * 16 * MI == BN, "warp tiling");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  BwdSmem<D, T>& sm = *reinterpret_cast<BwdSmem<D, T>*>(smem_raw);
  __shared__ int32_t s_item;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int row0 = (warp % kWR) * 16 * MI;  // kv rows (phases 1, 3) or q rows (phase 4)
  const int wc = warp / kWR;                // q columns [32 wc, +32) in phase 1; D half in 3
  const int qrow0 = (warp % C::kQR) * 16 * MQ;  // phase 4: query rows
  const int dcol0 = (warp / C::kQR) * kDW;      // phase 4: d columns
  const LayoutPtrs& L = args.layout;
  const int32_t* plan = args.plan;
  if (plan[kHdrMagic] != kPlanMagic || plan[kHdrS] != L.num_segments || plan[kHdrT] != L.num_tokens)
    return;
  const int32_t n_work = plan[kHdrNumBwd];
  const int32_t* items = plan + plan[kHdrBwdOffset];
  const int H = args.num_heads, Hk = args.num_kv_heads;
  const int group = H / Hk;
  const int64_t n_items = static_cast<int64_t>(n_work) * Hk;
  const int64_t T_ = L.num_tokens;

  const T* __restrict__ qg = static_cast<const T*>(args.q);
  const T* __restrict__ kg = static_cast<const T*>(args.k);
  const T* __restrict__ vg = static_cast<const T*>(args.v);
  const T* __restrict__ dog = static_cast<const T*>(args.dout);

  while (true) {
    __syncthreads();
    if (tid == 0) s_item = atomicAdd(&args.counters[0], 1);
    __syncthreads();
    const int64_t item = s_item;
    if (item >= n_items) break;
    const int32_t w = static_cast<int32_t>(item / Hk);
    const int hk = static_cast<int>(item % Hk);
    const int32_t* wi = items + w * kBwdItemInts;
    const int32_t k0 = wi[1], k1 = wi[2], qa = wi[3], qb = wi[4], slot = wi[5];
    const int klen = k1 - k0;

    load_tile_async<D, BN, P, NT>(sm.k, kg + k0 * args.k_ts + hk * args.k_hs, args.k_ts, klen, tid);
    load_tile_async<D, BN, P, NT>(sm.v, vg + k0 * args.v_ts + hk * args.v_hs, args.v_ts, klen, tid);

    // Flattened loop over (query head of the group, query tile of [qa, qb)).
    const int tiles_per_head = (qb - qa + BM - 1) / BM;
    const int n_steps = tiles_per_head * group;
    auto issue_q = [&](int step) {
      const int h = hk * group + step / tiles_per_head;
      const int32_t qt = qa + (step % tiles_per_head) * BM;
      const int rows = min(BM, qb - qt);
      load_tile_async<D, BM, P, NT>(sm.q, qg + qt * args.q_ts + h * args.q_hs, args.q_ts, rows, tid);
      load_tile_async<D, BM, P, NT>(sm.dout, dog + qt * args.do_ts + h * args.do_hs, args.do_ts, rows, tid);
      cp_async_commit();
      for (int i = tid; i < BM; i += NT) {
        const bool valid = i < rows;
        sm.lse[i] = valid ? args.lse[h * args.lse_hs + qt + i] * kLog2e : CUDART_INF_F;
        sm.delta[i] = valid ? args.delta[h * T_ + qt + i] : 0.f;
      }
    };
    issue_q(0);

    float dk[MI][kDB][4], dv[MI][kDB][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int j = 0; j < kDB; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[mi][j][e] = dv[mi][j][e] = 0.f;

    cp_async_wait_all();
    __syncthreads();

    for (int step = 0; step < n_steps; ++step) {
      const int h = hk * group + step / tiles_per_head;
      const int32_t qt = qa + (step % tiles_per_head) * BM;

      // Phase 1: S^T = K Q^T and dP^T = V dO^T for kv rows [row0, +16 MI), q cols [32 wc, +32).
      {
        float st[MI][4][4], dpt[MI][4][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[mi][j][e] = dpt[mi][j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t ak[MI][4], av[MI][4];
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            ldmatrix_x4(ak[mi], a_frag_addr(sm.k, P, row0 + mi * 16, kk * 16, lane));
            ldmatrix_x4(av[mi], a_frag_addr(sm.v, P, row0 + mi * 16, kk * 16, lane));
          }
#pragma unroll
          for (int nb = 0; nb < 2; ++nb) {
            uint32_t b[4];
            ldmatrix_x4(b, bnk_frag_addr(sm.q, P, wc * 32 + nb * 16, kk * 16, lane));
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
              Ops::mma(st[mi][2 * nb], ak[mi], b[0], b[1]);
              Ops::mma(st[mi][2 * nb + 1], ak[mi], b[2], b[3]);
            }
            ldmatrix_x4(b, bnk_frag_addr(sm.dout, P, wc * 32 + nb * 16, kk * 16, lane));
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
              Ops::mma(dpt[mi][2 * nb], av[mi], b[0], b[1]);
              Ops::mma(dpt[mi][2 * nb + 1], av[mi], b[2], b[3]);
            }
          }
        }
        const bool need_mask = qt < k0 + BN - 1;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int col = wc * 32 + j * 8 + 2 * t4;
          const float l0 = sm.lse[col], l1 = sm.lse[col + 1];
          const float d0 = sm.delta[col], d1 = sm.delta[col + 1];
#pragma unroll
          for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
              const int row = row0 + mi * 16 + g + hr * 8;
              float p0 = exp2f(st[mi][j][2 * hr] * args.scale_log2 - l0);
              float p1 = exp2f(st[mi][j][2 * hr + 1] * args.scale_log2 - l1);
              if (need_mask) {
                if (k0 + row > qt + col) p0 = 0.f;
                if (k0 + row > qt + col + 1) p1 = 0.f;
              }
              const float ds0 = p0 * (dpt[mi][j][2 * hr] - d0);
              const float ds1 = p1 * (dpt[mi][j][2 * hr + 1] - d1);
              *reinterpret_cast<uint32_t*>(&sm.pt[row * PS + col]) = Ops::pack(p0, p1);
              *reinterpret_cast<uint32_t*>(&sm.dst[row * PS + col]) = Ops::pack(ds0, ds1);
            }
        }
      }
      __syncthreads();

      // Phase 3: dV += P^T dO, dK += dS^T Q for kv rows [row0, +16 MI), d cols [D/2 wc, +D/2).
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        uint32_t ap[MI][4], ads[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          ldmatrix_x4(ap[mi], a_frag_addr(sm.pt, PS, row0 + mi * 16, kk * 16, lane));
          ldmatrix_x4(ads[mi], a_frag_addr(sm.dst, PS, row0 + mi * 16, kk * 16, lane));
        }
#pragma unroll
        for (int nd = 0; nd < kDB / 2; ++nd) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, bkn_frag_addr(sm.dout, P, kk * 16, wc * kHalfD + nd * 16, lane));
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            Ops::mma(dv[mi][2 * nd], ap[mi], b[0], b[1]);
            Ops::mma(dv[mi][2 * nd + 1], ap[mi], b[2], b[3]);
          }
          ldmatrix_x4_trans(b, bkn_frag_addr(sm.q, P, kk * 16, wc * kHalfD + nd * 16, lane));
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            Ops::mma(dk[mi][2 * nd], ads[mi], b[0], b[1]);
            Ops::mma(dk[mi][2 * nd + 1], ads[mi], b[2], b[3]);
          }
        }
      }
      __syncthreads();  // Q, dO, lse, delta free for the next tile
      if (step + 1 < n_steps) issue_q(step + 1);

      if constexpr (kAtomicDq) {
        // Phase 4: dQ[q rows qrow0.., d cols dcol0..] += dS K, accumulated into fp32 by atomics.
        float dq[MQ][kQB][4];
#pragma unroll
        for (int mi = 0; mi < MQ; ++mi)
#pragma unroll
          for (int j = 0; j < kQB; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) dq[mi][j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
          uint32_t a[MQ][4];
#pragma unroll
          for (int mi = 0; mi < MQ; ++mi)
            ldmatrix_x4_trans(a[mi], at_frag_addr(sm.dst, PS, qrow0 + mi * 16, kk * 16, lane));
#pragma unroll
          for (int nd = 0; nd < kQB / 2; ++nd) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, bkn_frag_addr(sm.k, P, kk * 16, dcol0 + nd * 16, lane));
#pragma unroll
            for (int mi = 0; mi < MQ; ++mi) {
              Ops::mma(dq[mi][2 * nd], a[mi], b[0], b[1]);
              Ops::mma(dq[mi][2 * nd + 1], a[mi], b[2], b[3]);
            }
          }
        }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        // sm90: one 16-byte vector atomic per n8 block. Lanes t, t^1 swap halves so that the even
        // lane holds row g, cols [2t, 2t+4) and the odd lane row g+8, cols [2t-2, 2t+2).
        const bool odd = t4 & 1;
#pragma unroll
        for (int mi = 0; mi < MQ; ++mi) {
          const int32_t qi = qt + qrow0 + mi * 16 + g + (odd ? 8 : 0);
          const int col = dcol0 + 2 * t4 - (odd ? 2 : 0);
          float* dst = args.dq_accum + (static_cast<int64_t>(qi) * H + h) * D + col;
#pragma unroll
          for (int j = 0; j < kQB; ++j) {
            const float s0 = odd ? dq[mi][j][0] : dq[mi][j][2];
            const float s1 = odd ? dq[mi][j][1] : dq[mi][j][3];
            const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1);
            const float r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
            const float4 v = odd ? make_float4(r0, r1, dq[mi][j][2], dq[mi][j][3])
                                 : make_float4(dq[mi][j][0], dq[mi][j][1], r0, r1);
            if (qi < qb) atomicAdd(reinterpret_cast<float4*>(dst + j * 8), v);
          }
        }
#else
#pragma unroll
        for (int mi = 0; mi < MQ; ++mi)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const int32_t qi = qt + qrow0 + mi * 16 + g + hr * 8;
            if (qi < qb) {
              float* dst = args.dq_accum + (static_cast<int64_t>(qi) * H + h) * D + dcol0 + 2 * t4;
#pragma unroll
              for (int j = 0; j < kQB; ++j) {
                atomicAdd(dst + j * 8, dq[mi][j][2 * hr]);
                atomicAdd(dst + j * 8 + 1, dq[mi][j][2 * hr + 1]);
              }
            }
          }
#endif
      }
      cp_async_wait_all();
      __syncthreads();
    }

    // Epilogue: dK scaled by the softmax scale. Direct write, or an fp32 partial for a split.
    const int col0 = wc * kHalfD + 2 * t4;
    if (slot < 0) {
      T* dkb = static_cast<T*>(args.dk) + k0 * args.dk_ts + hk * args.dk_hs + col0;
      T* dvb = static_cast<T*>(args.dv) + k0 * args.dv_ts + hk * args.dv_hs + col0;
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int row = row0 + mi * 16 + g + hr * 8;
          const bool ok = row < klen;
#pragma unroll
          for (int j = 0; j < kDB; ++j) {
            if (ok) {
              *reinterpret_cast<uint32_t*>(dkb + row * args.dk_ts + j * 8) =
                  Ops::pack(dk[mi][j][2 * hr] * args.scale, dk[mi][j][2 * hr + 1] * args.scale);
              *reinterpret_cast<uint32_t*>(dvb + row * args.dv_ts + j * 8) =
                  Ops::pack(dv[mi][j][2 * hr], dv[mi][j][2 * hr + 1]);
            }
          }
        }
      }
    } else {
      float* base = args.partials + ((static_cast<int64_t>(slot) * Hk + hk) * 2) * BN * D + col0;
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int row = row0 + mi * 16 + g + hr * 8;
#pragma unroll
          for (int j = 0; j < kDB; ++j) {
            *reinterpret_cast<float2*>(base + row * D + j * 8) = make_float2(dk[mi][j][2 * hr], dk[mi][j][2 * hr + 1]);
            *reinterpret_cast<float2*>(base + BN * D + row * D + j * 8) =
                make_float2(dv[mi][j][2 * hr], dv[mi][j][2 * hr + 1]);
          }
        }
      }
    }
  }
}

// Deterministic dQ: query-tile-outer, same walk over visible KV tiles as the forward.
template <int D, typename T>
struct DqSmem {
  using C = DqConfig<D>;
  T q[C::kBlockM * C::kPitch];
  T dout[C::kBlockM * C::kPitch];
  T k[C::kBlockN * C::kPitch];
  T v[C::kBlockN * C::kPitch];
};

template <int D, typename T>
__global__ void __launch_bounds__(DqConfig<D>::kThreads, 1)
bwd_dq_kernel(const BwdArgs args) {
  using C = DqConfig<D>;
  using Ops = TypeOps<T>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, P = C::kPitch, NT = C::kThreads, MI = C::kMI;
  constexpr int kNB = BN / 8;
  constexpr int kDB = D / 8;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  DqSmem<D, T>& sm = *reinterpret_cast<DqSmem<D, T>*>(smem_raw);
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
  const int64_t T_ = L.num_tokens;
  const int warp_row0 = warp * 16 * MI;

  while (true) {
    __syncthreads();
    if (tid == 0) s_item = atomicAdd(&args.counters[1], 1);
    __syncthreads();
    const int64_t item = s_item;
    if (item >= n_items) break;
    const int32_t tile = static_cast<int32_t>(item / H);
    const int h = static_cast<int>(item % H);
    const int hk = h / group;
    const int32_t seg = items[tile * kFwdItemInts + 0];
    const int32_t q0 = items[tile * kFwdItemInts + 1];
    const int32_t q1 = items[tile * kFwdItemInts + 2];
    const T* kh = static_cast<const T*>(args.k) + hk * args.k_hs;
    const T* vh = static_cast<const T*>(args.v) + hk * args.v_hs;

    KvWalker<BN> it;
    it.init(L, seg, q1);
    load_tile_async<D, BM, P, NT>(sm.q, static_cast<const T*>(args.q) + q0 * args.q_ts + h * args.q_hs,
                                  args.q_ts, q1 - q0, tid);
    load_tile_async<D, BM, P, NT>(sm.dout, static_cast<const T*>(args.dout) + q0 * args.do_ts + h * args.do_hs,
                                  args.do_ts, q1 - q0, tid);
    load_tile_async<D, BN, P, NT>(sm.k, kh + it.pos * args.k_ts, args.k_ts, it.len(), tid);
    load_tile_async<D, BN, P, NT>(sm.v, vh + it.pos * args.v_ts, args.v_ts, it.len(), tid);
    cp_async_commit();

    float lse2[MI][2], dl[MI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int32_t qi = q0 + warp_row0 + mi * 16 + g + r * 8;
        const bool valid = qi < q1;
        lse2[mi][r] = valid ? args.lse[h * args.lse_hs + qi] * kLog2e : CUDART_INF_F;
        dl[mi][r] = valid ? args.delta[h * T_ + qi] : 0.f;
      }
    float acc[MI][kDB][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int j = 0; j < kDB; ++j) acc[mi][j][0] = acc[mi][j][1] = acc[mi][j][2] = acc[mi][j][3] = 0.f;

    cp_async_wait_all();
    __syncthreads();
    bool more = true;
    while (more) {
      const int32_t kpos = it.pos, klen = it.len();
      const bool own = it.own;
      float s[MI][kNB][4], dp[MI][kNB][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int j = 0; j < kNB; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mi][j][e] = dp[mi][j][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t aq[MI][4], ao[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          ldmatrix_x4(aq[mi], a_frag_addr(sm.q, P, warp_row0 + mi * 16, kk * 16, lane));
          ldmatrix_x4(ao[mi], a_frag_addr(sm.dout, P, warp_row0 + mi * 16, kk * 16, lane));
        }
#pragma unroll
        for (int nb = 0; nb < BN / 16; ++nb) {
          uint32_t b[4];
          ldmatrix_x4(b, bnk_frag_addr(sm.k, P, nb * 16, kk * 16, lane));
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            Ops::mma(s[mi][2 * nb], aq[mi], b[0], b[1]);
            Ops::mma(s[mi][2 * nb + 1], aq[mi], b[2], b[3]);
          }
          ldmatrix_x4(b, bnk_frag_addr(sm.v, P, nb * 16, kk * 16, lane));
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            Ops::mma(dp[mi][2 * nb], ao[mi], b[0], b[1]);
            Ops::mma(dp[mi][2 * nb + 1], ao[mi], b[2], b[3]);
          }
        }
      }
      const bool need_mask = klen < BN || (own && kpos + BN - 1 > q0 + warp_row0);
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int j = 0; j < kNB; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            float p = exp2f(s[mi][j][e] * args.scale_log2 - lse2[mi][r]);
            if (need_mask) {
              const int col = j * 8 + 2 * t4 + (e & 1);
              const int32_t qi = q0 + warp_row0 + mi * 16 + g + r * 8;
              if (col >= klen || (own && kpos + col > qi)) p = 0.f;
            }
            s[mi][j][e] = p * (dp[mi][j][e] - dl[mi][r]);  // dS
          }
      // dQ += dS K
      mma_frags_times_smem<T, MI, BN, D>(acc, s, sm.k, P, lane);
      __syncthreads();  // everyone is done with K and V
      more = it.next(L);
      if (more) {
        load_tile_async<D, BN, P, NT>(sm.k, kh + it.pos * args.k_ts, args.k_ts, it.len(), tid);
        load_tile_async<D, BN, P, NT>(sm.v, vh + it.pos * args.v_ts, args.v_ts, it.len(), tid);
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
      }
    }
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int32_t qi = q0 + warp_row0 + mi * 16 + g + r * 8;
        if (qi < q1) {
          T* row = static_cast<T*>(args.dq) + qi * args.dq_ts + h * args.dq_hs + 2 * t4;
#pragma unroll
          for (int j = 0; j < kDB; ++j)
            *reinterpret_cast<uint32_t*>(row + j * 8) =
                Ops::pack(acc[mi][j][2 * r] * args.scale, acc[mi][j][2 * r + 1] * args.scale);
        }
      }
  }
}

template <int D, typename T>
__global__ void bwd_dq_convert_kernel(const BwdArgs args) {
  using Ops = TypeOps<T>;
  const int64_t H = args.num_heads;
  const int64_t pairs = static_cast<int64_t>(args.layout.num_tokens) * H * (D / 2);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / (D / 2);
    const int d = static_cast<int>(i % (D / 2)) * 2;
    const int64_t t = row / H, h = row % H;
    const float2 v = *reinterpret_cast<const float2*>(args.dq_accum + row * D + d);
    *reinterpret_cast<uint32_t*>(static_cast<T*>(args.dq) + t * args.dq_ts + h * args.dq_hs + d) =
        Ops::pack(v.x * args.scale, v.y * args.scale);
  }
}

template <int D, typename T>
__global__ void bwd_reduce_kernel(const BwdArgs args) {
  using Ops = TypeOps<T>;
  constexpr int BN = BwdConfig<D>::kBlockN;
  const int32_t* plan = args.plan;
  const LayoutPtrs& L = args.layout;
  if (plan[kHdrMagic] != kPlanMagic || plan[kHdrS] != L.num_segments || plan[kHdrT] != L.num_tokens)
    return;
  const int32_t n_red = plan[kHdrNumRed];
  const int32_t* items = plan + plan[kHdrRedOffset];
  const int Hk = args.num_kv_heads;
  for (int64_t item = blockIdx.x; item < static_cast<int64_t>(n_red) * Hk; item += gridDim.x) {
    const int32_t* it = items + (item / Hk) * kRedItemInts;
    const int hk = static_cast<int>(item % Hk);
    const int32_t k0 = it[1], k1 = it[2], slot0 = it[3], nsplit = it[4];
    const int klen = k1 - k0;
    for (int i = threadIdx.x; i < klen * (D / 2); i += blockDim.x) {
      const int row = i / (D / 2), d = (i % (D / 2)) * 2;
      float2 sk = make_float2(0.f, 0.f), sv = make_float2(0.f, 0.f);
      for (int s = 0; s < nsplit; ++s) {  // fixed order: deterministic
        const float* base = args.partials + ((static_cast<int64_t>(slot0 + s) * Hk + hk) * 2) * BN * D;
        const float2 a = *reinterpret_cast<const float2*>(base + row * D + d);
        const float2 b = *reinterpret_cast<const float2*>(base + BN * D + row * D + d);
        sk.x += a.x; sk.y += a.y; sv.x += b.x; sv.y += b.y;
      }
      *reinterpret_cast<uint32_t*>(static_cast<T*>(args.dk) + (k0 + row) * args.dk_ts + hk * args.dk_hs + d) =
          Ops::pack(sk.x * args.scale, sk.y * args.scale);
      *reinterpret_cast<uint32_t*>(static_cast<T*>(args.dv) + (k0 + row) * args.dv_ts + hk * args.dv_hs + d) =
          Ops::pack(sv.x, sv.y);
    }
  }
}

template <typename Kernel>
int occupancy_blocks(Kernel kernel, int threads, size_t smem) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess || n < 1) n = 1;
  return n;
}

// The backward is prologue (zeroing, dO.O preprocess), the KV-outer main kernel, and epilogue
// (dQ: conversion of the fp32 accumulator or the deterministic dQ kernel; split reductions). The
// Hopper backward (sm90/bwd_sm90_launch.cuh) replaces only the main kernel and reuses the rest.
template <int D, typename T>
cudaError_t launch_bwd_prologue(const BwdArgs& args, int sms, cudaStream_t stream) {
  cudaError_t err;
  if ((err = cudaMemsetAsync(args.counters, 0, 4 * sizeof(int32_t), stream)) != cudaSuccess) return err;
  const int64_t T_ = args.layout.num_tokens;
  if (!args.deterministic) {
    if ((err = cudaMemsetAsync(args.dq_accum, 0, sizeof(float) * T_ * args.num_heads * D, stream)) != cudaSuccess)
      return err;
  }
  {
    const int64_t rows = T_ * args.num_heads;
    const int blocks = static_cast<int>(std::min<int64_t>((rows + 7) / 8, static_cast<int64_t>(sms) * 16));
    bwd_preprocess_kernel<D, T><<<blocks, 256, 0, stream>>>(args);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <int D, typename T>
cudaError_t launch_bwd_main(const BwdArgs& args, int sms, cudaStream_t stream) {
  cudaError_t err;
  {
    using C = BwdConfig<D>;
    const size_t smem = sizeof(BwdSmem<D, T>);
    if (args.deterministic) {
      auto kernel = bwd_kv_kernel<D, T, false>;
      static int bps = occupancy_blocks(kernel, C::kThreads, smem);
      if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem))))
        return err;
      kernel<<<sms * bps, C::kThreads, smem, stream>>>(args);
    } else {
      auto kernel = bwd_kv_kernel<D, T, true>;
      static int bps = occupancy_blocks(kernel, C::kThreads, smem);
      if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem))))
        return err;
      kernel<<<sms * bps, C::kThreads, smem, stream>>>(args);
    }
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <int D, typename T>
cudaError_t launch_bwd_epilogue(const BwdArgs& args, int sms, cudaStream_t stream) {
  cudaError_t err;
  const int64_t T_ = args.layout.num_tokens;
  if (args.deterministic) {
    using C = DqConfig<D>;
    const size_t smem = sizeof(DqSmem<D, T>);
    auto kernel = bwd_dq_kernel<D, T>;
    static int bps = occupancy_blocks(kernel, C::kThreads, smem);
    if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem))))
      return err;
    kernel<<<sms * bps, C::kThreads, smem, stream>>>(args);
  } else {
    const int64_t pairs = T_ * args.num_heads * (D / 2);
    const int blocks = static_cast<int>(std::min<int64_t>((pairs + 255) / 256, static_cast<int64_t>(sms) * 32));
    bwd_dq_convert_kernel<D, T><<<blocks, 256, 0, stream>>>(args);
  }
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if (args.n_slots > 0) {
    bwd_reduce_kernel<D, T><<<sms * 4, 256, 0, stream>>>(args);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <int D, typename T>
cudaError_t launch_bwd_impl(const BwdArgs& args, int sms, cudaStream_t stream) {
  cudaError_t err;
  if ((err = launch_bwd_prologue<D, T>(args, sms, stream)) != cudaSuccess) return err;
  if ((err = launch_bwd_main<D, T>(args, sms, stream)) != cudaSuccess) return err;
  return launch_bwd_epilogue<D, T>(args, sms, stream);
}

}  // namespace dualkv::cuda
