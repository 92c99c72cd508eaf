// Portable (sm80+, mma.sync) dQ kernel of the deterministic backward: query-tile-outer, the same
// walk over the visible KV tiles as the forward (the plan's forward items), P and dS recomputed,
// dQ accumulated in registers: no atomics, so dQ is bit-identical run to run. The Hopper backward
// uses it too in deterministic mode.
#pragma once

#include <cuda_runtime.h>
#include <math_constants.h>

#include <type_traits>

#include "dualkv/mask.h"
#include "kernel_params.h"
#include "modifiers.cuh"
#include "launch.h"
#include "plan_reader.cuh"
#include "sm80/config.h"
#include "sm80/ptx.cuh"

namespace dualkv::cuda::sm80 {

template <int D, int BM, typename T>
struct DqSmem {
  using C = DqConfig<D, BM>;
  T q[C::kBlockM * C::kPitch];
  T dout[C::kBlockM * C::kPitch];
  T k[C::kBlockN * C::kPitch];
  T v[C::kBlockN * C::kPitch];
};
// D split over warp pairs (DqConfig::kDSplit = 2, D = 512): each warp's partial S and dP (its half
// of D's sums) for its partner, as [warp][S, dP][fragment register][lane].
template <int D, int BM, typename T>
struct DqSmemSplit : DqSmem<D, BM, T> {
  using C = DqConfig<D, BM>;
  float part[C::kWarps][2][C::kMI * (C::kBlockN / 8) * 4][32];
};
template <int D, int BM, typename T>
using DqSmemOf = std::conditional_t<DqConfig<D, BM>::kDSplit == 1, DqSmem<D, BM, T>, DqSmemSplit<D, BM, T>>;

// external prefix (issue 17): the K/V tile at the walk's position: the layout's K/V, or a prefix's
// rows (a CTA-uniform choice).
template <int D, int BM, int BN, typename T, typename Smem>
__device__ __forceinline__ void load_prefixed_kv(const KvWalk<BN>& it, const T* kh, const T* vh, int hk, int tid,
                                                 Smem& sm, const BwdArgs& args) {
  using C = DqConfig<D, BM>;
  using Tile = typename C::Tile;
  constexpr int NT = C::kThreads;
  if (it.prefix) {
    load_tile_async<D, BN, Tile, NT>(sm.k, static_cast<const T*>(args.prefix_k) + hk * args.pk_hs + it.pos * args.pk_ts,
                                  args.pk_ts, it.len(), tid);
    load_tile_async<D, BN, Tile, NT>(sm.v, static_cast<const T*>(args.prefix_v) + hk * args.pv_hs + it.pos * args.pv_ts,
                                  args.pv_ts, it.len(), tid);
  } else {
    load_tile_async<D, BN, Tile, NT>(sm.k, kh + it.pos * args.k_ts, args.k_ts, it.len(), tid);
    load_tile_async<D, BN, Tile, NT>(sm.v, vh + it.pos * args.v_ts, args.v_ts, it.len(), tid);
  }
}

// Mods: the mask modifiers compiled in (modifiers.cuh: only kSoftcap changes this kernel).
// kPrefix: the layout has external prefix segments (the walk's prefix tiles load from the prefix
// buffers); instantiated with NoModifiers only. The default instantiation is the kernel as it was
// before either.
template <int D, int kTileM, typename T, typename Mods = NoModifiers, bool kPrefix = false>
__global__ void __launch_bounds__(DqConfig<D, kTileM>::kThreads, 1)
bwd_dq_kernel(const BwdArgs args) {
  using C = DqConfig<D, kTileM>;
  using Ops = TypeOps<T>;
  using Tile = typename C::Tile;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, P = C::kPitch, NT = C::kThreads, MI = C::kMI;
  constexpr int kNB = BN / 8;
  // D split over warp pairs (kDS = 2 at D = 512, config.h): the warp's kWD columns of dQ; S and dP
  // summed from the pair's partial products.
  constexpr int kDS = C::kDSplit, kWD = C::kWarpD;
  constexpr int kDB = kWD / 8;

  extern __shared__ __align__(128) unsigned char smem_raw[];  // the symbol the other portable kernels align (smem_tile.cuh)
  DqSmemOf<D, kTileM, T>& sm = *reinterpret_cast<DqSmemOf<D, kTileM, T>*>(smem_raw);
  __shared__ int32_t s_item;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const LayoutPtrs& L = args.layout;
  const int32_t* plan = args.plan;
  if (!plan_matches(plan, L))
    return;
  const int32_t n_tiles = plan[kHdrNumFwd];
  const int32_t* items = plan + plan[kHdrFwdOffset];
  const int H = args.num_heads;
  const int group = H / args.num_kv_heads;
  const int64_t n_items = static_cast<int64_t>(n_tiles) * H;
  const int64_t T_ = L.num_tokens;
  const int warp_row0 = (kDS == 1 ? warp : warp % C::kRowWarps) * 16 * MI;
  const int dcol0 = kDS == 1 ? 0 : (warp / C::kRowWarps) * kWD;  // first column of the warp's part of D

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

    KvWalk<BN> it;
    // The sliding window (mask modifiers, issue 16): the walk from the tile's first position on.
    int32_t first_pos = 0;
    if constexpr (kPrefix) {
      it.init(L.offsets, L.parent, L.seg_prefix, L.prefix_offsets, seg, q1);
    } else if constexpr (Mods::kWindow) {
      first_pos = SegmentMask::window_first_position(L.offsets, L.position_offset, seg, q0, args.window);
      it.init_windowed(L.offsets, L.parent, L.position_offset, seg, q1, first_pos);
    } else {
      it.init(L.offsets, L.parent, seg, q1);
    }
    load_tile_async<D, BM, Tile, NT>(sm.q, static_cast<const T*>(args.q) + q0 * args.q_ts + h * args.q_hs,
                                  args.q_ts, q1 - q0, tid);
    load_tile_async<D, BM, Tile, NT>(sm.dout, static_cast<const T*>(args.dout) + q0 * args.do_ts + h * args.do_hs,
                                  args.do_ts, q1 - q0, tid);
    if constexpr (kPrefix) {
      load_prefixed_kv<D, BM, BN>(it, kh, vh, hk, tid, sm, args);
    } else {
      load_tile_async<D, BN, Tile, NT>(sm.k, kh + it.pos * args.k_ts, args.k_ts, it.len(), tid);
      load_tile_async<D, BN, Tile, NT>(sm.v, vh + it.pos * args.v_ts, args.v_ts, it.len(), tid);
    }
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
      const int32_t kpos = it.pos, krem = it.rest();
      const bool own = it.own;
      float s[MI][kNB][4], dp[MI][kNB][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int j = 0; j < kNB; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mi][j][e] = dp[mi][j][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kWD / 16; ++kk) {
        uint32_t aq[MI][4], ao[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          ldmatrix_x4(aq[mi], a_frag_addr(sm.q, P, warp_row0 + mi * 16, dcol0 + kk * 16, lane));
          ldmatrix_x4(ao[mi], a_frag_addr(sm.dout, P, warp_row0 + mi * 16, dcol0 + kk * 16, lane));
        }
#pragma unroll
        for (int nb = 0; nb < BN / 16; ++nb) {
          uint32_t b[4];
          ldmatrix_x4(b, bnk_frag_addr(sm.k, P, nb * 16, dcol0 + kk * 16, lane));
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            Ops::mma(s[mi][2 * nb], aq[mi], b[0], b[1]);
            Ops::mma(s[mi][2 * nb + 1], aq[mi], b[2], b[3]);
          }
          ldmatrix_x4(b, bnk_frag_addr(sm.v, P, nb * 16, dcol0 + kk * 16, lane));
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            Ops::mma(dp[mi][2 * nb], ao[mi], b[0], b[1]);
            Ops::mma(dp[mi][2 * nb + 1], ao[mi], b[2], b[3]);
          }
        }
      }
      if constexpr (kDS > 1) {
        // D split: S and dP = own partial + the partner's (the same sums in both warps). The
        // partner's write of the next tile follows the barrier after dQ, after every read here.
        exchange_split_partial<false, MI, kNB>(sm.part[warp], lane, s, dp);
        __syncthreads();
        const int partner = (warp + C::kRowWarps) % C::kWarps;
        exchange_split_partial<true, MI, kNB>(sm.part[partner], lane, s, dp);
      }
      const int32_t q_last = min(q0 + warp_row0 + 16 * MI, q1) - 1;
      const bool need_mask = SegmentMask::fwd_ragged(krem, BN) ||
                             SegmentMask::fwd_diagonal(kpos, krem, own, q0 + warp_row0, q_last, BN);
      int32_t cols[MI][2];
      fwd_visible_cols_of_rows<MI>(cols, kpos, krem, own, q0 + warp_row0, g);
      // The sliding window (issue 16): pos(q) - pos(k) = (q - k) + shift for the walk's range.
      int32_t shift = 0;
      bool need_window = false;
      if constexpr (Mods::kWindow) {
        shift = SegmentMask::window_shift(L.offsets, L.position_offset, seg, it.cur);
        need_window = SegmentMask::window_tile(q0 + warp_row0 + 16 * MI - 1, kpos, shift, args.window);
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int j = 0; j < kNB; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            float grad = 1.f;  // softcap (mask modifiers, issue 16): the cap's derivative
            if constexpr (Mods::kSoftcap) {
              const SoftcapFromExp c = softcap_of(s[mi][j][e], args);
              s[mi][j][e] = c.score(args.softcap);
              grad = c.grad();
            }
            float p = exp2f(s[mi][j][e] * Mods::score_log2(args) - lse2[mi][r]);
            if (need_mask && j * 8 + 2 * t4 + (e & 1) >= cols[mi][r]) p = 0.f;
            if constexpr (Mods::kWindow) {
              if (need_window) {
                const int col = j * 8 + 2 * t4 + (e & 1);
                const int32_t qi = q0 + warp_row0 + mi * 16 + g + r * 8;
                if (SegmentMask::window_hidden(kpos + col, qi, shift, args.window)) p = 0.f;
              }
            }
            if constexpr (Mods::kSoftcap) p *= grad;
            s[mi][j][e] = p * (dp[mi][j][e] - dl[mi][r]);  // dS
          }
      // dQ += dS K
      mma_frags_times_smem<T, MI, BN, kWD>(acc, s, sm.k + dcol0, P, lane);
      __syncthreads();  // everyone is done with K and V
      if constexpr (kPrefix) more = it.next(L.offsets, L.parent, L.seg_prefix, L.prefix_offsets);
      else if constexpr (Mods::kWindow) more = it.next_windowed(L.offsets, L.parent, L.position_offset, first_pos);
      else more = it.next(L.offsets, L.parent);
      if (more) {
        if constexpr (kPrefix) {
          load_prefixed_kv<D, BM, BN>(it, kh, vh, hk, tid, sm, args);
        } else {
          load_tile_async<D, BN, Tile, NT>(sm.k, kh + it.pos * args.k_ts, args.k_ts, it.len(), tid);
          load_tile_async<D, BN, Tile, NT>(sm.v, vh + it.pos * args.v_ts, args.v_ts, it.len(), tid);
        }
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
          T* row = static_cast<T*>(args.dq) + qi * args.dq_ts + h * args.dq_hs + dcol0 + 2 * t4;
#pragma unroll
          for (int j = 0; j < kDB; ++j)
            *reinterpret_cast<uint32_t*>(row + j * 8) =
                Ops::pack(acc[mi][j][2 * r] * args.scale, acc[mi][j][2 * r + 1] * args.scale);
        }
      }
  }
}

template <int D, int kTileM, typename T, typename Mods>
cudaError_t launch_bwd_dq_tiles(const BwdArgs& args, int sms, cudaStream_t stream) {
  constexpr int kThreads = DqConfig<D, kTileM>::kThreads;
  constexpr size_t kSmem = sizeof(DqSmemOf<D, kTileM, T>);
  if (args.prefix_k != nullptr) {  // external prefix (issue 17): instantiated without modifiers only
    if constexpr (std::is_same_v<Mods, NoModifiers>)
      return launch_on_sms<bwd_dq_kernel<D, kTileM, T, Mods, true>>(kThreads, kSmem, sms, args, stream);
    else
      return cudaErrorNotSupported;  // api.cpp refuses a modifier with external prefixes first
  }
  return launch_on_sms<bwd_dq_kernel<D, kTileM, T, Mods, false>>(kThreads, kSmem, sms, args, stream);
}

// The kernel built for the plan's query tiles (args.fwd_block_m, config.h with_plan_tile).
template <int D, typename T, typename Mods>
cudaError_t launch_bwd_dq(const BwdArgs& args, int sms, cudaStream_t stream) {
  return with_plan_tile<D>(args.fwd_block_m, [&](auto m) {
    return launch_bwd_dq_tiles<D, decltype(m)::value, T, Mods>(args, sms, stream);
  });
}

// Shared memory of the dQ kernel that takes the plan's query tiles.
template <int D, typename T>
size_t bwd_dq_smem(int fwd_block_m) {
  return with_plan_tile<D>(fwd_block_m, [](auto m) { return sizeof(DqSmemOf<D, decltype(m)::value, T>); });
}

}  // namespace dualkv::cuda::sm80
