// Hopper dQ kernel of the backward that computes dQ query-outer (sm_90a; BwdArgs::deterministic: in
// deterministic mode, and at D 256 in every mode, dispatch.cu bwd_dq_query_outer): query-tile-outer,
// the forward's walk over the visible KV tiles (the plan's forward items), P and dP recomputed, dQ
// accumulated in registers and stored once: no atomics, so dQ is bit-identical run to run. It
// replaces the portable query-outer kernel (sm80/bwd_dq_kernel.cuh) on Hopper where it is built
// (arch.h bwd_dq_kernel_built).
//
// Why (docs/notes/2026-12-04-device-queue.md §0 item 5, measured 2026-12-06 on an H100, D 256, long
// responses): the deterministic main kernel, which computes S, dP, dV and dK but no dQ (4 of the
// backward's 5 GEMMs), took 33.4 ms, 0.43x the dQ-computing main kernel's 78.1 ms; its dQ path
// (dS staged, reduce-added into an fp32 accumulator) costs 44.7 ms for a fifth of the FLOPs. This
// kernel redoes S and dP (3 GEMMs per tile instead of 1) with the forward's machinery, so the
// backward is 7 GEMMs with no reduce traffic: on the same H100 fwd+bwd at D 256 then took 0.68-0.85x
// the dQ-accumulating backward's time on the four layout classes, this kernel 22.0 ms (~595 useful
// TFLOP/s) on long responses (docs/decisions.md).
//
//   warpgroup 0 (producer, 24 registers): one thread takes (query tile, head) items from the plan
//     through the atomic counter (counters[1], zeroed by the preprocess), hands them to the
//     consumers through a 2-slot ring, and issues the TMA loads: the item's first K tile, its Q and
//     dO tiles (one barrier), then per KV tile j of the walk V_j and K_{j+1}, K into kKStages
//     buffers, V into kVStages.
//   warpgroups 1 .. kConsumerWGs (consumers, 240 registers; 160 with three): 64 query rows each (the
//   plan's forward tile: two warpgroups, three at D 64 without a window). Per KV tile j:
//     dP_j = dO V_j^T and S_j = Q K_j^T (SS wgmma, m64 nBN, k D), issued together;
//     P_j = exp2(S_j scale log2e - lse log2e), masked as the forward masks; dS_j = P_j (dP_j - delta);
//     dQ += dS_j K_j (RS wgmma, dS from registers, K read N-major, m64 nD, k BN), retired before
//   the next tile's dP and S: the two warpgroups' GEMMs and exponentials interleave on their own.
//   Epilogue: dQ times the softmax scale, per-thread 16-byte stores (fwd_o_row_stg128).
//
// Barriers (mbarriers in smem; consumer releases are one arrival per warp after __syncwarp(), every
// thread's in the per-thread-release build, ptx.cuh kPerThreadRelease):
//   item_full[2] / item_empty[2]   work item hand-off
//   q_full / q_empty               Q and dO loaded / every consumer warp retired the item's last S
//                                  and dP (the only readers of Q and dO)
//   k_full[KS] / k_empty[KS]       K tile loaded / every consumer warp retired its S and dQ
//   v_full[VS] / v_empty[VS]       V tile loaded / every consumer warp retired its dP
// Tile j's K goes to stage j % KS and its V to j % VS by a running counter kept by producer and
// consumers alike; each wait is for the release of that buffer's previous use (parity of its use
// count), as in the forward.
//
// Mask modifiers (modifiers.cuh): the softcap caps S before the mask, as the forward does, and
// multiplies dS by the cap's derivative 1 - t^2 (t = capped score / c); the sliding window walks
// KvWalk's windowed walk from the item's first position and hides what the forward hides
// (dq_walk_init / dq_walk_next, the forward's mask_scores). Sinks change nothing here.
// Built for D 64, 128 and 256 (arch.h bwd_dq_kernel_built), and run without external prefixes: the
// others keep the portable kernel. At D 64 and 128 only the deterministic mode runs it (arch.h says why).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include <type_traits>

#include "convert.cuh"
#include "dualkv/mask.h"
#include "fwd_item_order.h"
#include "kernel_params.h"
#include "modifiers.cuh"
#include "plan_reader.cuh"
#include "sm90/arch.h"
#include "sm90/fwd_kernel.cuh"  // fwd_o_row_stg128: the D-256 forward's 16-byte row stores
#include "sm90/ptx.cuh"
#include "sm90/wgmma_ops.cuh"
#include "tile_size.h"

namespace dualkv::cuda::sm90 {

template <int D, bool Windowed>
struct Sm90DqConfig {
  static constexpr int kBlockM = fwd_block_m(D, TileFamily::kSm90, Windowed);  // the plan's forward tile
  static constexpr int kConsumerWGs = kBlockM / 64;
  // KV rows per tile: 48 at D 256 (FA4's backward tile there). The consumers hold dQ (64 x D fp32:
  // 128 registers at D 256), S and dP (BN / 2 each) and dS's fragments (BN / 4) while dQ_j runs
  // under the next tile's S and dP: with 64-row tiles ptxas spilled 134 bytes at 240 registers.
  static constexpr int kBlockN = D == 256 ? 48 : 64;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  // Three consumer warpgroups (D 64's 192-row tiles) hold dQ, S and dP of 64 x 64 (32 registers each)
  // and dS's fragments (16) in 160 registers, as the forward's three warpgroups do.
  static constexpr int kConsumerRegs = kConsumerWGs == 3 ? 160 : 240;
  static constexpr int kProducerRegs = 24;
  static_assert(kConsumerWGs == 2 || kConsumerWGs == 3, "sm90 dQ: two or three consumer warpgroups of 64 rows");
  static_assert(setmaxnreg_split_fits(kThreads, kProducerRegs, kConsumerRegs),
                "sm90 dQ: the consumers' setmaxnreg.inc would wait for registers the producer never returns");
  static constexpr uint32_t kQBytes = kBlockM * D * 2;   // Q (and dO) of one tile
  static constexpr uint32_t kKVBytes = kBlockN * D * 2;  // one K (or V) tile
  static constexpr uint32_t kQBoxBytes = kBlockM * 128;  // 64 columns x kBlockM rows, 128B swizzle
  static constexpr uint32_t kKVBoxBytes = kBlockN * 128;
  static constexpr int kBoxes = D / 64;
  // K is read by S and dQ, V only by dP: K gets two buffers, V two where they fit (with 64-row tiles
  // at D 256 only one would: Q and dO take 128 KiB of the 227).
  static constexpr int kKStages = 2;
  static constexpr int kVStages = 2 * kQBytes + 4 * kKVBytes + 2048 <= kSm90SmemOptinBytes ? 2 : 1;
  static constexpr uint32_t kOffDo = kQBytes;
  static constexpr uint32_t kOffK = 2 * kQBytes;
  static constexpr uint32_t kOffV = kOffK + kKStages * kKVBytes;
  static constexpr uint32_t kOffBar = kOffV + kVStages * kKVBytes;
  // k_full, k_empty [KS]; v_full, v_empty [VS]; q_full, q_empty; item_full[2], item_empty[2]; item slots.
  static constexpr uint32_t kBarBytes = 8 * (2 * kKStages + 2 * kVStages + 2 + 4) + 16;
  static constexpr uint32_t kSmemBytes = kOffBar + kBarBytes + 1024;  // + alignment slack
  static_assert(D % 64 == 0 && kQBytes % 1024 == 0 && kKVBytes % 1024 == 0, "1024-byte aligned tiles");
  static_assert(kSmemBytes <= kSm90SmemOptinBytes, "sm90 dQ: Q, dO and the K / V stages do not fit");
};

template <int D>
struct Sm90DqParams {
  BwdArgs a;
  CUtensorMap tq, tdo, tk, tv;
  int32_t tile_window;  // decode_fwd_item (fwd_item_order.h), as the forward
  int32_t head_run;
  int32_t dq_vec16;  // dQ's base and strides allow 16-byte stores (fwd_o_row_stg128), else pairs
};

// The walk over a forward item's visible KV tiles, the same in producer and consumers: with a
// sliding window from the item's first position on (returned, for dq_walk_next).
template <typename Mods, int BN>
__device__ __forceinline__ int32_t dq_walk_init(KvWalk<BN>& kv, const LayoutPtrs& L, int32_t window, int32_t seg,
                                                int32_t q0, int32_t q1) {
  if constexpr (Mods::kWindow) {
    const int32_t first_pos = SegmentMask::window_first_position(L.offsets, L.position_offset, seg, q0, window);
    kv.init_windowed(L.offsets, L.parent, L.position_offset, seg, q1, first_pos);
    return first_pos;
  } else {
    kv.init(L.offsets, L.parent, seg, q1);
    return 0;
  }
}
template <typename Mods, int BN>
__device__ __forceinline__ bool dq_walk_next(KvWalk<BN>& kv, const LayoutPtrs& L, int32_t first_pos) {
  if constexpr (Mods::kWindow) return kv.next_windowed(L.offsets, L.parent, L.position_offset, first_pos);
  else return kv.next(L.offsets, L.parent);
}

template <typename T, int D, typename Mods>
__global__ void __launch_bounds__(Sm90DqConfig<D, Mods::kWindow>::kThreads, 1)
bwd_dq_sm90_kernel(const __grid_constant__ Sm90DqParams<D> p) {
  static_assert(bwd_dq_kernel_built(D), "sm90 dQ: not built for this head dim");
  using C = Sm90DqConfig<D, Mods::kWindow>;
  constexpr int BN = C::kBlockN, KS = C::kKStages, VS = C::kVStages;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t pad = (1024u - (smem_u32(smem_raw) & 1023u)) & 1023u;
  uint8_t* smem = smem_raw + pad;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + C::kOffBar);
  uint64_t* k_full = bars;
  uint64_t* k_empty = bars + KS;
  uint64_t* v_full = bars + 2 * KS;
  uint64_t* v_empty = bars + 2 * KS + VS;
  uint64_t* q_full = bars + 2 * KS + 2 * VS;
  uint64_t* q_empty = q_full + 1;
  uint64_t* item_full = q_full + 2;
  uint64_t* item_empty = q_full + 4;
  int32_t* item_slots = reinterpret_cast<int32_t*>(q_full + 6);

  const BwdArgs& a = p.a;
  const LayoutPtrs& L = a.layout;
  const int32_t* plan = a.plan;
  if (!plan_matches(plan, L)) return;
  const int32_t n_tiles = plan[kHdrNumFwd];
  const int32_t* items = plan + plan[kHdrFwdOffset];
  const int H = a.num_heads;
  const int group = H / a.num_kv_heads;
  const int32_t n_items = n_tiles * H;
  const int32_t window = clamp_fwd_window(p.tile_window, n_tiles);

  constexpr uint32_t kReleases = 4 * C::kConsumerWGs * kArrivalsPerWarp;  // consumer warps' arrivals
  if (threadIdx.x == 0) {
    for (int i = 0; i < KS; ++i) {
      mbar_init(&k_full[i], 1);
      mbar_init(&k_empty[i], kReleases);
    }
    for (int i = 0; i < VS; ++i) {
      mbar_init(&v_full[i], 1);
      mbar_init(&v_empty[i], kReleases);
    }
    mbar_init(q_full, 1);
    mbar_init(q_empty, kReleases);
    for (int i = 0; i < 2; ++i) {
      mbar_init(&item_full[i], 1);
      mbar_init(&item_empty[i], kReleases);
    }
    mbar_fence_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ------------------------------------------------------------------ producer
    setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x != 0) return;
    tma_prefetch_desc(&p.tq);
    tma_prefetch_desc(&p.tdo);
    tma_prefetch_desc(&p.tk);
    tma_prefetch_desc(&p.tv);
    uint32_t kv_iter = 0;
    for (uint32_t n = 0;; ++n) {
      const uint32_t slot = n & 1, ph = (n >> 1) & 1;
      mbar_wait(&item_empty[slot], ph ^ 1);
      const int32_t item = atomicAdd(&a.counters[1], 1);
      item_slots[slot] = item;
      mbar_arrive(&item_full[slot]);
      if (item >= n_items) break;
      int32_t tile;
      int h;
      decode_fwd_item(item, n_tiles, H, window, p.head_run, tile, h);
      const int hk = h / group;
      const int32_t seg = items[tile * kFwdItemInts + 0];
      const int32_t q0 = items[tile * kFwdItemInts + 1];
      const int32_t q1 = items[tile * kFwdItemInts + 2];
      KvWalk<BN> kv;
      const int32_t first_pos = dq_walk_init<Mods>(kv, L, a.window, seg, q0, q1);
      const auto load_k = [&](uint32_t it) {
        const uint32_t st = it % KS;
        mbar_wait(&k_empty[st], ((it / KS) & 1) ^ 1);
        mbar_arrive_expect_tx(&k_full[st], C::kKVBytes);
#pragma unroll
        for (int b = 0; b < C::kBoxes; ++b)
          tma_load_3d(smem + C::kOffK + st * C::kKVBytes + b * C::kKVBoxBytes, &p.tk, &k_full[st], b * 64, hk, kv.pos);
      };
      load_k(kv_iter);
      // Q and dO after the first K tile (the forward's order): item n's use of the buffers waits for
      // the release of use n - 1 (every consumer warp retired that item's last S and dP).
      mbar_wait(q_empty, (n & 1) ^ 1);
      mbar_arrive_expect_tx(q_full, 2 * C::kQBytes);
#pragma unroll
      for (int b = 0; b < C::kBoxes; ++b) {
        tma_load_3d(smem + b * C::kQBoxBytes, &p.tq, q_full, b * 64, h, q0);
        tma_load_3d(smem + C::kOffDo + b * C::kQBoxBytes, &p.tdo, q_full, b * 64, h, q0);
      }
      // Then per tile j: V_j, then K_{j+1}. K_{j+1}'s stage is K_{j-1}'s, released when tile j - 1's
      // dQ retires; V_j waits for V_{j-1}'s release, after tile j - 1's dP.
      bool more;
      do {
        const uint32_t vst = kv_iter % VS;
        mbar_wait(&v_empty[vst], ((kv_iter / VS) & 1) ^ 1);
        mbar_arrive_expect_tx(&v_full[vst], C::kKVBytes);
#pragma unroll
        for (int b = 0; b < C::kBoxes; ++b)
          tma_load_3d(smem + C::kOffV + vst * C::kKVBytes + b * C::kKVBoxBytes, &p.tv, &v_full[vst], b * 64, hk,
                      kv.pos);
        more = dq_walk_next<Mods>(kv, L, first_pos);
        if (more) load_k(kv_iter + 1);
        ++kv_iter;
      } while (more);
    }
    return;
  }

  // -------------------------------------------------------------------- consumers
  setmaxnreg_inc<C::kConsumerRegs>();
  using Mma = Wgmma<T, BN>;
  using MmaQ = Wgmma<T, D>;
  // Warp-uniform through a shuffle, so that the descriptors built from it stay in uniform registers
  // (the forward's comment at its cw).
  const int cw = __shfl_sync(0xffffffffu, wg - 1, 0);
  const int tid = threadIdx.x & 127;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int row_in_tile = cw * 64 + warp * 16 + g;  // rows row_in_tile and row_in_tile + 8
  const float sl2 = Mods::score_log2(a);
  const float inv_cap = Mods::kSoftcap ? 1.f / a.softcap : 0.f;
  const uint32_t q_wg = smem_u32(smem) + cw * 64 * 128;  // this warpgroup's rows of every Q box
  const uint32_t do_wg = q_wg + C::kOffDo;
  const uint32_t k_base = smem_u32(smem) + C::kOffK;
  const uint32_t v_base = smem_u32(smem) + C::kOffV;
  const auto release = [&](uint64_t* bar) {
    __syncwarp();
    if (kPerThreadRelease || lane == 0) mbar_arrive(bar);
  };

  float s[BN / 2], dp[BN / 2];
  uint32_t pf[BN / 4];
  // acc = A B^T over D, both operands K-major in smem: A this warpgroup's 64 rows of a kBlockM-row tile
  // (Q or dO), B a KV tile (K or V): S = Q K^T, dP = dO V^T.
  const auto issue_abt = [&](float (&acc)[BN / 2], uint32_t a_rows, uint32_t b_tile) {
    const uint64_t da = make_desc_sw128(a_rows, 16, 1024), db = make_desc_sw128(b_tile, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t box = kk / 4, within = (kk % 4) * 32;
      Mma::ss(acc, desc_advance(da, box * C::kQBoxBytes + within), desc_advance(db, box * C::kKVBoxBytes + within),
              kk > 0 ? 1 : 0);
    }
  };
  const auto issue_s = [&](uint32_t st) { issue_abt(s, q_wg, k_base + st * C::kKVBytes); };
  const auto issue_dp = [&](uint32_t vst) { issue_abt(dp, do_wg, v_base + vst * C::kKVBytes); };

  uint32_t kv_iter = 0;
  for (uint32_t n = 0;; ++n) {
    const uint32_t slot = n & 1, ph = (n >> 1) & 1;
    mbar_wait(&item_full[slot], ph);
    const int32_t item = item_slots[slot];
    release(&item_empty[slot]);
    if (item >= n_items) break;
    int32_t tile;
    int h;
    decode_fwd_item(item, n_tiles, H, window, p.head_run, tile, h);
    const int32_t seg = items[tile * kFwdItemInts + 0];
    const int32_t q0 = items[tile * kFwdItemInts + 1];
    const int32_t q1 = items[tile * kFwdItemInts + 2];
    const int32_t qi0 = q0 + row_in_tile;
    // The rows' lse (in the exponent's base-2 units) and delta; +inf / 0 for rows past the item (a
    // ragged last tile), whose P is then 0 whatever Q's rows hold there.
    float lse2[2], dl[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int32_t qi = qi0 + 8 * r;
      const bool valid = qi < q1;
      lse2[r] = valid ? a.lse[static_cast<int64_t>(h) * a.lse_hs + qi] * kLog2e : CUDART_INF_F;
      dl[r] = valid ? a.delta[static_cast<int64_t>(h) * L.num_tokens + qi] : 0.f;
    }
    float dq[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dq[i] = 0.f;

    KvWalk<BN> kv;
    const int32_t first_pos = dq_walk_init<Mods>(kv, L, a.window, seg, q0, q1);
    mbar_wait(q_full, n & 1);  // item n's Q and dO (the producer's n-th use of the buffers)
    // Tile kv_iter: its K and V stages, their loads waited for, its dP and S issued (two groups).
    uint32_t kst, vst;
    const auto issue_tile = [&]() {
      kst = kv_iter % KS;
      vst = kv_iter % VS;
      mbar_wait(&k_full[kst], (kv_iter / KS) & 1);
      mbar_wait(&v_full[vst], (kv_iter / VS) & 1);
      wgmma_fence();
      issue_dp(vst);
      wgmma_commit();
      issue_s(kst);
      wgmma_commit();
    };
    issue_tile();
    while (true) {
      const int32_t kpos = kv.pos, krem = kv.rest(), kcur = kv.cur;
      const bool own = kv.own;
      wgmma_wait<1>();  // dP
      fence_regs(dp);
      release(&v_empty[vst]);
      wgmma_wait<0>();  // S
      fence_regs(s);
      // Warp-uniform for ptxas (the walk is the same in every lane): on a path it must take for
      // divergent it waits for the wgmmas in flight around it (C7520).
      const bool more = __shfl_sync(0xffffffffu, dq_walk_next<Mods>(kv, L, first_pos), 0);
      if (!more) release(q_empty);  // the item's last S and dP have retired
      // The forward's mask (fwd_sm90_kernel mask_scores): the softcap first, then columns past the
      // range's end, the causal diagonal of an own range and the window.
      if constexpr (Mods::kSoftcap) softcap_scores(s, a);
      if (krem < BN || (own && kpos + BN - 1 > q0)) {
        const int32_t cols[2] = {SegmentMask::fwd_visible_cols(kpos, krem, own, qi0),
                                 SegmentMask::fwd_visible_cols(kpos, krem, own, qi0 + 8)};
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (j * 8 + 2 * t4 + (e & 1) >= cols[e >> 1]) s[4 * j + e] = -CUDART_INF_F;
      }
      if constexpr (Mods::kWindow) {
        const int32_t shift = SegmentMask::window_shift(L.offsets, L.position_offset, seg, kcur);
        fwd_window_mask(s, kpos, q0 + cw * 64 + 63, qi0, 8, t4, shift, a.window);
      }
      // dS = P (dP - delta), packed into the A fragments of dQ += dS K (the forward's P layout).
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const float pe = fast_exp2(fmaf(s[4 * j + e], sl2, -lse2[r]));
          float ds = pe * (dp[4 * j + e] - dl[r]);
          if constexpr (Mods::kSoftcap) {
            // The cap's derivative 1 - t^2 from the capped score c t; min(., 1) makes a hidden
            // score's (-inf) factor 0 rather than -inf, so that its dS is 0, not 0 * inf.
            const float t = s[4 * j + e] * inv_cap;
            ds *= 1.f - fminf(t * t, 1.f);
          }
          s[4 * j + e] = ds;
        }
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        pf[4 * kk + 0] = Convert<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
        pf[4 * kk + 1] = Convert<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
        pf[4 * kk + 2] = Convert<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
        pf[4 * kk + 3] = Convert<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
      }
      wgmma_fence();
      {
        const uint64_t dk = make_desc_sw128(k_base + kst * C::kKVBytes, C::kKVBoxBytes, 1024);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) MmaQ::rs(dq, &pf[4 * kk], desc_advance(dk, kk * 16 * 128), 1);
      }
      wgmma_commit();
      // dQ retired before the next tile's dP and S are issued: with dQ_j running under them (dS's
      // fragments, S and dP all live across the loop's edge) the kernel measured 1.000-1.018x this
      // one's time on the four layout classes (H100, 2026-12-06, docs/decisions.md).
      wgmma_wait<0>();
      fence_regs(dq);
      fence_regs(pf);
      release(&k_empty[kst]);
      ++kv_iter;
      if (!more) break;
      issue_tile();
    }
    // The same in every lane (the walk is); without the shuffle the next item's descriptors, built
    // from kv_iter's stage, leave the uniform registers (the forward's drain_walk says so).
    kv_iter = __shfl_sync(0xffffffffu, kv_iter, 0);

    // Epilogue: dQ = scale * sum dS K, in the input dtype.
    T* dqg = static_cast<T*>(a.dq);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int32_t qi = qi0 + 8 * r;
      T* row = dqg + static_cast<int64_t>(qi) * a.dq_ts + static_cast<int64_t>(h) * a.dq_hs;
      if (p.dq_vec16 != 0) {
        // The quad's SHFLs need all 32 lanes: the row test masks the stores only.
        fwd_o_row_stg128<T, D>(row, dq, r, a.scale, static_cast<uint32_t>(t4), qi < q1);
      } else if (qi < q1) {
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
          *reinterpret_cast<uint32_t*>(row + j * 8 + 2 * t4) =
              Convert<T>::pack(dq[4 * j + 2 * r] * a.scale, dq[4 * j + 2 * r + 1] * a.scale);
      }
    }
  }
}

}  // namespace dualkv::cuda::sm90
