// Portable (sm80+, mma.sync) backward main kernel: KV-tile-outer. A KV tile [k0, k1) of segment s
// is seen exactly by the queries of SegmentMask::bwd_query_range (its own causal queries, then every
// descendant's tokens, contiguous in DFS order) with the single rule k <= q. dK/dV accumulate in
// registers over that range and over the H/Hk query heads of the KV head (GQA summed in fp32), so
// no atomics touch dK/dV; very long ranges are split into work items writing fp32 partials (summed
// by the postprocess). dQ: fp32 atomics into the accumulator (converted by the postprocess), or,
// in deterministic mode, nothing here (bwd_dq_kernel.cuh).
#pragma once

#include <cuda_runtime.h>
#include <math_constants.h>

#include <cstddef>
#include <type_traits>

#include "dualkv/mask.h"
#include "kernel_params.h"
#include "modifiers.cuh"
#include "plan_reader.cuh"
#include "sm80/config.h"
#include "sm80/ptx.cuh"

namespace dualkv::cuda::sm80 {

// Epilogue of both KV kernels: the warp's dK (times the softmax scale) and dV fragments, rows
// row_g + 16 mi + 8 hr of the tile (row_g = the warp's first row + g), columns 8 j from the pointers
// (which already include the thread's column). Straight to dk / dv for rows < klen, ...
template <int MI, int kDB, typename T>
__device__ __forceinline__ void store_dk_dv(const BwdArgs& args, const float (&dk)[MI][kDB][4],
                                            const float (&dv)[MI][kDB][4], T* dkb, T* dvb, int row_g, int klen) {
  using Ops = TypeOps<T>;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row_g + mi * 16 + hr * 8;
      const bool ok = row < klen;
#pragma unroll
      for (int j = 0; j < kDB; ++j) {
        if (ok) {
          *reinterpret_cast<uint32_t*>(dkb + row * args.dk_ts + j * 8) =
              Ops::pack(dk[mi][j][2 * hr] * args.scale, dk[mi][j][2 * hr + 1] * args.scale);
          *reinterpret_cast<uint32_t*>(dvb + row * args.dv_ts + j * 8) = Ops::pack(dv[mi][j][2 * hr], dv[mi][j][2 * hr + 1]);
        }
      }
    }
  }
}
// external prefix (issue 17): the same fragments ADDED into a prefix item's rows of prefix_dk /
// prefix_dv (the pointers include the thread's column): the caller's value plus the fp32 sum,
// rounded once. One item owns each prefix row (a prefix has one referencing segment), so no atomics.
template <int MI, int kDB, typename T>
__device__ __forceinline__ void store_dk_dv_accumulate(const BwdArgs& args, const float (&dk)[MI][kDB][4],
                                                       const float (&dv)[MI][kDB][4], T* dkb, T* dvb, int row_g,
                                                       int klen) {
  using Ops = TypeOps<T>;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row_g + mi * 16 + hr * 8;
      if (row < klen) {
#pragma unroll
        for (int j = 0; j < kDB; ++j) {
          uint32_t* pk = reinterpret_cast<uint32_t*>(dkb + row * args.pdk_ts + j * 8);
          uint32_t* pv = reinterpret_cast<uint32_t*>(dvb + row * args.pdv_ts + j * 8);
          const float2 ok = Ops::unpack(*pk), ov = Ops::unpack(*pv);
          *pk = Ops::pack(ok.x + dk[mi][j][2 * hr] * args.scale, ok.y + dk[mi][j][2 * hr + 1] * args.scale);
          *pv = Ops::pack(ov.x + dv[mi][j][2 * hr], ov.y + dv[mi][j][2 * hr + 1]);
        }
      }
    }
  }
}
// ... or, for a split item, as unscaled fp32 partials: dK at base, dV at base + BN D (row pitch D).
template <int BN, int D, int MI, int kDB>
__device__ __forceinline__ void store_dk_dv_partial(float* base, const float (&dk)[MI][kDB][4],
                                                    const float (&dv)[MI][kDB][4], int row_g) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row_g + mi * 16 + hr * 8;
#pragma unroll
      for (int j = 0; j < kDB; ++j) {
        *reinterpret_cast<float2*>(base + row * D + j * 8) = make_float2(dk[mi][j][2 * hr], dk[mi][j][2 * hr + 1]);
        *reinterpret_cast<float2*>(base + BN * D + row * D + j * 8) = make_float2(dv[mi][j][2 * hr], dv[mi][j][2 * hr + 1]);
      }
    }
  }
}

// ---- Backward main kernel (KV-tile-outer) ----
// One CTA per work item (a KV tile of the plan and its query range, for one KV head): dK and dV of
// the tile accumulate in registers over every BM-row query step of the range and every query head
// of the KV head's group. BM (kStepM) is the plan's 64-row split granularity, or 128 at D = 64
// where the device holds it (tile_size.h sm80_bwd_block_m; a range that is an odd number of 64-row
// blocks long ends in a step of 64 valid rows, zero-filled past them with lse = +inf, so P = 0 there,
// as every partial step). Per step (FlashAttention-2's order; measured at head dim 128 on the H200,
// docs/notes/2026-11-30-portable-backward.md):
//  - Q is double-buffered (kQStages = 2): Q of step s + 1 is issued after the first k16 step of S
//    (the third at 128-row steps: kIssueQKK), after the barrier that opens step s, and has the rest
//    of the step to land. On devices whose shared memory cannot hold two Q buffers (D = 256 on
//    A100: 179 KB; D = 64 on sm_86/89: 100 KB at 64-row steps), kQStages = 1: Q(s + 1) is issued
//    after an extra barrier that follows dK, its last reader.
//  - S^T = K Q^T, then dP^T = V dO^T with P^T computed and stored during the dP product (the
//    MUFU latency and the stores overlap mma.sync); dS^T = P^T (dP^T - delta) after it. [bar A]
//  - dV += P^T dO (lse/delta of step s + 1 loaded into a register after its first k16 step; stored
//    to shared memory at the end of the step: no warp waits a global latency). [bar B]
//  - dQ = dS K and its fp32 atomics (dO of step s + 1 issued after the first k16 step), then dK +=
//    dS^T Q: the atomics drain while the dK mma.sync run.
//  - One wait and barrier per step at its top (Q, dO, lse, delta of this step). The Q/dO loader
//    has compile-time chunk counts, the step's head / query tile advance incrementally, the
//    ldmatrix addresses are 32-bit shared-memory offsets, and the item (k0, query range, slot,
//    head) is decoded by thread 0 into shared memory and re-read where used: with it in registers
//    the loop spills on sm_90a.
//
// Shared-memory hazards, step s (q[b] with b = s & 1 when kQStages = 2; "top" = cp.async.wait_all
// + bar at the start of step s; every other barrier is CTA-wide too):
//   q[b]     read: S (before bar A), dK (after bar B). q[b ^ 1] is written by the cp.async of
//            Q(s + 1), issued after top(s): its previous readers are S and dK of step s - 1,
//            which every thread finished before arriving at top(s). Q(s + 1) is complete and
//            visible at top(s + 1) (each thread waits for its own copies, then the barrier).
//            kQStages = 1: Q(s + 1) is issued after bar C, which follows every thread's dK.
//   dout     read: dP (before bar A), dV (between bar A and bar B). dO(s + 1) is issued after
//            bar B; nothing reads dout after bar B in step s. Visible at top(s + 1).
//   pt       written before bar A, read between bar A and bar B (dV). Next written after top(s + 1).
//   dst      written before bar A, read after bar B (dQ, dK). Next written after top(s + 1).
//   lse_delta read before bar A (P, dS). The values of step s + 1 are stored after the dK product
//            (after bar B, so after every read of step s), read after top(s + 1).
//   k, v     read only inside the step loop; the next item's loads are issued after the item
//            loop's own barriers, which follow the last step of every thread.
//   si       written by thread 0 between the item loop's two barriers, read by everyone after
//            the second one and until the next item's first one.
//   Across items: the last step issues nothing (no next step), so no cp.async is in flight
//   into q/dout when the next item's prologue issues its loads into q[0] and dout.
// The step's rows (BM = 64 or 128) change none of these: every buffer is sized by BM, every
// product and store of a step sits in the same barrier interval, and lse_delta is still written by
// threads below 2 BM only (all 256 at BM = 128).
template <int D, typename T, int kQStages, int kStepM = plan_tiles(D).bwd_block_m>
struct BwdSmem {
  using C = BwdConfig<D, kStepM>;
  T k[C::kBlockN * C::kPitch];
  T v[C::kBlockN * C::kPitch];
  T q[kQStages][C::kBlockM * C::kPitch];  // by step parity
  T dout[C::kBlockM * C::kPitch];
  T pt[C::kBlockN * C::kPitchS];   // P^T  [kv][q]
  T dst[C::kBlockN * C::kPitchS];  // dS^T [kv][q]
  float lse_delta[2 * C::kBlockM];  // [0, BM): lse * log2(e), +inf for rows past the range;
                                   // [BM, 2 BM): delta, 0 past the range
};

// Item state of bwd_kv_kernel, decoded by thread 0 (CTA-uniform, read from shared memory).
struct BwdItem {
  int32_t done, hk, k0, klen, qa, qb, slot, h_end;
  // The group's first query head, and the group size H / Hk (written once by thread 0 before the
  // item loop, re-read by it per item): no value of the prologue is held through the item loop
  // (that spilled 4 bytes in the sm_90a deterministic kernel).
  int32_t h_begin, group;
  int32_t prefix;  // external prefix (issue 17): a prefix item (prefix instantiations only)
};
// The sliding window (mask modifiers, issue 16): the item's distance bias from the windowed plan
// (plan_format.h; kWindow kernels only, so the default kernel's shared layout stays as it was).
struct BwdItemWindowed : BwdItem {
  int32_t bias;
};

// A [ROWS][D] tile in 16-byte chunks (ChunkMap<D, NT>) into its Tile (SmemTile) layout: `s` is the
// tile's shared address, `o` the thread's first chunk's Tile::offset, `g` the global
// address of its first chunk, `rows_left` = valid rows - its first row; invalid rows are
// zero-filled (the copy then reads nothing; `fallback`, a valid address, is passed instead).
template <int D, int ROWS, int NT, typename Tile, typename T>
__device__ __forceinline__ void load_rows(uint32_t s, uint32_t o, const T* g, int64_t token_stride, int rows_left,
                                          const T* fallback) {
  using M = ChunkMap<D, NT>;
  static_assert(ROWS % M::kRowsPerPass == 0, "whole rows per pass");
#pragma unroll
  for (int p = 0; p < ROWS / M::kRowsPerPass; ++p) {
    const bool valid = p * M::kRowsPerPass < rows_left;
#pragma unroll
    for (int b = 0; b < M::kBlocks; ++b)
      cp_async16_s(s + Tile::at(o, p * M::kRowsPerPass, b * M::kBlockCols / 8),
                   valid ? g + b * M::kBlockCols : fallback, valid ? 16 : 0);
    g += M::kRowsPerPass * token_stride;
  }
}

// Mods: the mask modifiers compiled in (modifiers.cuh: only kSoftcap changes this kernel).
// kPrefix: the plan may hold prefix items (external prefix segments, plan_format.h): their K/V tile
// comes from the prefix buffers, no step is diagonal, and their dK/dV are added into prefix_dk /
// prefix_dv; instantiated with NoModifiers only. The default instantiation is the kernel as it
// was before either.
template <int D, typename T, bool kAtomicDq, int kQStages, int kStepM, typename Mods = NoModifiers,
          bool kPrefix = false>
__global__ void __launch_bounds__(BwdConfig<D>::kThreads, 1)
bwd_kv_kernel(const BwdArgs args) {
  using C = BwdConfig<D, kStepM>;
  using Ops = TypeOps<T>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, P = C::kPitch, PS = C::kPitchS, NT = C::kThreads;
  constexpr int MI = C::kMI;
  constexpr int kWR = C::kWR, kWC = C::kWC;  // warp rows x warp column parts (config.h)
  constexpr int kWarpD = D / kWC;             // the warp's D columns of dK, dV
  constexpr int kQC = BM / kWC, kQJ = kQC / 8;  // the warp's query columns of S^T, dP^T; n8 blocks
  constexpr int kDB = kWarpD / 8;
  constexpr int MQ = C::kMQ, kDW = D / C::kDC, kQB = C::kDqCols / 8;  // phase 4: kQB n8 blocks per pass
  constexpr int E = static_cast<int>(sizeof(T));  // bytes per element
  constexpr uint32_t kQBytes = BM * P * E;        // one q buffer
  static_assert(kWR * 16 * MI == BN, "warp tiling");
  static_assert(2 * BM <= NT && (BM & (BM - 1)) == 0, "threads 0 .. 2 BM - 1 load lse and delta (tid & (BM - 1))");
  static_assert(kQStages == 1 || kQStages == 2, "one or two Q buffers");
  // The loads of step + 1 (Q, lse/delta, dO) are issued after k16 step kIssueKK of the product that
  // follows their barrier (S, dV, dQ / dK) rather than right after it, so every barrier is followed
  // by ldmatrix -> mma.sync (FA2's schedule) and the loaders' 64-bit address arithmetic overlaps
  // queued mma.sync (measured 1.026-1.039x at D = 128). Each load stays in its barrier interval:
  // Q(s+1) -> q[(s+1)&1] between top(s) and bar A(s) (S(s) reads the other buffer; its last readers,
  // S and dK of s - 1, finished before top(s)); dO(s+1) -> dout inside dQ (or dK) of s, after bar
  // B(s) (last dout reads: dP, dV before bar B); lse/delta: the global load into a register inside
  // dV, the shared store after dK. All are waited for at top(s+1); the last step issues nothing.
  constexpr int kIssueKK = 0;
  // Q(step + 1) at 128-row steps (D = 64) after k16 step 2 of S (of 4, 16 mma.sync each): issued
  // earlier, its address and row predicates stay live into the S / dP products' peak (S^T of 64
  // query columns next to dK, dV) and spill 8-24 bytes (step 0 on sm_90a, step 1 on sm_80 in the
  // deterministic kernel; nvcc 13.0). The load still has dP, dV, dQ and dK to land.
  constexpr int kIssueQKK = BM == 128 ? 2 : kIssueKK;

  // 128-byte aligned: SmemTile's swizzled lines are the hardware's (smem_tile.cuh).
  extern __shared__ __align__(128) unsigned char smem_raw[];
  BwdSmem<D, T, kQStages, kStepM>& sm = *reinterpret_cast<BwdSmem<D, T, kQStages, kStepM>*>(smem_raw);
  __shared__ std::conditional_t<Mods::kWindow, BwdItemWindowed, BwdItem> si;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int row0 = (warp % kWR) * 16 * MI;
  const int wc = warp / kWR;
  const int qrow0 = (warp % C::kQR) * 16 * MQ;
  const int dcol0 = (warp / C::kQR) * kDW;
  const LayoutPtrs& L = args.layout;
  const int32_t* plan = args.plan;
  if (!plan_matches(plan, L))
    return;
  const int H = args.num_heads;
  const int64_t T_ = L.num_tokens;

  const T* __restrict__ qg = static_cast<const T*>(args.q);
  const T* __restrict__ kg = static_cast<const T*>(args.k);
  const T* __restrict__ vg = static_cast<const T*>(args.v);
  const T* __restrict__ dog = static_cast<const T*>(args.dout);

  // Per-thread shared-memory byte offsets (32-bit), fixed for the kernel.
  using Smem = BwdSmem<D, T, kQStages, kStepM>;
  constexpr uint32_t kOffK = offsetof(Smem, k), kOffV = offsetof(Smem, v), kOffQ = offsetof(Smem, q),
                     kOffDo = offsetof(Smem, dout);
  static_assert(!C::Tile::kSwizzled || (kOffK % 128 == 0 && kOffV % 128 == 0 && kOffQ % 128 == 0 && kOffDo % 128 == 0),
                "swizzled tiles start on 128-byte lines");
  const uint32_t s_sm = smem_addr(smem_raw);
  const uint32_t s_k = s_sm + kOffK, s_v = s_sm + kOffV, s_q0 = s_sm + kOffQ, s_do = s_sm + kOffDo;
  const uint32_t s_pt = smem_addr(sm.pt), s_ds = smem_addr(sm.dst);
  // ldmatrix lane offsets (elements): A fragment (a_frag_addr), B [n][k] (bnk_frag_addr),
  // B [k][n] (bkn_frag_addr), A^T (at_frag_addr).
  const int la_r = (lane & 7) + ((lane >> 3) & 1) * 8, la_c = (lane >> 4) * 8;
  const int lb_r = (lane & 7) + (lane >> 4) * 8, lb_c = ((lane >> 3) & 1) * 8;
  // The lanes' ldmatrix offsets in the Q/K/V/dO tiles (Tile: swizzled or padded rows), one per lane
  // pattern: A fragments of K and V (S^T, dP^T), B [n][k] of Q and dO (S^T, dP^T), B [k][n] of dO
  // and Q over the warp's D columns (dV, dK) and of K over phase 4's columns (dQ). Stepped by
  // Tile::at, then added to the tile's address (a constant: the two tiles of a pattern share the
  // swizzled offsets of a k16 step; per-tile absolute addresses spilled 24-36 bytes at D = 64 / 512,
  // nvcc 13.0).
  using Tile = typename C::Tile;
  const uint32_t b_kv = Tile::offset(row0 + la_r, la_c / 8);
  const uint32_t b_qdo = Tile::offset(wc * kQC + lb_r, lb_c / 8);
  const uint32_t b_cols = Tile::offset(la_r, (wc * kWarpD + la_c) / 8);
  const uint32_t b_dq = Tile::offset(la_r, (dcol0 + la_c) / 8);
  // Q/dO/K/V loader (ChunkMap): row ld_r (+ kRowsPerPass p), column ld_c (+ kBlockCols b).
  const int ld_r = tid / ChunkMap<D, NT>::kThreadsPerRow, ld_c = (tid % ChunkMap<D, NT>::kThreadsPerRow) * 8;
  const uint32_t s_ld = Tile::offset(ld_r, ld_c / 8);

  if (tid == 0) si.group = H / args.num_kv_heads;  // written and read by thread 0 only
  while (true) {
    __syncthreads();  // every thread is done with the previous item (its shared memory and si)
    if (tid == 0) {
      // Only thread 0 decodes the item; the others read si after the barrier (and the epilogue
      // re-reads it there instead of holding the item through the step loop in registers).
      const int Hk = args.num_kv_heads;
      const int64_t item = atomicAdd(&args.counters[0], 1);
      si.done = item >= static_cast<int64_t>(plan[kHdrNumBwd]) * Hk;
      if (!si.done) {
        const int32_t* wi = plan + plan[kHdrBwdOffset] + static_cast<int32_t>(item / Hk) * kBwdItemInts;
        const int hk = static_cast<int>(item % Hk);
        si.hk = hk;
        si.k0 = wi[1];
        si.klen = wi[2] - wi[1];
        si.qa = wi[3];
        si.qb = wi[4];
        si.slot = wi[5];
        si.h_end = (hk + 1) * load_shared_volatile(si.group);
        si.h_begin = hk * load_shared_volatile(si.group);
        if constexpr (kPrefix) si.prefix = is_prefix_item(L, wi[0]);
        if constexpr (Mods::kWindow) si.bias = plan[plan[kHdrBwdBiasOffset] + static_cast<int32_t>(item / Hk)];
      }
    }
    __syncthreads();
    if (si.done) break;
    // The item's values are read from si where they are used (volatile: not held in registers
    // through the step loop, which needs all 255 but for these).
    const int hk = si.hk;
    const int32_t k0 = si.k0, qb = si.qb;
    const int klen = si.klen;

    bool kv_loaded = false;
    if constexpr (kPrefix) {
      if (si.prefix) {  // the tile's rows are prefix rows
        const T* pkg = static_cast<const T*>(args.prefix_k);
        const T* pvg = static_cast<const T*>(args.prefix_v);
        load_rows<D, BN, NT, Tile>(s_k, s_ld, pkg + (k0 + ld_r) * args.pk_ts + hk * args.pk_hs + ld_c, args.pk_ts,
                                   klen - ld_r, pkg);
        load_rows<D, BN, NT, Tile>(s_v, s_ld, pvg + (k0 + ld_r) * args.pv_ts + hk * args.pv_hs + ld_c, args.pv_ts,
                                   klen - ld_r, pvg);
        kv_loaded = true;
      }
    }
    if (!kv_loaded) {
      load_rows<D, BN, NT, Tile>(s_k, s_ld, kg + (k0 + ld_r) * args.k_ts + hk * args.k_hs + ld_c, args.k_ts,
                                 klen - ld_r, kg);
      load_rows<D, BN, NT, Tile>(s_v, s_ld, vg + (k0 + ld_r) * args.v_ts + hk * args.v_hs + ld_c, args.v_ts,
                                 klen - ld_r, vg);
    }

    // Flattened loop over (query head of the group, query tile of [qa, qb)): step s is head
    // hk * group + s / tiles_per_head, tile qa + (s % tiles_per_head) * BM, advanced incrementally.
    int h = si.h_begin;
    int32_t qt = si.qa;
    // Step 0's Q, dO, lse, delta (the prologue: the global latency is paid once per item).
    {
      const int rows = min(BM, qb - qt);
      load_rows<D, BM, NT, Tile>(s_q0, s_ld, qg + (qt + ld_r) * args.q_ts + h * args.q_hs + ld_c, args.q_ts,
                                 rows - ld_r, qg);
      load_rows<D, BM, NT, Tile>(s_do, s_ld, dog + (qt + ld_r) * args.do_ts + h * args.do_hs + ld_c, args.do_ts,
                                 rows - ld_r, dog);
      cp_async_commit();
      if (tid < BM) {
        const bool valid = tid < rows;
        sm.lse_delta[tid] = valid ? args.lse[h * args.lse_hs + qt + tid] * kLog2e : CUDART_INF_F;
        sm.lse_delta[BM + tid] = valid ? args.delta[h * T_ + qt + tid] : 0.f;
      }
    }

    float dk[MI][kDB][4], dv[MI][kDB][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int j = 0; j < kDB; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[mi][j][e] = dv[mi][j][e] = 0.f;

    uint32_t qbuf = 0;  // this step's Q buffer: step parity (0 with one buffer)
    bool has_next;
    do {
      // Next step's head and query tile.
      int hn = h;
      int32_t qtn = qt + BM;
      const int32_t qb_ = load_shared_volatile(si.qb);
      if (qtn >= qb_) { qtn = load_shared_volatile(si.qa); ++hn; }
      has_next = hn < load_shared_volatile(si.h_end);
      const int rows_next = min(BM, qb_ - qtn);
      const uint32_t q_ofs = qbuf * kQBytes;  // this step's Q buffer

      // Q(step + 1) into the other buffer (last read by step - 1's S and dK), or with one buffer into
      // it once this step's dK is done everywhere.
      auto issue_q_next = [&]() {
        if (has_next) {
          load_rows<D, BM, NT, Tile>(s_q0 + (kQStages == 2 ? qbuf ^ 1 : 0) * kQBytes, s_ld,
                                     qg + (qtn + ld_r) * args.q_ts + hn * args.q_hs + ld_c, args.q_ts,
                                     rows_next - ld_r, qg);
          cp_async_commit();
        }
      };

      cp_async_wait_all();
      __syncthreads();  // top: Q, dO, lse, delta of this step landed; step - 1 is done everywhere

      // Phase 1: S^T = K Q^T first, then dP^T = V dO^T with P = exp2(S scale log2e - lse) computed
      // in place in `st` and stored to pt during the dP product, so the MUFU.EX2 latency and the P
      // stores overlap the dP mma.sync instead of forming an mma-free stretch after both products
      // (measured 1.00-1.02x at D = 128); dS = P (dP - delta) and its stores follow the dP product.
      // The warp's kPBlocks (j, mi) blocks of P are spread over the kKK k16 steps of the dP product:
      // block b in step b kKK / kPBlocks (one per step at D = 128, two at D = 64, every few steps
      // above 128), once its S is final.
      {
        constexpr int kKK = D / 16, kPBlocks = kQJ * MI;
        float st[MI][kQJ][4];  // S^T, then P^T in place
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int j = 0; j < kQJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[mi][j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t ak[MI][4];
#pragma unroll
          for (int mi = 0; mi < MI; ++mi)
            ldsm_x4(ak[mi], s_k + Tile::at(b_kv, mi * 16, kk * 2));
#pragma unroll
          for (int nb = 0; nb < kQJ / 2; ++nb) {
            uint32_t b[4];
            ldsm_x4(b, s_q0 + Tile::at(b_qdo + q_ofs, nb * 16, kk * 2));
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
              Ops::mma(st[mi][2 * nb], ak[mi], b[0], b[1]);
              Ops::mma(st[mi][2 * nb + 1], ak[mi], b[2], b[3]);
            }
          }
          // Q(step + 1) after k16 step kIssueQKK of S, not right after the barrier.
          if constexpr (kQStages == 2) {
            if (kk == kIssueQKK) issue_q_next();
          }
        }
        const int32_t k0 = load_shared_volatile(si.k0);
        // The tile's KV rows past klen are zero-filled and never stored: only the diagonal needs
        // the apply step.
        // A prefix item's rows are seen by every query of its range: never diagonal (and k0 is a
        // prefix row, not a token).
        const bool need_mask = (!kPrefix || !load_shared_volatile(si.prefix)) && SegmentMask::bwd_diagonal(k0 + BN - 1, qt);
        const int mask_ofs = k0 + row0 + g - qt - wc * kQC - 2 * t4;  // k - q of the thread's first element
        // The sliding window (mask modifiers, issue 16): pos(q) - pos(k) = (q - k) + the item's bias.
        int32_t bias = 0;
        bool need_window = false;
        if constexpr (Mods::kWindow) {
          bias = load_shared_volatile(si.bias);
          need_window = SegmentMask::window_tile(qt + BM - 1, k0, bias, args.window);
        }
        float2 l;  // lse of column block j, loaded at its first (mi = 0) block
        float dpt[MI][kQJ][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int j = 0; j < kQJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) dpt[mi][j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t av[MI][4];
#pragma unroll
          for (int mi = 0; mi < MI; ++mi)
            ldsm_x4(av[mi], s_v + Tile::at(b_kv, mi * 16, kk * 2));
#pragma unroll
          for (int nb = 0; nb < kQJ / 2; ++nb) {
            uint32_t b[4];
            ldsm_x4(b, s_do + Tile::at(b_qdo, nb * 16, kk * 2));
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
              Ops::mma(dpt[mi][2 * nb], av[mi], b[0], b[1]);
              Ops::mma(dpt[mi][2 * nb + 1], av[mi], b[2], b[3]);
            }
          }
          // P of the blocks of this step: independent of this step's mma.sync.
#pragma unroll
          for (int b = 0; b < kPBlocks; ++b) {
            if (b * kKK / kPBlocks != kk) continue;
            const int j = b / MI, mi = b % MI;
            const int col = wc * kQC + j * 8 + 2 * t4;
            if (mi == 0) l = *reinterpret_cast<const float2*>(&sm.lse_delta[col]);
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
              const int row = row0 + mi * 16 + g + hr * 8;
              // Softcap (mask modifiers, issue 16): P from the capped score; st keeps P times the cap's
              // derivative (dS = that (dP - delta)) once P is stored.
              float g0 = 1.f, g1 = 1.f;
              if constexpr (Mods::kSoftcap) {
                const SoftcapFromExp c0 = softcap_of(st[mi][j][2 * hr], args);
                const SoftcapFromExp c1 = softcap_of(st[mi][j][2 * hr + 1], args);
                st[mi][j][2 * hr] = c0.score(args.softcap);
                st[mi][j][2 * hr + 1] = c1.score(args.softcap);
                g0 = c0.grad();
                g1 = c1.grad();
              }
              float p0 = exp2f(st[mi][j][2 * hr] * Mods::score_log2(args) - l.x);
              float p1 = exp2f(st[mi][j][2 * hr + 1] * Mods::score_log2(args) - l.y);
              // key and query of the pair (row, col), relative to the thread's first pair: mask_ofs +
              // (row - row0 - g) and col - wc kQC - 2 t4
              if (need_mask) {
                if (SegmentMask::bwd_hidden(mask_ofs + mi * 16 + hr * 8, j * 8)) p0 = 0.f;
                if (SegmentMask::bwd_hidden(mask_ofs + mi * 16 + hr * 8, j * 8 + 1)) p1 = 0.f;
              }
              if constexpr (Mods::kWindow) {
                if (need_window) {
                  if (SegmentMask::window_hidden(mask_ofs + mi * 16 + hr * 8, j * 8, bias, args.window)) p0 = 0.f;
                  if (SegmentMask::window_hidden(mask_ofs + mi * 16 + hr * 8, j * 8 + 1, bias, args.window)) p1 = 0.f;
                }
              }
              if constexpr (Mods::kSoftcap) {
                *reinterpret_cast<uint32_t*>(&sm.pt[row * PS + col]) = Ops::pack(p0, p1);
                st[mi][j][2 * hr] = p0 * g0;
                st[mi][j][2 * hr + 1] = p1 * g1;
              } else {
                st[mi][j][2 * hr] = p0;
                st[mi][j][2 * hr + 1] = p1;
                *reinterpret_cast<uint32_t*>(&sm.pt[row * PS + col]) = Ops::pack(p0, p1);
              }
            }
          }
        }
#pragma unroll
        for (int j = 0; j < kQJ; ++j) {
          const int col = wc * kQC + j * 8 + 2 * t4;
          const float2 d = *reinterpret_cast<const float2*>(&sm.lse_delta[BM + col]);
#pragma unroll
          for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
              const int row = row0 + mi * 16 + g + hr * 8;
              const float ds0 = st[mi][j][2 * hr] * (dpt[mi][j][2 * hr] - d.x);
              const float ds1 = st[mi][j][2 * hr + 1] * (dpt[mi][j][2 * hr + 1] - d.y);
              *reinterpret_cast<uint32_t*>(&sm.dst[row * PS + col]) = Ops::pack(ds0, ds1);
            }
        }
      }
      __syncthreads();  // bar A: P, dS written; lse, delta, and K/V/Q/dO of S and dP read

      // lse/delta of step + 1 into a register (threads below BM: lse, BM .. 2 BM - 1: delta); stored
      // at the end of the step, so the load has the dV, dQ and dK products to land.
      float ld_val = 0.f;
      const int ld_i = tid & (BM - 1);
      const bool ld_ok = has_next && tid < 2 * BM && ld_i < rows_next;
      auto load_lse_delta_next = [&]() {
        if (ld_ok)
          ld_val = tid < BM ? args.lse[hn * args.lse_hs + qtn + ld_i] : args.delta[hn * T_ + qtn + ld_i];
      };

      // Phase 3a: dV += P^T dO for kv rows [row0, +16 MI), d cols [kWarpD wc, +kWarpD).
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        uint32_t ap[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
          ldsm_x4(ap[mi], s_pt + ((row0 + mi * 16 + la_r) * PS + kk * 16 + la_c) * E);
#pragma unroll
        for (int nd = 0; nd < kDB / 2; ++nd) {
          uint32_t b[4];
          ldsm_x4_trans(b, s_do + Tile::at(b_cols, kk * 16, nd * 2));
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            Ops::mma(dv[mi][2 * nd], ap[mi], b[0], b[1]);
            Ops::mma(dv[mi][2 * nd + 1], ap[mi], b[2], b[3]);
          }
        }
        // lse/delta of step + 1 after k16 step kIssueKK of dV.
        if (kk == kIssueKK) load_lse_delta_next();
      }
      __syncthreads();  // bar B: every read of dout (dP, dV) and pt is done
      // dO(step + 1), after k16 step kIssueKK of the next product (dQ; dK in the deterministic
      // mode), still after bar B.
      auto issue_do_next = [&]() {
        if (has_next) {
          load_rows<D, BM, NT, Tile>(s_do, s_ld, dog + (qtn + ld_r) * args.do_ts + hn * args.do_hs + ld_c,
                                     args.do_ts, rows_next - ld_r, dog);
          cp_async_commit();
        }
      };

      if constexpr (kAtomicDq) {
        const int32_t qb = load_shared_volatile(si.qb);
        // Phase 4: dQ[q rows qrow0.., d cols dcol0..] += dS K, accumulated into fp32 by atomics.
        // In kDqPasses passes of kDqCols columns (one pass below D = 512; at D = 512 several, so that a
        // pass's dQ block fits the registers next to dK and dV).
#pragma unroll
        for (int pass = 0; pass < C::kDqPasses; ++pass) {
          const int dcol = dcol0 + pass * C::kDqCols;
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
              ldsm_x4_trans(a[mi], s_ds + ((kk * 16 + lb_r) * PS + qrow0 + mi * 16 + lb_c) * E);
#pragma unroll
            for (int nd = 0; nd < kQB / 2; ++nd) {
              uint32_t b[4];
              ldsm_x4_trans(b, s_k + Tile::at(b_dq, kk * 16, pass * C::kDqCols / 8 + nd * 2));
#pragma unroll
              for (int mi = 0; mi < MQ; ++mi) {
                Ops::mma(dq[mi][2 * nd], a[mi], b[0], b[1]);
                Ops::mma(dq[mi][2 * nd + 1], a[mi], b[2], b[3]);
              }
            }
            if (pass == 0 && kk == kIssueKK) issue_do_next();
          }
#pragma unroll
          for (int mi = 0; mi < MQ; ++mi)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
              const int32_t qi = qt + qrow0 + mi * 16 + g + hr * 8;
              if (qi < qb) {
                float* dst = args.dq_accum + (static_cast<int64_t>(qi) * H + h) * D + dcol + 4 * t4;
#pragma unroll
                for (int j = 0; j < kQB; j += 2)
                  atomic_add_quad(dst + j * 8, dq[mi][j][2 * hr], dq[mi][j][2 * hr + 1], dq[mi][j + 1][2 * hr],
                                  dq[mi][j + 1][2 * hr + 1]);
              }
            }
        }
      }

      // Phase 3b: dK += dS^T Q for kv rows [row0, +16 MI), d cols [kWarpD wc, +kWarpD).
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        uint32_t ads[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
          ldsm_x4(ads[mi], s_ds + ((row0 + mi * 16 + la_r) * PS + kk * 16 + la_c) * E);
#pragma unroll
        for (int nd = 0; nd < kDB / 2; ++nd) {
          uint32_t b[4];
          ldsm_x4_trans(b, s_q0 + Tile::at(b_cols + q_ofs, kk * 16, nd * 2));
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            Ops::mma(dk[mi][2 * nd], ads[mi], b[0], b[1]);
            Ops::mma(dk[mi][2 * nd + 1], ads[mi], b[2], b[3]);
          }
        }
        if constexpr (!kAtomicDq) {
          if (kk == kIssueKK) issue_do_next();
        }
      }
      if constexpr (kQStages == 1) {
        __syncthreads();  // bar C: every read of q (S, dK) is done
        issue_q_next();
      }

      // lse/delta of step + 1 (after bar B: every read of this step's values is done); thread
      // tid < 2 BM owns lse_delta[tid].
      if (has_next && tid < 2 * BM) {
        float v;
        if (tid < BM) v = ld_ok ? ld_val * kLog2e : CUDART_INF_F;
        else v = ld_ok ? ld_val : 0.f;
        sm.lse_delta[tid] = v;
      }
      h = hn;
      qt = qtn;
      if constexpr (kQStages == 2) qbuf ^= 1;
    } while (has_next);

    // Epilogue: dK scaled by the softmax scale. Direct write, or an fp32 partial for a split.
    // The item is re-read from si (nobody writes it before the item loop's next barrier).
    const int32_t slot = load_shared_volatile(si.slot);
    const int Hk = args.num_kv_heads;
    const int col0 = wc * kWarpD + 2 * t4;
    if (kPrefix && slot < 0 && load_shared_volatile(si.prefix)) {
      const int32_t k0 = load_shared_volatile(si.k0), klen = load_shared_volatile(si.klen);
      const int hk = load_shared_volatile(si.hk);
      T* dkb = static_cast<T*>(args.prefix_dk) + k0 * args.pdk_ts + hk * args.pdk_hs + col0;
      T* dvb = static_cast<T*>(args.prefix_dv) + k0 * args.pdv_ts + hk * args.pdv_hs + col0;
      store_dk_dv_accumulate(args, dk, dv, dkb, dvb, row0 + g, klen);
    } else if (slot < 0) {
      const int32_t k0 = load_shared_volatile(si.k0), klen = load_shared_volatile(si.klen);
      const int hk = load_shared_volatile(si.hk);
      T* dkb = static_cast<T*>(args.dk) + k0 * args.dk_ts + hk * args.dk_hs + col0;
      T* dvb = static_cast<T*>(args.dv) + k0 * args.dv_ts + hk * args.dv_hs + col0;
      store_dk_dv(args, dk, dv, dkb, dvb, row0 + g, klen);
    } else {
      const int hk = load_shared_volatile(si.hk);
      float* base = args.partials + ((static_cast<int64_t>(slot) * Hk + hk) * 2) * BN * D + col0;
      store_dk_dv_partial<BN, D>(base, dk, dv, row0 + g);
    }
  }
}
}  // namespace dualkv::cuda::sm80
