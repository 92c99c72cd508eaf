// Portable (sm80+, mma.sync) forward kernel: one CTA works through (query tile, head) items taken
// from the plan in longest-work-first order. A query tile lies inside one segment s; it visits the KV
// tiles of every proper ancestor of s (full rectangles, masked only at a ragged end) and then the
// KV tiles of s up to its last query (causal mask on the diagonal tiles). Online softmax in fp32.
#pragma once

#include <cuda_runtime.h>
#include <math_constants.h>

#include <type_traits>

#include "dualkv/mask.h"
#include "kernel_params.h"
#include "modifiers.cuh"
#include "plan_reader.cuh"
#include "sm80/config.h"
#include "sm80/ptx.cuh"

namespace dualkv::cuda::sm80 {

template <int D, int BM, typename T>
struct FwdSmem {
  using C = FwdConfig<D, BM>;
  T q[C::kBlockM * C::kPitch];
  T k[C::kBlockN * C::kPitch];
  T v[C::kBlockN * C::kPitch];
};
// D split over warp pairs (FwdConfig::kDSplit = 2, D = 512): each warp's partial S (its half of D's
// QK^T sum) for its partner, as [warp][fragment register][lane] (conflict-free).
template <int D, int BM, typename T>
struct FwdSmemSplit : FwdSmem<D, BM, T> {
  using C = FwdConfig<D, BM>;
  float s_part[C::kWarps][C::kMI * (C::kBlockN / 8) * 4][32];
};
template <int D, int BM, typename T>
using FwdSmemOf = std::conditional_t<FwdConfig<D, BM>::kDSplit == 1, FwdSmem<D, BM, T>, FwdSmemSplit<D, BM, T>>;

// What the loop does and why (measured at head dim 128 on the H200 against the first version of
// this kernel, 1.06-1.10x; docs/notes/2026-11-30-portable-forward.md):
//  - FlashAttention-2's order: [wait K, sync] issue V, S = QK^T, mask, [wait V, sync] advance
//    the walk and issue the next K, softmax, O += PV. The softmax and the PV product are one
//    branch-free stretch of code, so ptxas interleaves the exponentials (MUFU) of later P columns
//    with the PV mma.sync of earlier ones. The wait for K opens the iteration, so no DEPBAR can be
//    hoisted into the PV product.
//  - P is rounded to A fragments (bf16/fp16 pairs) as each exponential is known.
//  - The item's CTA-uniform values (query range, head, K/V head pointers) and the KV walk live
//    in shared memory and are read where they are used, instead of holding ~14 registers through
//    the loop; so do the running row sums (read and written once per KV tile, after PV). That is
//    what the order needs to fit 255 registers without spilling on sm_80 and sm_90a.
template <int BN, int NT, int MI, typename T>
struct FwdItem {
  const T* kh;             // K of the item's kv head
  const T* vh;             // V of the item's kv head
  bool done;               // no work item left
  int32_t num_heads, kv_group;  // H and H / Hk for thread 0's item decode: read from here, they
                                // are not loop invariants that ptxas hoists into registers
  int32_t q0, q1, h;
  KvWalk<BN> walk[2];    // KV walk, double-buffered by tile parity: thread 0 writes the next
                           // tile's state into the slot nobody reads during this tile
  float row_sum[MI * 2][NT];  // [row of the thread's fragments][thread]: each thread owns its column
  // external prefix (issue 17): prefix K / V of the kv head (prefix kernels; last, so that the
  // default kernel's offsets of the fields above stay as they were)
  const T* pkh;
  const T* pvh;
};
// The sliding window (mask modifiers, issue 16): the item's first position, the windowed walk's
// argument (kWindow kernels only, so the default kernel's shared layout stays as it was).
template <int BN, int NT, int MI, typename T>
struct FwdItemWindowed : FwdItem<BN, NT, MI, T> {
  int32_t first_pos;
};

// Tile load (the Q tile, and on sm_80 every tile). sm_90a: a compile-time number of 16-byte
// chunks per thread (no loop branches; load_tile_async's runtime trip count makes ptxas keep its
// per-thread bookkeeping live and spill in the KV loop). sm_80: load_tile_async, with which ptxas
// fits the kernel without spilling there (the unrolled form spills 64 bytes on sm_80 at D = 128).
template <int D, int ROWS, int NT, typename T>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, int64_t token_stride, int valid_rows, int tid) {
  using Tile = typename FwdConfig<D>::Tile;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using M = ChunkMap<D, NT>;
  static_assert(ROWS % M::kRowsPerPass == 0, "the tile must be a whole number of passes");
  const int row0 = tid / M::kThreadsPerRow;
  const int col = (tid % M::kThreadsPerRow) * 8;
  const uint32_t s = smem_addr(smem), o = Tile::offset(row0, col / 8);
#pragma unroll
  for (int p = 0; p < ROWS / M::kRowsPerPass; ++p) {
    const int row = row0 + p * M::kRowsPerPass;
    const bool valid = row < valid_rows;
#pragma unroll
    for (int b = 0; b < M::kBlocks; ++b) {
      const int c = b * M::kBlockCols + col;
      // A zero-filled chunk still needs an address: the tile base (row 0 always exists).
      cp_async16_s(s + Tile::at(o, p * M::kRowsPerPass, b * M::kBlockCols / 8),
                   valid ? gmem + static_cast<int64_t>(row) * token_stride + c : gmem, valid ? 16 : 0);
    }
  }
#else
  load_tile_async<D, ROWS, Tile, NT>(smem, gmem, token_stride, valid_rows, tid);
#endif
}

// The K and V tile loads of the KV loop: rows [pos, pos + valid_rows) of one head (head = its
// row 0), zero-filled up to ROWS. On sm_90a FlashAttention-2's address arithmetic (measured 1.01-
// 1.04x the per-chunk form of load_tile at D = 128 on the H200): one 64-bit source pointer per
// thread, formed once per tile from the thread's first token (pos + row0, 32-bit) and advanced by
// the CTA's rows per pass (a uniform 64-bit step), 2 integer instructions per 16-byte chunk. A full
// tile (every KV tile but a ragged range end; the test is uniform over the CTA) takes the
// unpredicated form; a partial tile zero-fills the missing rows, with the pointer held at the last
// real row. sm_80 keeps load_tile (this form spills 8 bytes there). The same bytes land in the
// same shared-memory places either way.
template <int D, int ROWS, int NT, typename T>
__device__ __forceinline__ void load_kv_tile(T* smem, const T* head, int32_t pos, int64_t token_stride,
                                             int valid_rows, int tid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Tile = typename FwdConfig<D>::Tile;
  using M = ChunkMap<D, NT>;
  static_assert(ROWS % M::kRowsPerPass == 0, "the tile must be a whole number of passes");
  const int row0 = tid / M::kThreadsPerRow;
  const int col = (tid % M::kThreadsPerRow) * 8;
  const uint32_t s = smem_addr(smem), o = Tile::offset(row0, col / 8);
  // A zero-filled chunk still gets the address of a real row (load_tile uses the tile's row 0):
  // the pointer starts at the thread's row or the tile's last real row, and only moves on to rows
  // that exist.
  const T* src = head + static_cast<int64_t>(pos + min(row0, valid_rows - 1)) * token_stride + col;
  const int64_t step = M::kRowsPerPass * token_stride;
  if (valid_rows >= ROWS) {
#pragma unroll
    for (int p = 0; p < ROWS / M::kRowsPerPass; ++p) {
#pragma unroll
      for (int b = 0; b < M::kBlocks; ++b)
        cp_async16_s(s + Tile::at(o, p * M::kRowsPerPass, b * M::kBlockCols / 8), src + b * M::kBlockCols, 16);
      src += step;
    }
  } else {
#pragma unroll
    for (int p = 0; p < ROWS / M::kRowsPerPass; ++p) {
      const int row = row0 + p * M::kRowsPerPass;
#pragma unroll
      for (int b = 0; b < M::kBlocks; ++b)
        cp_async16_s(s + Tile::at(o, p * M::kRowsPerPass, b * M::kBlockCols / 8), src + b * M::kBlockCols,
                     row < valid_rows ? 16 : 0);
      if (row + M::kRowsPerPass < valid_rows) src += step;
    }
  }
#else
  load_tile<D, ROWS, NT>(smem, head + static_cast<int64_t>(pos) * token_stride, token_stride, valid_rows, tid);
#endif
}

// Mods: the mask modifiers compiled in (modifiers.cuh); NoModifiers is the default kernel.
// kPrefix: the layout has external prefix segments (the walk may enter prefix rows, whose tiles
// load from the prefix buffers: a CTA-uniform choice per tile); instantiated with NoModifiers only
// (fwd_launch.cuh). The default instantiation (NoModifiers, kPrefix = false) is the kernel as it
// was before either. kTileM: the plan's query tile rows (config.h, kPortableTileM / kSm90TileM).
template <int D, int kTileM, typename T, typename Mods = NoModifiers, bool kPrefix = false>
__global__ void __launch_bounds__(FwdConfig<D, kTileM>::kThreads, 1)
fwd_kernel(const FwdArgs args) {
  using C = FwdConfig<D, kTileM>;
  using Ops = TypeOps<T>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, NT = C::kThreads, MI = C::kMI;
  constexpr int kNB = BN / 8;   // n8 blocks of S
  constexpr int kKB = BN / 16;  // k16 blocks of P (A fragments of O += P V)
  // D split over warp pairs (kDS = 2 at D = 512, config.h): the warp's kWD columns of O; S summed
  // from the pair's partial products (below, "D split").
  constexpr int kDS = C::kDSplit, kWD = C::kWarpD;
  constexpr int kDB = kWD / 8;  // n8 blocks of O

  // 128-byte aligned: SmemTile's swizzled lines are the hardware's (smem_tile.cuh).
  extern __shared__ __align__(128) unsigned char smem_raw[];
  FwdSmemOf<D, kTileM, T>& sm = *reinterpret_cast<FwdSmemOf<D, kTileM, T>*>(smem_raw);
  __shared__ std::conditional_t<Mods::kWindow, FwdItemWindowed<BN, NT, MI, T>, FwdItem<BN, NT, MI, T>> st;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const LayoutPtrs& L = args.layout;
  const int32_t* plan = args.plan;
  if (!plan_matches(plan, L))
    return;
  const int warp_row0 = (kDS == 1 ? warp : warp % C::kRowWarps) * 16 * MI;  // first tile row of this warp
  const int dcol0 = kDS == 1 ? 0 : (warp / C::kRowWarps) * kWD;  // first column of the warp's part of D
  // The lanes' ldmatrix offsets in the Q/K/V tiles (Tile: swizzled or padded rows), at the warp's
  // first column of D: A fragments of Q and B [k][n] fragments of V share a lane pattern
  // (a_frag_addr's, bkn_frag_addr's), B [n][k] of K (bnk_frag_addr's) has its own. Stepped by
  // Tile::at, then added to the tile's address (Q's with the warp's rows, a multiple of 128 bytes),
  // so Q and V share the swizzled offsets of a k16 step.
  using Tile = typename C::Tile;
  const uint32_t s_q = smem_addr(sm.q) + warp_row0 * Tile::kRowBytes, s_k = smem_addr(sm.k), s_v = smem_addr(sm.v);
  const int la_r = (lane & 7) + ((lane >> 3) & 1) * 8, la_c = (lane >> 4) * 8;
  const int lb_r = (lane & 7) + (lane >> 4) * 8, lb_c = ((lane >> 3) & 1) * 8;
  uint32_t b_qv = Tile::offset(la_r, (dcol0 + la_c) / 8);
  uint32_t b_k = Tile::offset(lb_r, (dcol0 + lb_c) / 8);
  if (tid == 0) {
    st.num_heads = args.num_heads;
    st.kv_group = args.num_heads / args.num_kv_heads;
  }

  while (true) {
    __syncthreads();  // the previous item is done with smem and st
    if (tid == 0) {
      // Only thread 0 decodes the item; the other threads read the result from st.
      const int H = load_shared_volatile(st.num_heads);
      const int64_t item = atomicAdd(args.counter, 1);
      st.done = item >= static_cast<int64_t>(plan[kHdrNumFwd]) * H;
      if (!st.done) {
        const int32_t* items = plan + plan[kHdrFwdOffset];
        const int32_t tile = static_cast<int32_t>(item / H);
        const int h = static_cast<int>(item % H);
        const int hk = h / load_shared_volatile(st.kv_group);
        const int32_t seg = items[tile * kFwdItemInts + 0];
        st.q0 = items[tile * kFwdItemInts + 1];
        st.q1 = items[tile * kFwdItemInts + 2];
        st.h = h;
        st.kh = static_cast<const T*>(args.k) + hk * args.k_hs;
        st.vh = static_cast<const T*>(args.v) + hk * args.v_hs;
        if constexpr (kPrefix) {
          st.pkh = static_cast<const T*>(args.prefix_k) + hk * args.pk_hs;
          st.pvh = static_cast<const T*>(args.prefix_v) + hk * args.pv_hs;
          st.walk[0].init(L.offsets, L.parent, L.seg_prefix, L.prefix_offsets, seg, st.q1);
        } else if constexpr (Mods::kWindow) {  // mask modifiers (issue 16): from the window's first key on
          st.first_pos = SegmentMask::window_first_position(L.offsets, L.position_offset, seg, st.q0, args.window);
          st.walk[0].init_windowed(L.offsets, L.parent, L.position_offset, seg, st.q1, st.first_pos);
        } else {
          st.walk[0].init(L.offsets, L.parent, seg, st.q1);
        }
      }
    }
    __syncthreads();
    if (st.done) break;

    {
      const int32_t q0 = st.q0;
      const T* q_tile = static_cast<const T*>(args.q) + st.h * args.q_hs + static_cast<int64_t>(q0) * args.q_ts;
      load_tile<D, BM, NT>(sm.q, q_tile, args.q_ts, st.q1 - q0, tid);
      const bool pre = kPrefix && st.walk[0].prefix;  // the first tile is of prefix rows
      load_tile<D, BN, NT>(sm.k, (pre ? st.pkh : st.kh) + static_cast<int64_t>(st.walk[0].pos) * (pre ? args.pk_ts : args.k_ts),
                                 pre ? args.pk_ts : args.k_ts, st.walk[0].len(), tid);
      cp_async_commit();
    }

    float acc[MI][kDB][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int j = 0; j < kDB; ++j) acc[mi][j][0] = acc[mi][j][1] = acc[mi][j][2] = acc[mi][j][3] = 0.f;
    float row_max[MI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int r = 0; r < 2; ++r) { row_max[mi][r] = -CUDART_INF_F; st.row_sum[mi * 2 + r][tid] = 0.f; }

    int slot = 0;  // st.walk[slot] describes the current KV tile
    bool more = true;
    do {
      // The windowed kernels derive the swizzled per-k16 offsets from b_qv / b_k inside the loop:
      // hoisted out of it (ptxas's choice without this opaque redefinition) they spilled 68 bytes at
      // D = 128 (nvcc 13.0) and the windowed forward ran 1.01x the padded kernel's time.
      if constexpr (Mods::kWindow) asm volatile("" : "+r"(b_qv), "+r"(b_k));
      cp_async_wait_all();
      __syncthreads();  // K (and Q on the first tile) landed; every warp is done reading the previous V
      if constexpr (kPrefix) {
        const bool pre = st.walk[slot].prefix;  // CTA-uniform: the tile is of prefix rows
        load_kv_tile<D, BN, NT>(sm.v, pre ? st.pvh : st.vh, st.walk[slot].pos, pre ? args.pv_ts : args.v_ts,
                                   st.walk[slot].len(), tid);
      } else {
        load_kv_tile<D, BN, NT>(sm.v, st.vh, st.walk[slot].pos, args.v_ts, st.walk[slot].len(), tid);
      }
      cp_async_commit();

      float s[MI][kNB][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int j = 0; j < kNB; ++j) s[mi][j][0] = s[mi][j][1] = s[mi][j][2] = s[mi][j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kWD / 16; ++kk) {
        uint32_t a[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
          ldsm_x4(a[mi], s_q + Tile::at(b_qv, mi * 16, kk * 2));
#pragma unroll
        for (int nb = 0; nb < BN / 16; ++nb) {
          uint32_t b[4];
          ldsm_x4(b, s_k + Tile::at(b_k, nb * 16, kk * 2));
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            Ops::mma(s[mi][2 * nb], a[mi], b[0], b[1]);
            Ops::mma(s[mi][2 * nb + 1], a[mi], b[2], b[3]);
          }
        }
      }

      // D split: this warp's partial S for its partner, read after the V barrier below (the
      // partner's write of the next tile follows the next iteration's first barrier, after every
      // read of this one). Written before the mask: each warp masks its own partial, and -inf plus
      // the partner's finite partial is -inf, so both warps hold the same masked sum.
      if constexpr (kDS > 1) exchange_split_partial<false, MI, kNB>(&sm.s_part[warp], lane, s);

      // Masking: ragged KV tile end, and the causal diagonal of the query's own segment. The tile
      // is re-read from shared memory here (volatile: not kept in registers through S = QK^T).
      {
        const int32_t kpos = load_shared_volatile(st.walk[slot].pos);
        const int32_t krem = load_shared_volatile(st.walk[slot].end) - kpos;  // KvWalk::rest()
        const bool own = load_shared_volatile(st.walk[slot].own);
        const int32_t q0 = load_shared_volatile(st.q0);
        const int32_t q_last = min(q0 + warp_row0 + 16 * MI, load_shared_volatile(st.q1)) - 1;
        const bool need_mask = SegmentMask::fwd_ragged(krem, BN) ||
                               SegmentMask::fwd_diagonal(kpos, krem, own, q0 + warp_row0, q_last, BN);
        // The sliding window (mask modifiers, issue 16), on the tiles whose farthest pair of the
        // warp's rows it hides: pos(q) - pos(k) = (q - k) + shift for the walk's range. One apply
        // loop with the forest rule's (a second loop spilled 28 bytes at D = 128).
        int32_t shift = 0;
        bool need_window = false;
        if constexpr (Mods::kWindow) {
          shift = SegmentMask::window_shift(L.offsets, L.position_offset, load_shared_volatile(st.walk[slot].seg),
                                            load_shared_volatile(st.walk[slot].cur));
          need_window = SegmentMask::window_tile(q0 + warp_row0 + 16 * MI - 1, kpos, shift, args.window);
        }
        if (need_mask || need_window) {
          int32_t cols[MI][2];
          fwd_visible_cols_of_rows<MI>(cols, kpos, krem, own, q0 + warp_row0, g);
#pragma unroll
          for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int j = 0; j < kNB; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int col = j * 8 + 2 * t4 + (e & 1);
                const int32_t qi = q0 + warp_row0 + mi * 16 + g + (e >> 1) * 8;
                bool hidden = col >= cols[mi][e >> 1];
                if constexpr (Mods::kWindow)
                  hidden = hidden || SegmentMask::window_hidden(kpos + col, qi, shift, args.window);
                if (hidden) s[mi][j][e] = -CUDART_INF_F;
              }
        }
      }

      cp_async_wait_all();
      __syncthreads();  // V landed; every warp is done reading K
      {
        KvWalk<BN> w = st.walk[slot];
        if constexpr (kPrefix) {
          more = w.next(L.offsets, L.parent, L.seg_prefix, L.prefix_offsets);
          if (more) {
            load_kv_tile<D, BN, NT>(sm.k, w.prefix ? st.pkh : st.kh, w.pos, w.prefix ? args.pk_ts : args.k_ts,
                                       w.len(), tid);
            cp_async_commit();
          }
        } else {
          if constexpr (Mods::kWindow)
            more = w.next_windowed(L.offsets, L.parent, L.position_offset, load_shared_volatile(st.first_pos));
          else
            more = w.next(L.offsets, L.parent);
          if (more) {
            load_kv_tile<D, BN, NT>(sm.k, st.kh, w.pos, args.k_ts, w.len(), tid);
            cp_async_commit();
          }
        }
        // Nobody reads walk[slot ^ 1] before the next iteration's first barrier.
        if (tid == 0) st.walk[slot ^ 1] = w;
        slot ^= 1;
      }
      if constexpr (kDS > 1) {  // D split: S = own partial + the partner's (the same sum in both warps)
        const int partner = (warp + C::kRowWarps) % C::kWarps;
        exchange_split_partial<true, MI, kNB>(&sm.s_part[partner], lane, s);
      }

      // Online softmax (exp2 with the scale folded in); P leaves in A-fragment layout:
      // p[mi][kb] = {C(2kb).c01, C(2kb).c23, C(2kb+1).c01, C(2kb+1).c23} (ptx.cuh).
      uint32_t p[MI][kKB][4];
      float tile_sum[MI][2], alpha[MI][2];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if constexpr (Mods::kSoftcap) {
            // Mask modifiers (issue 16): the row's scores capped, the masked ones staying -inf (the
            // cap of -inf would be -c); row by row here, not the whole tile after S = QK^T, where it
            // spilled 16 bytes at D = 128.
#pragma unroll
            for (int j = 0; j < kNB; ++j)
#pragma unroll
              for (int e = 2 * r; e < 2 * r + 2; ++e)
                if (s[mi][j][e] != -CUDART_INF_F) s[mi][j][e] = softcap_of(s[mi][j][e], args).score(args.softcap);
          }
          float mx = row_max[mi][r];
#pragma unroll
          for (int j = 0; j < kNB; ++j) mx = fmaxf(mx, fmaxf(s[mi][j][2 * r], s[mi][j][2 * r + 1]));
          mx = warp_max4(mx);
          const float m_scaled = mx == -CUDART_INF_F ? 0.f : mx * Mods::score_log2(args);
          // (old max - new max) * c: exactly 0, so alpha exactly 1, when the max stays (the contracted
          // old * c - m_scaled need not be 0): a tile that hides the whole row (a later sibling's
          // range) then leaves the row to the same bits.
          alpha[mi][r] = exp2f((row_max[mi][r] - (mx == -CUDART_INF_F ? 0.f : mx)) * Mods::score_log2(args));
          row_max[mi][r] = mx;
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < kNB; ++j) {
            const float e0 = exp2f(s[mi][j][2 * r] * Mods::score_log2(args) - m_scaled);
            const float e1 = exp2f(s[mi][j][2 * r + 1] * Mods::score_log2(args) - m_scaled);
            sum += e0 + e1;
            p[mi][j / 2][(j & 1) * 2 + r] = Ops::pack(e0, e1);
          }
          tile_sum[mi][r] = sum;
#pragma unroll
          for (int j = 0; j < kDB; ++j) {
            acc[mi][j][2 * r] *= alpha[mi][r];
            acc[mi][j][2 * r + 1] *= alpha[mi][r];
          }
        }

      // O += P V
#pragma unroll
      for (int kb = 0; kb < kKB; ++kb)
#pragma unroll
        for (int nd = 0; nd < kWD / 16; ++nd) {
          uint32_t b[4];
          ldsm_x4_trans(b, s_v + Tile::at(b_qv, kb * 16, nd * 2));
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            Ops::mma(acc[mi][2 * nd], p[mi][kb], b[0], b[1]);
            Ops::mma(acc[mi][2 * nd + 1], p[mi][kb], b[2], b[3]);
          }
        }

      // Row sums after the PV product: a shared-memory store before it would order every
      // ldmatrix of V after the last exponential and undo the MUFU / HMMA interleaving.
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          st.row_sum[mi * 2 + r][tid] = st.row_sum[mi * 2 + r][tid] * alpha[mi][r] + tile_sum[mi][r];
    } while (more);

    // Epilogue: normalise, write out and lse.
    const int32_t q0 = st.q0, q1 = st.q1;
    const int h = st.h;
    T* __restrict__ og = static_cast<T*>(args.out);
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float total = warp_sum4(st.row_sum[mi * 2 + r][tid]);
        float inv = total > 0.f ? 1.f / total : 0.f;
        float sink_lse = 0.f;
        if constexpr (Mods::kSinks)  // mask modifiers (issue 16): the sink joins the row's softmax
          inv = fold_sink_epilogue(row_max[mi][r], total, Mods::score_scale(args), args.sinks[h], &sink_lse);
        const int32_t qi = q0 + warp_row0 + mi * 16 + g + r * 8;
        if (qi < q1) {
          T* orow = og + static_cast<int64_t>(qi) * args.o_ts + h * args.o_hs + dcol0;
#pragma unroll
          for (int j = 0; j < kDB; ++j) {
            *reinterpret_cast<uint32_t*>(orow + j * 8 + 2 * t4) =
                Ops::pack(acc[mi][j][2 * r] * inv, acc[mi][j][2 * r + 1] * inv);
          }
          if (args.lse != nullptr && t4 == 0 && (kDS == 1 || dcol0 == 0)) {  // D split: one warp of the pair
            const float lse = Mods::kSinks ? sink_lse
                              : total > 0.f ? row_max[mi][r] * Mods::score_scale(args) + logf(total) : CUDART_INF_F;
            args.lse[h * args.lse_hs + qi] = lse;
          }
        }
      }
  }
}

}  // namespace dualkv::cuda::sm80
