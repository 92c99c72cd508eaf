// Hopper backward main kernel (sm_90a): KV-tile-outer, wgmma + TMA + warp specialisation.
//
// It replaces only the portable KV-outer kernel (bwd_kv_kernel in ../bwd_kernel.cuh): same work
// plan items (seg, k0, k1, qa, qb, slot), same workspace (delta from the sm80 preprocess, the fp32
// dQ accumulator, the fp32 split partials), same outputs (dK scaled by the softmax scale, dV, or
// unscaled fp32 partials for split items). One persistent CTA per SM, three warpgroups:
//
//   warpgroup 0 (producer; only warp 0 stays): lane 0 takes (KV tile, KV head) items from the
//     plan through an atomic counter, hands each to the consumers through a 2-slot ring, loads the
//     item's K and V tiles by TMA (one buffer, 128 rows x D, resident for the whole item), then for
//     every query head of the KV head's group and every 64-row query tile of [qa, qb): Q and dO by
//     TMA and the 64 lse*log2(e) / delta values by ordinary loads of the 32 lanes, into a 2-stage
//     ring.
//   warpgroups 1, 2 (consumers): warpgroup c owns KV rows [64c, 64c + 64) of the tile. Per query
//     tile (all wgmma, fp32 accumulators):
//       S^T  = K_c Q^T            (SS, m64 n64)       dP^T = V_c dO^T    (SS, m64 n64)
//       P^T  = exp2(S^T scale log2e - lse log2e)  (masked: kv row >= klen, or kv > q)
//       dS^T = P^T (dP^T - delta)
//       dV_c += P^T dO            (RS: P^T from registers, dO N-major)
//       dK_c += dS^T Q            (RS: dS^T from registers, Q N-major)
//       dS^T -> smem as dS [q][kv] (stmatrix.trans, 128B swizzle), both warpgroups sync (named
//       barrier 1), then warpgroup c computes dQ[:, cD/2 .. +D/2] = dS K[:, half] (SS, B N-major)
//       and adds it to the fp32 dQ accumulator (the dQ-computing kernel, template flag kAtomicDq, a
//       name from when it added dQ with 16-byte atomics; skipped in deterministic mode, where the
//       sm80 query-outer dQ kernel runs afterwards).
//   dQ by bulk reduce (the only dQ path: the build switch that kept the atomics is gone):
//     warpgroup c stores its fp32 dQ half into a staging buffer (64 x D fp32, double-buffered by
//     step parity, 128B-swizzled boxes of 32 columns; rows >= qb stored as 0), and thread 32 of the
//     producer warpgroup (the "dQ writer") adds the whole tile to dq_accum with D/32 TMA reduce-adds
//     (cp.reduce.async.bulk.tensor), so per step a math thread issues D/8 8-byte shared stores
//     instead of D/16 16-byte global atomics (+ D/8 shuffles), and the L2 reductions no longer go
//     through the math warps' load/store queues. The writer walks the same items and steps as the
//     consumers.
//   Head dim 64 without softcap (since 2026-12-02, Sm90BwdConfig): 128-row query tiles, so S^T
//     and dP^T are m64 n128, dV / dK take k = 128, and dQ is split by rows instead of columns
//     (warpgroup c: dQ[64c .. 64c + 64, :] = dS[64c.., :] K, m64 nD), staged in ONE buffer (dq_full[0]
//     / dq_empty[0], phase = step parity) that the writer reduces as two 64-row boxes per 32
//     columns (the second skipped when wholly past qb).
//   Rows of Q/dO past qb get lse = +inf (P = 0); TMA zero-fills past T. KV rows past k1 (the next
//   segment's tokens, loaded by TMA) are masked explicitly.
//   Issue order of the dQ-computing kernel (since 2026-12-02, FA3/FA4's): dV, dS stores, [dK's
//     first k step: kDkHead, D = 128], barrier 1, dQ, dK (the rest); wait_group 1
//     retires dV, that dK step and dQ, the dQ staging runs while dK is in flight, wait_group 0, then
//     qdo_empty. Deterministic kernel: dV, dK, wait_group 0, qdo_empty. 128-row steps without a
//     softcap (kSoftmaxHalves, since 2026-12-03) in two halves of the step's queries: the first
//     half's dS stores, dV and dK, then the second half's exponentials, dS stores and dV, barrier 1,
//     dQ, the second half's dK. (tests/models/bwd_protocol_model.py models the barriers, which the
//     order of the issues does not change.)
//
// Barriers (mbarriers in smem):
//   item_full[2] / item_empty[2]  work item hand-off (count 1 / 8 consumer warps)
//   kv_full / kv_empty            K and V of the item loaded (tx) / every consumer warp done
//   qdo_full[2] / qdo_empty[2]    Q, dO (tx) and lse/delta (33 arrivals: lane 0's expect_tx + one
//                                 per producer lane after its smem stores) / every consumer warp done
//   named barrier 1 (256 threads) dS of the step written by both consumer warpgroups; dS is
//                                 double-buffered by step parity, so a buffer is rewritten only
//                                 after the other warpgroup passed the next step's barrier, i.e.
//                                 after its dQ wgmma of this step retired (its wait_group 1,
//                                 before its next barrier).
//   dQ-computing (non-deterministic) kernel only:
//   item_empty[2]                 9 arrivals: the 8 consumer warps + the dQ writer
//   dq_full[2] / dq_empty[2]      staging buffer of the step written by every consumer warp (lane
//                                 0 after each lane's stores + fence.proxy.async + __syncwarp) /
//                                 the writer's reduces of it have read it (wait_group.read)
// Phases follow running counters kept identically by producer and consumers. The CPU model of
// this protocol is tests/models/bwd_protocol_model.py.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include <type_traits>

#include "convert.cuh"
#include "fwd_item_order.h"
#include "kernel_params.h"
#include "modifiers.cuh"
#include "plan_reader.cuh"
#include "sm90/ptx.cuh"
#include "sm90/wgmma_ops.cuh"
#include "tile_size.h"

namespace dualkv::cuda::sm90 {

// kDqStage: the layout of the dQ-computing kernel (kAtomicDq), with the dQ staging buffers; the
// deterministic kernel has none.
//
// Query rows per step (2026-12-02, issue 23 #4, docs/notes/2026-12-02-d64-bwd-steps.md): 64 at
// D = 128, 128 at D = 64. A D 64 step of 64 x 128 has half the GEMM work of a D 128 step but the
// same fixed cost (barriers, waits, the P^T / dS^T elementwise of 64 x 128 scores, the dS stores),
// so the kernel ran at 0.73x cuDNN's rate; with 128 query rows a D 64 step has D 128's FLOPs and
// accumulator footprint (S^T, dP^T: 64 x 128 fp32 = 64 registers each; dK, dV 64 x 64 = 32 each).
// (Not with a softcap: those kernels keep 64-row steps, tile_size.h.)
// The plan's split granularity stays 64 rows (plan_tiles): a piece of an odd number of 64-row
// blocks ends in a step whose second half is past qb (lse = +inf there, P = 0, as any ragged end).
// kStepRows: sm90_bwd_block_m (tile_size.h).
// The dQ staging box (sm90/tma.h make_dq_accum_map): 32 rows x 64 fp32 columns, smem row 2 r + b holding
// row r's 32-column block b (128 bytes, 128B swizzle).
constexpr uint32_t kBwdDqBoxBytes = 32 * 2 * 128;

template <int D, bool kDqStage = false, int kStepRows = 64>
struct Sm90BwdConfig {
  static constexpr int kBlockM = kStepRows;  // query rows per step
  static constexpr int kBlockN = 128;  // KV rows per item (= the plan's bwd_block_n)
  static constexpr int kThreads = 384;
  static constexpr int kConsumerRegs = 232;
  static constexpr int kProducerRegs = 40;
  static_assert(setmaxnreg_split_fits(kThreads, kProducerRegs, kConsumerRegs),
                "sm90: the consumers' setmaxnreg.inc would wait for registers the producer never returns");
  static constexpr int kBoxes = D / 64;  // TMA boxes of 64 columns (128 B of 16-bit)
  static constexpr uint32_t kQBoxBytes = kBlockM * 128;
  static constexpr uint32_t kQBytes = kBlockM * D * 2;   // one Q (or dO) stage
  static constexpr uint32_t kKVBoxBytes = kBlockN * 128;
  static constexpr uint32_t kKVBytes = kBlockN * D * 2;  // K (or V)
  static constexpr uint32_t kDSBoxBytes = kBlockM * 128;
  static constexpr uint32_t kDSBytes = kBlockM * kBlockN * 2;
  // dQ of the step (kBlockM x D) between the two consumer warpgroups: by columns at 64 rows
  // (warpgroup c: all 64 rows, columns [c D/2, c D/2 + D/2)), by rows at 128 (warpgroup c: rows
  // [64c, 64c + 64), all D columns): either way one m64 wgmma chain over the 128 KV rows.
  static constexpr bool kDqByRows = kBlockM == 128;
  static constexpr int kDqN = kDqByRows ? D : D / 2;  // dQ columns per consumer warpgroup
  // The softmax in two halves of the step's query columns, each half's dV and dK issued as soon as
  // its P^T / dS^T are in registers, the second half's exponentials under the first half's wgmmas
  // (2026-12-03). With 128-row steps (D 64) a step's 128 x 128 exponentials take ~1,024 cycles of
  // a sub-partition's MUFU (16 per cycle per SM), twice the dP^T wgmma they ran under. Predicted
  // 10-15% of the backward kernel from that count; measured (H200, kernel time against the kernel
  // without halves, 6 rounds) 0.967-0.999 on 9 GRPO layouts and classes, so the exponentials were
  // not the step's long pole. With 64-row steps (D 128) 0.989-1.034: not there (docs/decisions.md).
  // Each half's dS is stored before its dV is issued (FA3's D-64 order: the dQ wgmma's operand is in
  // place sooner; measured 0.989-0.998x with 128-row steps before the halves, 2026-12-03). 64-row
  // steps issue dV first (dS first measured 0.990-1.010x there, slower on 3 of 4 layouts).
  static constexpr bool kSoftmaxHalves = kBlockM == 128;
  // dQ staging (kDqStage): kBlockM rows x D fp32 per buffer, as (kBlockM / 32) x (D / 64) boxes of
  // 32 rows x 64 columns (kBwdDqBoxBytes; each half-warp's float2 stores hit every bank once:
  // bwd_stage_dq_fragment), row block major.
  static constexpr int kDqBoxCols = D / 64;  // boxes per 32-row block
  static constexpr uint32_t kDqStageBytes = kDqStage ? kBlockM * D * 4 : 0;
  // Staging buffers: 2 (by step parity) at 64 rows; 1 at 128 rows, where two of 32 KiB do not fit
  // next to the 2 x 32 KiB of dS (232,576 B of 232,448). One buffer costs no wait in practice: the
  // writer's reduces read step i's staging while the consumers run step i + 1's S^T, dP^T, softmax,
  // dV and dQ before they stage again.
  static constexpr int kDqStages = kBlockM == 128 ? 1 : 2;
  // smem: K | V | Q[2] | dO[2] | dS[2] | dQ staging[2] (kDqStage) | lse[2][64] | delta[2][64] |
  // barriers + item slots.
  static constexpr uint32_t kOffK = 0;
  static constexpr uint32_t kOffV = kOffK + kKVBytes;
  static constexpr uint32_t kOffQ = kOffV + kKVBytes;
  static constexpr uint32_t kOffDO = kOffQ + 2 * kQBytes;
  static constexpr uint32_t kOffDS = kOffDO + 2 * kQBytes;
  static constexpr uint32_t kOffDQ = kOffDS + 2 * kDSBytes;
  static constexpr uint32_t kOffLse = kOffDQ + kDqStages * kDqStageBytes;
  static constexpr uint32_t kOffDelta = kOffLse + 2 * kBlockM * 4;
  static constexpr uint32_t kOffBar = kOffDelta + 2 * kBlockM * 4;
  // 10 mbarriers + 2 item slots (16 B); kDqStage adds dq_full[2], dq_empty[2] after the slots.
  static constexpr uint32_t kBarBytes = kDqStage ? 8 * 16 : 8 * 10 + 16;
  static constexpr uint32_t kSmemBytes = kOffBar + kBarBytes + 1024;  // + alignment slack
  // D = 128: 165,984 B; with kDqStage + 65,536 (staging) + 32 (barriers) = 231,552 of 232,448 B.
  // D = 64 (128-row steps): 167,008 B; with kDqStage + 32,768 (one staging buffer) + 32 = 199,808 B.
  static_assert(kSmemBytes <= kSm90SmemOptinBytes, "sm90 backward: over the 227 KiB opt-in smem limit");
  static_assert(D == 64 || D == 128, "sm90 backward: head dim 64 or 128");
  static_assert(kDqN % 32 == 0 && (kDqN <= 64), "dQ half must lie inside one 64-column box");
  static_assert(kBlockM == 64 || (kBlockM == 128 && D == 64), "sm90 backward: 128-row steps at D = 64 only");
};

template <int D>
struct Sm90BwdParams {
  BwdArgs a;
  CUtensorMap tq, tk, tv, tdo;
  int32_t* counter;  // work-item counter, zeroed before the launch
  int32_t item_window;    // the claim order (producer only, bwd_claim_ordered): work items per window
  int32_t item_head_run;  // KV heads per run, divides Hk
  CUtensorMap tdq;  // dq_accum [T, H, D] fp32, boxes of 32 rows x 64 columns of one head (tma.h)
  CUtensorMap tpk, tpv;  // external prefix (issue 17): the prefix K / V buffers (prefix kernels only)
};

struct Sm90BwdBarriers {
  uint64_t* item_full;
  uint64_t* item_empty;
  uint64_t* kv_full;
  uint64_t* kv_empty;
  uint64_t* qdo_full;
  uint64_t* qdo_empty;
  int32_t* items;
  uint64_t* dq_full;  // dQ-computing kernel only
  uint64_t* dq_empty;
};

// stmatrix x4, transposed: lane l gives the smem row address of row (l % 8) of matrix l / 8.
__device__ __forceinline__ void bwd_stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                                      uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ void bwd_fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void bwd_st_shared_f32x2(uint32_t addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}

// Whether the backward main kernel of head dim D claims its items in choose_bwd_item_order's order
// (fwd_item_order.h) or in the plan's (work item claim / Hk, KV head claim % Hk, every KV head of a
// work item together). Measured on one H100 (2026-12-07, the kernel's time against the plan's order,
// 7 rounds, A/A beside; docs/notes/2026-12-06-bwd-claim-order.md §5): D 64 0.94 on long responses,
// 0.93 on N64 P1K R512 and 0.98 on the tree, within 2 % elsewhere; D 128 0.95 on N64 P1K R512 but
// 1.02-1.04 on small groups and N8 P256 R4K with no gain on long responses; D 256 no gain anywhere.
constexpr bool bwd_claim_ordered(int D) { return D == 64; }

// The producer's next item as the index w * Hk + hk that the consumers and the dQ writer read from
// the item slot: the counter's value itself, or where bwd_claim_ordered(D) that value through
// decode_fwd_item over (work items, KV heads) with p.item_window / p.item_head_run; n_work * Hk or
// more ends the walk.
template <int D>
__device__ __forceinline__ int32_t bwd_claim_item(const Sm90BwdParams<D>& p, int32_t n_work, int32_t Hk) {
  const int32_t claim = atomicAdd(p.counter, 1);
  if constexpr (!bwd_claim_ordered(D)) {
    return claim;
  } else {
    if (claim >= n_work * Hk) return claim;
    int32_t w, hk;
    decode_fwd_item(claim, n_work, Hk, clamp_fwd_window(p.item_window, n_work), p.item_head_run, w, hk);
    return w * Hk + hk;
  }
}

// One step's lse / delta rows staged into the Q/dO stage by the producer warp, after the stage's wait
// and its Q / dO loads: rows qt + lane + 32 j of head h (BM / 32 per lane; rows >= qb, a tile's tail,
// read nothing), lse in log2 units (+inf past qb: its P is 0), delta as read.
// 128-row steps (D 64) load all of a lane's rows first, fenced ahead of the shared stores: as one loop
// of `i = lane; i < BM; i += 32` (a trip count the compiler cannot bound) each row group's loads
// waited behind the previous group's stores, four load latencies in a row before the stage's
// qdo_full arrivals (docs/notes/2026-12-05-bwd-ncu-per-step.md). Measured (H100, three runs): the
// D-64 backward kernel 0.85-0.99 of the loop's time on nine layouts. The 64-row steps (D 128 / 256)
// keep the loop: loads first measured them 1.03-1.37x slower on six of nine layouts at D 128 and up
// to 2x at D 256 (N8 P16K R2K), loaded before or after the wait alike; why is not known
// (docs/benchmarks.md, session 39).
template <int BM>
__device__ __forceinline__ void bwd_stage_lse_delta(const BwdArgs& a, int64_t num_tokens, int h, int32_t qt,
                                                    int32_t qb, int lane, float* s_lse, float* s_delta) {
  static_assert(BM % 32 == 0, "bwd_stage_lse_delta: whole row groups per lane");
  if constexpr (BM == 128) {
    constexpr int kPerLane = BM / 32;
    float lse[kPerLane], delta[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int32_t qi = qt + lane + 32 * j;
      const bool valid = qi < qb;
      lse[j] = valid ? a.lse[h * a.lse_hs + qi] : 0.f;
      delta[j] = valid ? a.delta[h * num_tokens + qi] : 0.f;
    }
    fence_regs(lse);
    fence_regs(delta);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int i = lane + 32 * j;
      s_lse[i] = qt + i < qb ? lse[j] * kLog2e : CUDART_INF_F;
      s_delta[i] = delta[j];
    }
  } else {
#pragma unroll
    for (int i = lane; i < BM; i += 32) {
      const int32_t qi = qt + i;
      const bool valid = qi < qb;
      s_lse[i] = valid ? a.lse[h * a.lse_hs + qi] * kLog2e : CUDART_INF_F;
      s_delta[i] = valid ? a.delta[h * num_tokens + qi] : 0.f;
    }
  }
}

constexpr uint32_t kBwdQdoFullCount = 33;  // lane 0's arrive_expect_tx + 32 lanes after lse/delta
constexpr uint32_t kBwdConsumerWarps = 8;
// qdo_empty arrivals: one per consumer warp (lane 0, after __syncwarp, which orders the warp's
// lse/delta reads before it); every consumer thread in the racecheck build (ptx.cuh
// kPerThreadRelease, docs/hopper.md).
constexpr uint32_t kBwdQdoEmptyCount = kBwdConsumerWarps * kArrivalsPerWarp;
// The racecheck build also replaces the producer/consumer named-barrier hand-offs between the two
// consumer warpgroups (bar.arrive on one side, bar.sync on the other: ordered by the PTX memory
// model, but racecheck does not treat bar.arrive as a release) by bar.sync on both sides, and the
// D-256 kernel's S^T-retired signal too (it carries no data; bwd_kernel_d256.cuh says why).
constexpr bool kBwdRacecheckBarriers = kPerThreadRelease;
// One side of such a hand-off: bar.arrive where it only signals (signal), else bar.sync; bar.sync on both
// sides in the racecheck build.
__device__ __forceinline__ void bwd_handoff(uint32_t id, uint32_t threads, bool signal) {
  if (signal && !kBwdRacecheckBarriers)
    named_bar_arrive(id, threads);
  else
    named_bar_sync(id, threads);
}
constexpr uint32_t kBwdDsBarrier = 1;      // named barrier id (0 is __syncthreads)

// P^T = exp2(S^T scale log2e - lse log2e) in place, masked (if mask) where the KV row is past klen
// or after the query. Accumulator fragment of m64 (kv) x n(2N) (q): element 4j + e is row
// kv_row0 + 8 (e >> 1), column 8j + 2 t4 + (e & 1). A constant mask (the softmax-overlap step calls
// it once per branch of a uniform test) compiles to a loop without mask arithmetic. kCausal = false
// (a prefix item's rows, external prefix issue 17): only the rows past klen are masked.
// kWindow (mask modifiers, issue 16): the masked form also hides the pairs of the sliding window
// `window` (SegmentMask::window_hidden with the item's distance bias `bias`). lse_first: the lse
// pairs of the first kPreloaded n8 blocks, read by the caller before its wait for S^T.
// [kJ0, kJ1): the n8 blocks (query columns 8 kJ0 .. 8 kJ1) computed, all by default.
template <int N, bool kCausal = true, bool kWindow = false, int kPreloaded = 0, int kJ0 = 0, int kJ1 = N / 4>
__device__ __forceinline__ void bwd_softmax_p(float (&sacc)[N], const float* lse_s, float sl2, int t4,
                                              int kv_row0, int klen, int32_t k0, int32_t qt, bool mask,
                                              int32_t bias = 0, int32_t window = 0,
                                              const float2* lse_first = nullptr) {
#pragma unroll
  for (int j = kJ0; j < kJ1; ++j) {
    const int c = j * 8 + 2 * t4;
    const float2 l2 = j < kPreloaded ? lse_first[j] : *reinterpret_cast<const float2*>(lse_s + c);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float lv = (e & 1) ? l2.y : l2.x;
      float pv = fast_exp2(fmaf(sacc[4 * j + e], sl2, -lv));
      if (mask) {
        const int r = kv_row0 + (e >> 1) * 8;
        if (r >= klen || (kCausal && k0 + r > qt + c + (e & 1))) pv = 0.f;
        if constexpr (kWindow) {
          if (SegmentMask::window_hidden(k0 + r, qt + c + (e & 1), bias, window)) pv = 0.f;
        }
      }
      sacc[4 * j + e] = pv;
    }
  }
}

// With a softcap (mask modifiers, issue 16): P^T from the capped scores (masked as
// bwd_softmax_p) and dS^T = P^T (dP^T - delta) (1 - tanh^2) in one pass once dP^T is ready, both
// packed into A fragments (m = kv, k = q: frag[2j + h] holds elements 4j + 2h, 4j + 2h + 1). One
// pass after the dP^T wait, not P^T under it as without a softcap: the cap's derivative would
// need registers next to the running dP^T product (32-40 bytes spilled at D = 128).
template <typename T, int N, bool kWindow = false>
__device__ __forceinline__ void bwd_softcap_p_ds(const float (&sacc)[N], const float (&dpacc)[N],
                                                 uint32_t (&pf)[N / 2], uint32_t (&dsf)[N / 2], const float* lse_s,
                                                 const float* delta_s, const BwdArgs& a, int t4, int kv_row0,
                                                 int klen, int32_t k0, int32_t qt, bool mask, int32_t bias = 0) {
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    const int c = j * 8 + 2 * t4;
    const float2 l2 = *reinterpret_cast<const float2*>(lse_s + c);
    const float2 d2 = *reinterpret_cast<const float2*>(delta_s + c);
    float pv[4], ds[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const SoftcapFromExp cap = softcap_of(sacc[4 * j + e], a);
      pv[e] = fast_exp2(fmaf(cap.score(a.softcap), 1.4426950408889634f, -((e & 1) ? l2.y : l2.x)));
      if (mask) {
        const int r = kv_row0 + (e >> 1) * 8;
        if (r >= klen || k0 + r > qt + c + (e & 1)) pv[e] = 0.f;
        if constexpr (kWindow) {  // the sliding window (issue 16)
          if (SegmentMask::window_hidden(k0 + r, qt + c + (e & 1), bias, a.window)) pv[e] = 0.f;
        }
      }
      ds[e] = pv[e] * cap.grad() * (dpacc[4 * j + e] - ((e & 1) ? d2.y : d2.x));
    }
    pf[2 * j] = Convert<T>::pack(pv[0], pv[1]);
    pf[2 * j + 1] = Convert<T>::pack(pv[2], pv[3]);
    dsf[2 * j] = Convert<T>::pack(ds[0], ds[1]);
    dsf[2 * j + 1] = Convert<T>::pack(ds[2], ds[3]);
  }
}

// The dQ staging box's column block (0 or 1) holding a fragment's first column col0.
__device__ __forceinline__ int bwd_dq_block0(int col0) { return (col0 / 32) % 2; }

// One thread's dQ accumulator fragment (rows r and r + 8 of a 32-row block with r % 8 == g; columns
// col0 + 8k + 2 t4 + {0, 1} of k = 0 .. N / 4 - 1, b0 = bwd_dq_block0(col0)) into the fp32 staging boxes
// the dQ writer reduces (kBwdDqBoxBytes: 32 rows x 64 columns, smem row p = 2 r + b holding row r's
// 32-column block b, 128B swizzle: column c at 16-byte chunk (c % 32) / 4 XOR p % 8, word pair
// (c / 2) % 2 = t4 & 1).
// row_base: the first box + (2 r + b0) x 128 + (t4 & 1) x 8; block k sits in box k / 8, column block
// b0 + (k / 4) % 2 (b0 = 1 only for a fragment of one 32-column block, N = 16), row r + 8 at smem row
// p + 16 (the same phase). Why this box shape: 64-bit stores are served per half-warp, whose lanes hold
// rows r % 4 = g % 4 at chunks 2 (k % 4) + t4 / 2. With 64-row boxes of one 32-column block (smem row =
// row, session 41 and before) the phase r % 8 moved only chunk bits 0-1, as t4 / 2 does: the 16 lanes met
// on 4 chunks, a two-way conflict on every store (ncu, H100, D 128 N8 P16K R2K: 33 conflicted wavefronts
// per warp and step against FA4's 1.4). With p = 2 r + b the phase 2 (g % 4) + b moves bits 1-2: 8 chunks
// x 2 word pairs, conflict-free, every lane storing block k at store k (session 41's cure by columns cost
// four selects per store pair; 1.025 of the D-256 kernel's time).
// w0 / w1: rows r / r + 8 stored (else 0: the reduce box always covers 32 rows).
template <int N>
__device__ __forceinline__ void bwd_stage_dq_fragment(uint32_t row_base, const float (&dq)[N], int g, int t4, int col0,
                                                      bool w0, bool w1) {
  static_assert(N % 16 == 0, "bwd_stage_dq_fragment: whole 32-column blocks");
  // The swizzle phase of block k < 4, and chunk 2 (k % 4) + half of block k.
  const uint32_t x = static_cast<uint32_t>(bwd_dq_block0(col0) | ((g & 3) << 1));
  const uint32_t half = static_cast<uint32_t>(t4 >> 1);
#pragma unroll
  for (int k = 0; k < N / 4; ++k) {
    const uint32_t b = (k / 4) % 2;  // the box's second column block: smem row + 1, phase + 1
    const uint32_t addr = row_base + (k / 8) * kBwdDqBoxBytes + b * 128 + (((2u * (k % 4) + half) ^ (x ^ b)) << 4);
    bwd_st_shared_f32x2(addr, w0 ? dq[4 * k + 0] : 0.f, w0 ? dq[4 * k + 1] : 0.f);
    bwd_st_shared_f32x2(addr + 16 * 128, w1 ? dq[4 * k + 2] : 0.f, w1 ? dq[4 * k + 3] : 0.f);
  }
}

// bwd_stage_dq_fragment's row_base for the thread's query row q_r of the step (r % 8 == g) and its
// first column col0, in a stage of box_cols 64-column boxes per 32-row block (row block major).
__device__ __forceinline__ uint32_t bwd_dq_row_base(uint32_t stage, int box_cols, int q_r, int col0, int t4) {
  return stage + static_cast<uint32_t>(((q_r / 32) * box_cols + col0 / 64) * kBwdDqBoxBytes) +
         static_cast<uint32_t>((2 * (q_r % 32) + bwd_dq_block0(col0)) * 128 + (t4 & 1) * 8);
}

// The dQ writer's reduces of one staged step of BM rows: per 32-row block (one wholly past qb, staged
// as zeros, skipped) and 64-column box, one TMA reduce-add into dq_accum[qt + 32 rb.., h, :]. Each of
// the kHalves stages holds kBoxCols boxes per block, half i from column 64 kBoxCols i on (the D-256
// kernel's Q and dO stages; one stage for the D <= 128 kernels).
template <int BM, int kBoxCols, int kHalves>
__device__ __forceinline__ void bwd_reduce_dq_stage(const CUtensorMap* map, const uint8_t* const (&stages)[kHalves],
                                                    int h, int32_t qt, int32_t qb) {
#pragma unroll
  for (int rb = 0; rb < BM / 32; ++rb) {
    if (rb == 0 || qt + rb * 32 < qb) {
#pragma unroll
      for (int b = 0; b < kBoxCols; ++b) {
#pragma unroll
        for (int i = 0; i < kHalves; ++i)
          tma_reduce_add_4d(map, stages[i] + (rb * kBoxCols + b) * kBwdDqBoxBytes, 0, 2 * (kBoxCols * i + b), h,
                            qt + rb * 32);
      }
    }
  }
}

// dq_full arrivals: as qdo_empty, one per consumer warp (every thread in the
// per-thread-release diagnostic build).
constexpr uint32_t kBwdDqFullCount = kBwdQdoEmptyCount;

// Mods: the mask modifiers compiled in (modifiers.cuh: only kSoftcap changes this kernel).
// kPrefix (external prefix, issue 17): the plan may hold prefix items: the producer loads their K/V
// tile through the prefix buffers' tensor maps, no step of theirs is diagonal (only the rows past
// klen are masked), and their dK/dV are added into prefix_dk / prefix_dv; instantiated with
// NoModifiers only. The default instantiation is the kernel as it was before either.
template <typename T, int D, bool kAtomicDq, typename Mods = NoModifiers, bool kPrefix = false>
__global__ void __launch_bounds__(Sm90BwdConfig<D>::kThreads, 1)
bwd_sm90_kernel(const __grid_constant__ Sm90BwdParams<D> p) {
  // The deterministic kernel computes no dQ, so it has no dQ writer (nor staging).
  constexpr bool kBulk = kAtomicDq;
  using C = Sm90BwdConfig<D, kBulk, sm90_bwd_block_m(D, Mods::kSoftcap)>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t pad = (1024u - (smem_u32(smem_raw) & 1023u)) & 1023u;
  uint8_t* smem = smem_raw + pad;
  float* s_lse = reinterpret_cast<float*>(smem + C::kOffLse);
  float* s_delta = reinterpret_cast<float*>(smem + C::kOffDelta);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + C::kOffBar);
  Sm90BwdBarriers B;
  B.item_full = bars;
  B.item_empty = bars + 2;
  B.kv_full = bars + 4;
  B.kv_empty = bars + 5;
  B.qdo_full = bars + 6;
  B.qdo_empty = bars + 8;
  B.items = reinterpret_cast<int32_t*>(bars + 10);
  if constexpr (kBulk) {
    B.dq_full = bars + 12;
    B.dq_empty = bars + 14;
  }

  const BwdArgs& a = p.a;
  const LayoutPtrs& L = a.layout;
  const int32_t* plan = a.plan;
  if (!plan_matches(plan, L)) return;
  const int32_t n_work = plan[kHdrNumBwd];
  const int32_t* witems = plan + plan[kHdrBwdOffset];
  const int H = a.num_heads, Hk = a.num_kv_heads;
  const int group = H / Hk;
  const int32_t n_items = n_work * Hk;

  if (threadIdx.x == 0) {
    for (int i = 0; i < 2; ++i) {
      mbar_init(&B.item_full[i], 1);
      mbar_init(&B.item_empty[i], kBwdConsumerWarps * kArrivalsPerWarp + (kBulk ? 1 : 0));
      mbar_init(&B.qdo_full[i], kBwdQdoFullCount);
      mbar_init(&B.qdo_empty[i], kBwdQdoEmptyCount);
      if constexpr (kBulk) {
        mbar_init(&B.dq_full[i], kBwdDqFullCount);
        mbar_init(&B.dq_empty[i], 1);
      }
    }
    mbar_init(B.kv_full, 1);
    mbar_init(B.kv_empty, kBwdConsumerWarps);
    mbar_fence_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ------------------------------------------------------------------ producer (warp 0)
    setmaxnreg_dec<C::kProducerRegs>();
    if constexpr (kBulk) {
      if (threadIdx.x == 32) {
        // ---------------------------------------------------------------- dQ writer (warp 1)
        // Follows the consumers' items and steps; per step, once both warpgroups staged their dQ
        // halves (dq_full), adds the step's tile to dq_accum[qt.., h, :] with one TMA reduce per
        // 32 x 64 box (rows past T are clipped by TMA; rows in [qb, qt + BM) were staged as 0).
        // The buffer is handed back once the reduces have read it; their global adds complete
        // asynchronously (waited for only before exit).
        tma_prefetch_desc(&p.tdq);
        uint32_t step = 0;
        for (uint32_t n = 0;; ++n) {
          const uint32_t slot = n & 1, ph = (n >> 1) & 1;
          mbar_wait(&B.item_full[slot], ph);
          const int32_t item = B.items[slot];
          mbar_arrive(&B.item_empty[slot]);
          if (item >= n_items) break;
          const int32_t w = item / Hk;
          const int hk = item - w * Hk;
          const int32_t* wi = witems + w * kBwdItemInts;
          const int32_t qa = wi[3], qb = wi[4];
          const int32_t tiles = (qb - qa + BM - 1) / BM;
          const int32_t n_steps = tiles * group;
          for (int32_t s = 0; s < n_steps; ++s, ++step) {
            const int h = hk * group + s / tiles;
            const int32_t qt = qa + (s % tiles) * BM;
            const uint32_t st = C::kDqStages == 2 ? step & 1 : 0;
            const uint32_t dq_ph = C::kDqStages == 2 ? (step >> 1) & 1 : step & 1;
            mbar_wait(&B.dq_full[st], dq_ph);
            const uint8_t* const stage[1] = {smem + C::kOffDQ + st * C::kDqStageBytes};
            bwd_reduce_dq_stage<BM, C::kDqBoxCols>(&p.tdq, stage, h, qt, qb);
            bulk_commit_group();
            bulk_wait_group_read<0>();
            mbar_arrive(&B.dq_empty[st]);
          }
        }
        // The smem sources are read already; wait for the adds themselves before the CTA retires.
        bulk_wait_group<0>();
        return;
      }
    }
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    if (lane == 0) {
      tma_prefetch_desc(&p.tq);
      tma_prefetch_desc(&p.tk);
      tma_prefetch_desc(&p.tv);
      tma_prefetch_desc(&p.tdo);
      if constexpr (kPrefix) {
        tma_prefetch_desc(&p.tpk);
        tma_prefetch_desc(&p.tpv);
      }
    }
    const int64_t T_ = L.num_tokens;
    uint32_t kv_iter = 0, step = 0;
    for (uint32_t n = 0;; ++n) {
      const uint32_t slot = n & 1, ph = (n >> 1) & 1;
      mbar_wait(&B.item_empty[slot], ph ^ 1);
      int32_t item = 0;
      if (lane == 0) {
        item = bwd_claim_item(p, n_work, Hk);
        B.items[slot] = item;
        mbar_arrive(&B.item_full[slot]);
      }
      item = __shfl_sync(0xffffffffu, item, 0);
      if (item >= n_items) break;
      const int32_t w = item / Hk;
      const int hk = item - w * Hk;
      const int32_t* wi = witems + w * kBwdItemInts;
      const int32_t k0 = wi[1], qa = wi[3], qb = wi[4];
      if (lane == 0) {
        // The item's tensor maps: the layout's K / V, or the prefix buffers' for a prefix item.
        const bool pre = kPrefix && is_prefix_item(L, wi[0]);
        const CUtensorMap* tk = pre ? &p.tpk : &p.tk;
        const CUtensorMap* tv = pre ? &p.tpv : &p.tv;
        mbar_wait(B.kv_empty, (kv_iter & 1) ^ 1);
        mbar_arrive_expect_tx(B.kv_full, 2 * C::kKVBytes);
#pragma unroll
        for (int b = 0; b < C::kBoxes; ++b) {
          tma_load_3d(smem + C::kOffK + b * C::kKVBoxBytes, tk, B.kv_full, b * 64, hk, k0);
          tma_load_3d(smem + C::kOffV + b * C::kKVBoxBytes, tv, B.kv_full, b * 64, hk, k0);
        }
      }
      ++kv_iter;
      const int32_t tiles = (qb - qa + BM - 1) / BM;
      const int32_t n_steps = tiles * group;
      for (int32_t s = 0; s < n_steps; ++s, ++step) {
        const int h = hk * group + s / tiles;
        const int32_t qt = qa + (s % tiles) * BM;
        const uint32_t st = step & 1;
        mbar_wait(&B.qdo_empty[st], ((step >> 1) & 1) ^ 1);
        if (lane == 0) {
          mbar_arrive_expect_tx(&B.qdo_full[st], 2 * C::kQBytes);
#pragma unroll
          for (int b = 0; b < C::kBoxes; ++b) {
            tma_load_3d(smem + C::kOffQ + st * C::kQBytes + b * C::kQBoxBytes, &p.tq, &B.qdo_full[st], b * 64, h,
                        qt);
            tma_load_3d(smem + C::kOffDO + st * C::kQBytes + b * C::kQBoxBytes, &p.tdo, &B.qdo_full[st], b * 64,
                        h, qt);
          }
        }
        bwd_stage_lse_delta<BM>(a, T_, h, qt, qb, lane, s_lse + st * BM, s_delta + st * BM);
        mbar_arrive(&B.qdo_full[st]);
      }
    }
    return;
  }

  // -------------------------------------------------------------------- consumers
  setmaxnreg_inc<C::kConsumerRegs>();
  using MmaS = Wgmma<T, BM>;       // S^T, dP^T: m64 (kv) x n64 (q)
  using MmaKV = Wgmma<T, D>;       // dV, dK: m64 (kv) x nD
  using MmaQ = WgmmaTB<T, C::kDqN>;  // dQ half: m64 (q) x nD/2 (64-row steps) or x nD (128-row steps)
  // Warp-uniform (a shuffle from lane 0; wg itself is the same in every lane but derived from the
  // thread index): the step's wgmma descriptors below are then built once in uniform registers
  // instead of per instruction (SASS: 657 -> 429 instructions per D-128 step, 784 -> 599 at D 64).
  const int cw = __shfl_sync(0xffffffffu, wg - 1, 0);
  const int tid = threadIdx.x & 127;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const float sl2 = a.scale_log2;
  const uint32_t k_rows = smem_u32(smem + C::kOffK) + cw * 64 * 128;  // this warpgroup's 64 KV rows
  const uint32_t v_rows = smem_u32(smem + C::kOffV) + cw * 64 * 128;
  // dQ: B = K[:, cw D/2 .. +D/2] read N-major: box of those columns, byte offset inside its rows.
  // 128-row steps (C::kDqByRows): all of K's D columns, and A = dS rows [64 cw, 64 cw + 64).
  constexpr int kDqBoxCols = C::kDqByRows ? 0 : C::kDqN;
  const uint32_t k_dq = smem_u32(smem + C::kOffK) + ((cw * kDqBoxCols) / 64) * C::kKVBoxBytes +
                        ((cw * kDqBoxCols) % 64) * 2;
  const uint32_t ds_rows = C::kDqByRows ? cw * 64 * 128 : 0;  // byte offset of the warpgroup's dS rows
  const uint32_t q_smem = smem_u32(smem + C::kOffQ);
  const uint32_t do_smem = smem_u32(smem + C::kOffDO);
  const uint32_t ds_smem = smem_u32(smem + C::kOffDS);
  const int kv_row0 = cw * 64 + warp * 16 + g;  // tile-local KV row of accumulator rows (+8 for e >= 2)

  uint32_t kv_iter = 0, step = 0;
  for (uint32_t n = 0;; ++n) {
    const uint32_t slot = n & 1, ph = (n >> 1) & 1;
    mbar_wait(&B.item_full[slot], ph);
    const int32_t item = B.items[slot];
    __syncwarp();
    if (kPerThreadRelease || lane == 0) mbar_arrive(&B.item_empty[slot]);
    if (item >= n_items) break;
    const int32_t w = item / Hk;
    const int hk = item - w * Hk;
    const int32_t* wi = witems + w * kBwdItemInts;
    const int32_t k0 = wi[1], k1 = wi[2], qa = wi[3], qb = wi[4], pslot = wi[5];
    const int klen = k1 - k0;
    const bool prefix_item = kPrefix && is_prefix_item(L, wi[0]);  // k0, k1: prefix rows
    // The sliding window (mask modifiers, issue 16): the item's distance bias (plan_format.h).
    int32_t bias = 0;
    if constexpr (Mods::kWindow) bias = plan[plan[kHdrBwdBiasOffset] + w];
    const int32_t tiles = (qb - qa + BM - 1) / BM;
    const int32_t n_steps = tiles * group;
    // This warpgroup's rows need masking on a tile whose first query precedes its last KV row, or
    // when the tile's KV range ends inside these rows.
    const bool tail = cw * 64 + 63 >= klen;

    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;

    mbar_wait(B.kv_full, kv_iter & 1);
    ++kv_iter;

    int32_t tile_i = 0;  // s % tiles, kept by counting (the producer loads the step's head)
    for (int32_t s = 0; s < n_steps; ++s, ++step) {
      // No integer division in front of the step's first wgmma.
      const int32_t qt = qa + tile_i * BM;
      if (++tile_i == tiles) tile_i = 0;
      const uint32_t st = step & 1;
      const uint32_t qb_s = q_smem + st * C::kQBytes;
      const uint32_t dob_s = do_smem + st * C::kQBytes;
      mbar_wait(&B.qdo_full[st], (step >> 1) & 1);
      // The step's operand descriptors, once: an operand's k16 slice is its base's descriptor
      // advanced by the slice's byte offset (ptx.cuh desc_advance).
      const uint64_t dK0 = make_desc_sw128(k_rows, 16, 1024), dV0 = make_desc_sw128(v_rows, 16, 1024);
      const uint64_t dQ0 = make_desc_sw128(qb_s, 16, 1024), dDO0 = make_desc_sw128(dob_s, 16, 1024);
      const uint64_t dDOt = make_desc_sw128(dob_s, C::kQBoxBytes, 1024);
      const uint64_t dQt = make_desc_sw128(qb_s, C::kQBoxBytes, 1024);
      const uint64_t dKt = make_desc_sw128(k_dq, C::kKVBoxBytes, 1024);

      float sacc[BM / 2], dpacc[BM / 2];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t box = kk / 4, within = (kk % 4) * 32;
        MmaS::ss(sacc, desc_advance(dK0, box * C::kKVBoxBytes + within),
                 desc_advance(dQ0, box * C::kQBoxBytes + within), kk > 0 ? 1 : 0);
      }
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t box = kk / 4, within = (kk % 4) * 32;
        MmaS::ss(dpacc, desc_advance(dV0, box * C::kKVBoxBytes + within),
                 desc_advance(dDO0, box * C::kQBoxBytes + within), kk > 0 ? 1 : 0);
      }
      wgmma_commit();

      // P^T (in place in sacc) once S^T is ready; dP^T may still be running.
      const float* lse_s = s_lse + st * BM;
      const float* delta_s = s_delta + st * BM;
      // At D 64 (128-row steps) the first two lse pairs are read before the wait, so that the first
      // exponentials do not wait for a shared load issued behind it (under ncu, D 128: the first
      // FFMA's short-scoreboard stall was 4% of the backward's warp samples). Measured (H200,
      // backward kernel against the build without it, 4 rounds): D 64 0.985-0.997 on 9 GRPO layouts
      // and classes; D 128 0.970-1.031 and D 256 0.984-1.007 (docs/decisions.md), so D 64 only.
      constexpr int kLsePreload = D == 64 ? 2 : 0;
      float2 lse_first[kLsePreload > 0 ? kLsePreload : 1];
#pragma unroll
      for (int j = 0; j < kLsePreload; ++j) lse_first[j] = *reinterpret_cast<const float2*>(lse_s + j * 8 + 2 * t4);
      wgmma_wait<1>();
      fence_regs(sacc);
      // Softmax under the dP^T wgmma (H200 A/B at 274e72f: main kernel 4-6% faster than computing
      // P^T between wgmma.wait_group 1 and 0, where ptxas sank 28 of the 32 MUFU.EX2 and the
      // masking below the WARPGROUP.DEPBAR of dP^T). P^T is computed in its own branch, masked or
      // not (the test is uniform per warpgroup and step): ptxas does not move it across the join,
      // and an unmasked step skips the per-element mask arithmetic.
      uint32_t pf[BM / 4], dsf[BM / 4];  // A fragments (m = kv, k = q) of P^T and dS^T
      // The sliding window (issue 16): this warpgroup's farthest pair (the step's last query, its
      // first KV row) hidden.
      bool win = false;
      if constexpr (Mods::kWindow) win = SegmentMask::window_tile(qt + BM - 1, k0 + cw * 64, bias, a.window);
      // The step's work in pieces of k16 steps [kk_lo, kk_hi) (query columns 16 kk_lo .. 16 kk_hi),
      // integral constants:
      // P^T in place in sacc, each case in its own branch (above).
      // then...: work run inside each branch after the exponentials (kExpSplit below), so that ptxas may
      // interleave it with them.
      auto softmax_p = [&](auto kk_lo, auto kk_hi, auto... then) {
        constexpr int J0 = 2 * decltype(kk_lo)::value, J1 = 2 * decltype(kk_hi)::value;  // n8 blocks
        if constexpr (kPrefix) {
          if (prefix_item) {  // every query of the range sees every row: only a ragged end is masked
            if (tail) {
              bwd_softmax_p<BM / 2, false, false, kLsePreload, J0, J1>(sacc, lse_s, sl2, t4, kv_row0, klen, k0, qt,
                                                                       true, 0, 0, lse_first);
              (then(), ...);
            } else {
              bwd_softmax_p<BM / 2, false, false, kLsePreload, J0, J1>(sacc, lse_s, sl2, t4, kv_row0, klen, k0, qt,
                                                                       false, 0, 0, lse_first);
              (then(), ...);
            }
          }
        }
        if (!prefix_item) {
          const bool mask = tail || qt < k0 + cw * 64 + 63 || win;
          if (mask) {
            bwd_softmax_p<BM / 2, true, Mods::kWindow, kLsePreload, J0, J1>(sacc, lse_s, sl2, t4, kv_row0, klen, k0,
                                                                            qt, true, bias, a.window, lse_first);
            (then(), ...);
          } else {
            bwd_softmax_p<BM / 2, true, Mods::kWindow, kLsePreload, J0, J1>(sacc, lse_s, sl2, t4, kv_row0, klen, k0,
                                                                            qt, false, bias, a.window, lse_first);
            (then(), ...);
          }
        }
      };
      // dS^T = P^T (dP^T - delta) in place in dpacc.
      auto ds = [&](auto kk_lo, auto kk_hi) {
#pragma unroll
        for (int j = 2 * decltype(kk_lo)::value; j < 2 * decltype(kk_hi)::value; ++j) {
          const float2 d2 = *reinterpret_cast<const float2*>(delta_s + j * 8 + 2 * t4);
#pragma unroll
          for (int e = 0; e < 4; ++e)
            dpacc[4 * j + e] = sacc[4 * j + e] * (dpacc[4 * j + e] - ((e & 1) ? d2.y : d2.x));
        }
      };
      // P^T and dS^T packed into their A fragments.
      auto pack = [&](auto kk_lo, auto kk_hi) {
#pragma unroll
        for (int kk = decltype(kk_lo)::value; kk < decltype(kk_hi)::value; ++kk) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            pf[4 * kk + i] = Convert<T>::pack(sacc[8 * kk + 2 * i], sacc[8 * kk + 2 * i + 1]);
            dsf[4 * kk + i] = Convert<T>::pack(dpacc[8 * kk + 2 * i], dpacc[8 * kk + 2 * i + 1]);
          }
        }
      };
      // dV += P^T dO (B = dO [q][d] read N-major: k = q, n = d), one wgmma group.
      auto issue_dv = [&](auto kk_lo, auto kk_hi) {
        wgmma_fence();
#pragma unroll
        for (int kk = decltype(kk_lo)::value; kk < decltype(kk_hi)::value; ++kk)
          MmaKV::rs(dv, &pf[4 * kk], desc_advance(dDOt, kk * 16 * 128), 1);
        wgmma_commit();
      };
      // dK += dS^T Q (B = Q [q][d] read N-major), one wgmma group.
      // Callers fence first where dsf was written since the last wgmma_fence.
      auto issue_dk = [&](auto kk_lo, auto kk_hi) {
#pragma unroll
        for (int kk = decltype(kk_lo)::value; kk < decltype(kk_hi)::value; ++kk)
          MmaKV::rs(dk, &dsf[4 * kk], desc_advance(dQt, kk * 16 * 128), 1);
        wgmma_commit();
      };
      // dS^T (kv x q fragments) -> dS [q][kv] for the dQ wgmma, 128B-swizzled boxes of 64 kv columns
      // (the dQ-computing kernel only).
      auto store_ds = [&](auto kk_lo, auto kk_hi) {
        const uint32_t ds_buf = ds_smem + st * C::kDSBytes;
        const int m = lane >> 3;
        const int kvl = cw * 64 + warp * 16 + (m & 1) * 8;
        const uint32_t chunk = static_cast<uint32_t>((kvl % 64) / 8);
        const uint32_t box_base = ds_buf + (kvl / 64) * C::kDSBoxBytes;
#pragma unroll
        for (int kk = decltype(kk_lo)::value; kk < decltype(kk_hi)::value; ++kk) {
          const uint32_t q = kk * 16 + (m >> 1) * 8 + (lane & 7);
          bwd_stmatrix_x4_trans(box_base + q * 128 + ((chunk ^ (q & 7)) << 4), dsf[4 * kk + 0], dsf[4 * kk + 1],
                                dsf[4 * kk + 2], dsf[4 * kk + 3]);
        }
      };
      using KK0 = std::integral_constant<int, 0>;
      using KKHalf = std::integral_constant<int, BM / 32>;
      using KKAll = std::integral_constant<int, BM / 16>;
      constexpr bool kHalves = C::kSoftmaxHalves && !Mods::kSoftcap;
      // D 128 (64-row steps), the dQ-computing kernel without a softcap: half of a step's exponentials
      // under dP^T, the other half after its wait, interleaved with dS^T's arithmetic (FA3 / FA4's
      // split; ncu had our 32 MUFU.EX2 in one run at 3.2x FA4's samples per MUFU). Same values in the
      // same registers: outputs bit for bit.
      constexpr bool kExpSplit = kAtomicDq && D == 128 && !kHalves && !Mods::kSoftcap;
      // dK's k steps [0, kDkIssued) are issued before the dQ wgmma (the rest after it, below).
      //   64-row steps (kDkHead): at D = 128, with all of dK behind dQ, ptxas (13.0) serialises
      //   every wgmma of the kernel ("insufficient register resources", C7512); with one k step of
      //   dK in flight before dQ it keeps the pipeline (consumers at 228 registers of 232). The D-64
      //   softcap kernels keep all of dK behind dQ. Each choice is the one without a warning.
      //   128-row steps, in halves: the first half's.
      constexpr int kDkHead = D == 128 ? 1 : 0;
      constexpr int kDkIssued = !kAtomicDq ? BM / 16 : kHalves ? BM / 32 : kDkHead;
      // D 128 (64-row steps), the dQ-computing kernel (kDsEarly, FA4's order; 2026-12-04,
      // docs/notes/2026-12-04-d128-bwd-ds-order.md: 0.96-1.00 of the backward kernel's time over two
      // runs, 0.98-0.99 on long layouts): the 4 STSM of dS in the branch of dS^T's arithmetic, right
      // after its packing (ptxas interleaves them with it), before the dV issue. The proxy fence stays
      // after the dV issue: each thread's fence follows its own dS stores and precedes barrier 1, after
      // which the dQ wgmmas of both warpgroups read dS through the async proxy; dV, issued between the
      // stores and the fence, reads registers and dO, never the dS buffer. The same wgmmas on the same
      // accumulators in the same order: outputs bit for bit. (The fence after dK's first k step as well
      // measured 0.979-1.021, alone 0.991-1.010: not taken.)
      constexpr bool kDsEarly = kAtomicDq && D == 128 && !kHalves;  // kDkIssued is kDkHead = 1 there
      if constexpr (kHalves) {
        // In two halves of the step's query columns (C::kSoftmaxHalves): the first half's P^T under
        // the dP^T wgmma; then its dS^T, and dV and dK on that half issued before the second half's
        // exponentials, which run under them. Issued before, not under dP^T: there the second
        // half's scores, all of dP^T and the first half's fragments would need 233 registers
        // (ptxas 13.0 serialised the wgmmas and spilled 16 bytes). The same wgmmas on the same
        // accumulators in the same order (dV's and dK's k steps ascending, dQ after both halves of
        // dS): dK, dV and dQ are bit for bit those of the kernel without halves.
        softmax_p(KK0{}, KKHalf{});
        wgmma_wait<0>();
        fence_regs(dpacc);
        ds(KK0{}, KKHalf{});
        pack(KK0{}, KKHalf{});
        if constexpr (kAtomicDq) store_ds(KK0{}, KKHalf{});
        issue_dv(KK0{}, KKHalf{});  // fences dsf too
        issue_dk(KK0{}, KKHalf{});
        softmax_p(KKHalf{}, KKAll{});
        ds(KKHalf{}, KKAll{});
        pack(KKHalf{}, KKAll{});
        if constexpr (kAtomicDq) {
          store_ds(KKHalf{}, KKAll{});
          bwd_fence_proxy_async();
        }
        issue_dv(KKHalf{}, KKAll{});
        if constexpr (!kAtomicDq) issue_dk(KKHalf{}, KKAll{});
      } else {
        if constexpr (Mods::kSoftcap) {  // mask modifiers (issue 16)
          static_assert(!kPrefix, "sm90 backward: prefix items are instantiated without modifiers");
          const bool mask = tail || qt < k0 + cw * 64 + 63 || win;
          wgmma_wait<0>();
          fence_regs(dpacc);
          if (mask)
            bwd_softcap_p_ds<T, BM / 2, Mods::kWindow>(sacc, dpacc, pf, dsf, lse_s, delta_s, a, t4, kv_row0, klen, k0,
                                                       qt, true, bias);
          else
            bwd_softcap_p_ds<T, BM / 2, Mods::kWindow>(sacc, dpacc, pf, dsf, lse_s, delta_s, a, t4, kv_row0, klen, k0,
                                                       qt, false, bias);
          if constexpr (kDsEarly) store_ds(KK0{}, KKAll{});
        } else if constexpr (kExpSplit) {
          // FA3 / FA4's placement of the exponentials (2026-12-04, docs/notes/2026-12-04-bwd-ncu.md):
          // the first half's 16 under the dP^T wgmma, the second half's after its wait, in the same
          // branch as all of dS^T's arithmetic and packing, which ptxas interleaves with them.
          softmax_p(KK0{}, KKHalf{});
          wgmma_wait<0>();
          fence_regs(dpacc);
          softmax_p(KKHalf{}, KKAll{}, [&] {
            ds(KK0{}, KKAll{});
            pack(KK0{}, KKAll{});
            if constexpr (kDsEarly) store_ds(KK0{}, KKAll{});  // in the branch: under the arithmetic
          });
        } else {
          softmax_p(KK0{}, KKAll{});
          wgmma_wait<0>();
          fence_regs(dpacc);
          ds(KK0{}, KKAll{});
          pack(KK0{}, KKAll{});
        }
        issue_dv(KK0{}, KKAll{});
        if constexpr (kAtomicDq) {
          if constexpr (!kDsEarly) store_ds(KK0{}, KKAll{});
          bwd_fence_proxy_async();  // dS stores before the dQ wgmmas' reads
        }
        if constexpr (kDkIssued > 0) issue_dk(KK0{}, std::integral_constant<int, kDkIssued>{});
      }

      if constexpr (kAtomicDq) {
        named_bar_sync(kBwdDsBarrier, 256);  // both halves of dS written
        const uint64_t dDS0 = make_desc_sw128(ds_smem + st * C::kDSBytes + ds_rows, 16, 1024);
        float dq[C::kDqN / 2];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
          const uint32_t box = kk / 4, within = (kk % 4) * 32;
          MmaQ::ss(dq, desc_advance(dDS0, box * C::kDSBoxBytes + within),
                   desc_advance(dKt, kk * 16 * 128), kk > 0 ? 1 : 0);
        }
        wgmma_commit();
        // dQ first, (the rest of) dK behind it (FA3/FA4's order): wait_group 1 retires dV and dQ
        // while dK still runs, so the dQ staging below (dq_empty wait, stores, fence, dq_full)
        // overlaps dK on the tensor pipe instead of following all three with nothing in flight.
        // dK's operands (dsf, the dk accumulators, Q) stay untouched until wait_group 0; qdo_empty
        // (Q is dK's B operand) is released only after it. The same wgmmas on the same
        // accumulators in the same order as before: dK, dV and each step's dQ are bit for bit
        // unchanged.
        issue_dk(std::integral_constant<int, kDkIssued>{}, KKAll{});
        wgmma_wait<1>();
        fence_regs(dq);
        fence_regs(dv);
        fence_regs(pf);  // dV's A fragments: free for the staging's registers
        // Stage this warpgroup's dQ half for the writer (bwd_stage_dq_fragment): rows r0 = 16 warp + g
        // and r0 + 8 (one 32-row block), the half's columns (from col0) in its boxes. Rows >= qb as 0.
        // 128-row steps: rows 64 cw + r0 (+ 8), all D columns; one buffer.
        const uint32_t dst = C::kDqStages == 2 ? st : 0;
        mbar_wait(&B.dq_empty[dst], (C::kDqStages == 2 ? (step >> 1) & 1 : step & 1) ^ 1);
        const int r0 = warp * 16 + g;
        const int q_r0 = C::kDqByRows ? cw * 64 + r0 : r0;  // step-local query row
        const bool v0 = qt + q_r0 < qb, v1 = qt + q_r0 + 8 < qb;
        const int col0 = C::kDqByRows ? 0 : cw * C::kDqN;  // the warpgroup's first column
        const uint32_t row_base = bwd_dq_row_base(smem_u32(smem + C::kOffDQ) + dst * C::kDqStageBytes, C::kDqBoxCols,
                                                  q_r0, col0, t4);
        // A full query tile stores without the row selects (each call compiles its own stores).
        if (qt + (C::kDqByRows ? cw * 64 + 64 : BM) <= qb)
          bwd_stage_dq_fragment(row_base, dq, g, t4, col0, true, true);
        else
          bwd_stage_dq_fragment(row_base, dq, g, t4, col0, v0, v1);
        // Generic-proxy stores before the writer's async-proxy (TMA) reads.
        bwd_fence_proxy_async();
        __syncwarp();
        if (kBwdDqFullCount != kBwdConsumerWarps || lane == 0) mbar_arrive(&B.dq_full[dst]);
        wgmma_wait<0>();  // dK retired: Q, dO (dV retired already) and lse/delta are free
        fence_regs(dk);
        fence_regs(dsf);
        __syncwarp();
        if (kBwdQdoEmptyCount != kBwdConsumerWarps || lane == 0) mbar_arrive(&B.qdo_empty[st]);
      } else {
        wgmma_wait<0>();
        fence_regs(dk);
        fence_regs(dv);
        fence_regs(pf);
        fence_regs(dsf);
        __syncwarp();
        if (kBwdQdoEmptyCount != kBwdConsumerWarps || lane == 0) mbar_arrive(&B.qdo_empty[st]);
      }
    }
    // K and V are free: the producer may load the next item's tile during the epilogue.
    __syncwarp();
    if (lane == 0) mbar_arrive(B.kv_empty);

    // Epilogue: dK scaled by the softmax scale and dV, or fp32 partials (unscaled) for a split.
    // The tile's valid rows of dK (scaled) and dV in T: added into the external prefix's gradients
    // (kAdd) or stored to dk / dv. The fields of `a` are read where they are used (the stores may
    // alias them for the compiler: passing them in as values changed the machine code).
    auto store_dk_dv = [&](auto add) {
      constexpr bool kAdd = decltype(add)::value;
      T* dkb = static_cast<T*>(kAdd ? a.prefix_dk : a.dk) + static_cast<int64_t>(k0) * (kAdd ? a.pdk_ts : a.dk_ts) +
               static_cast<int64_t>(hk) * (kAdd ? a.pdk_hs : a.dk_hs);
      T* dvb = static_cast<T*>(kAdd ? a.prefix_dv : a.dv) + static_cast<int64_t>(k0) * (kAdd ? a.pdv_ts : a.dv_ts) +
               static_cast<int64_t>(hk) * (kAdd ? a.pdv_hs : a.dv_hs);
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = kv_row0 + hr * 8;
        if (r < klen) {
#pragma unroll
          for (int j = 0; j < D / 8; ++j) {
            const int col = j * 8 + 2 * t4;
            if constexpr (kAdd) {
              uint32_t* pk = reinterpret_cast<uint32_t*>(dkb + static_cast<int64_t>(r) * a.pdk_ts + col);
              uint32_t* pv = reinterpret_cast<uint32_t*>(dvb + static_cast<int64_t>(r) * a.pdv_ts + col);
              const float2 ok = Convert<T>::unpack(*pk), ov = Convert<T>::unpack(*pv);
              *pk = Convert<T>::pack(ok.x + dk[4 * j + 2 * hr] * a.scale, ok.y + dk[4 * j + 2 * hr + 1] * a.scale);
              *pv = Convert<T>::pack(ov.x + dv[4 * j + 2 * hr], ov.y + dv[4 * j + 2 * hr + 1]);
            } else {
              *reinterpret_cast<uint32_t*>(dkb + static_cast<int64_t>(r) * a.dk_ts + col) =
                  Convert<T>::pack(dk[4 * j + 2 * hr] * a.scale, dk[4 * j + 2 * hr + 1] * a.scale);
              *reinterpret_cast<uint32_t*>(dvb + static_cast<int64_t>(r) * a.dv_ts + col) =
                  Convert<T>::pack(dv[4 * j + 2 * hr], dv[4 * j + 2 * hr + 1]);
            }
          }
        }
      }
    };
    if (prefix_item && pslot < 0) {
      // external prefix (issue 17): added into the prefix rows' gradients (one item per row).
      store_dk_dv(std::true_type{});
    } else if (pslot < 0) {
      store_dk_dv(std::false_type{});
    } else {
      float* base = a.partials + ((static_cast<int64_t>(pslot) * Hk + hk) * 2) * BN * D;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = kv_row0 + hr * 8;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          const int col = j * 8 + 2 * t4;
          *reinterpret_cast<float2*>(base + r * D + col) = make_float2(dk[4 * j + 2 * hr], dk[4 * j + 2 * hr + 1]);
          *reinterpret_cast<float2*>(base + BN * D + r * D + col) =
              make_float2(dv[4 * j + 2 * hr], dv[4 * j + 2 * hr + 1]);
        }
      }
    }
  }
}

}  // namespace dualkv::cuda::sm90
