// The tile-size table: every tile size of every kernel, as a function of the head dim, in one
// place. Host code (the planner) and device code (the kernels' configs) read the same constexpr
// functions, so a plan and the kernels that consume it cannot disagree.
//
// Which head dims exist is not decided here (src/cuda/CMakeLists.txt holds that list); these are
// rules over D, each with the reason for its threshold.
#pragma once

#if defined(__CUDACC__)
#define DUALKV_TILE_FN __host__ __device__ constexpr
#else
#define DUALKV_TILE_FN constexpr
#endif

namespace dualkv {

// ---- the work plan (every arch takes the plan's items as they are) ----
struct PlanTiles {
  int fwd_block_m;  // query rows of a forward (and deterministic dQ) work item
  int bwd_block_n;  // KV rows of a backward work item
  int bwd_block_m;  // query rows of a backward step; backward split lengths are multiples of it
};
// Backward KV tiles of 128 rows up to D = 128 (each tile's dQ traffic covers twice the work of a
// 64-row tile), 64 above (the dK/dV accumulators of 128 rows do not fit the registers).
DUALKV_TILE_FN PlanTiles plan_tiles(int head_dim) {
  return head_dim <= 128 ? PlanTiles{128, 128, 64} : PlanTiles{128, 64, 64};
}

// ---- sm80 (mma.sync) kernels ----
// Forward: 16-row query blocks per warp (2 up to D = 128: every K/V fragment loaded from shared
// memory feeds two row blocks, halving shared-memory traffic; 1 above, for registers), as many
// warps as fill the plan's query tile, and 64 KV rows per step: FlashAttention-2's sm80 choice
// above D = 64 (its 8 warps above 128 are our one row block per warp). At D = 64 FA2 takes 128 KV
// rows; here that spills 112-152 bytes in the KV loop (nvcc 13.0), 64 rows spill nothing.
struct Sm80FwdTiles {
  int row_blocks;  // 16-row query blocks per warp
  int block_n;     // KV rows per step
};
DUALKV_TILE_FN Sm80FwdTiles sm80_fwd_tiles(int head_dim) { return Sm80FwdTiles{head_dim <= 128 ? 2 : 1, 64}; }

// Deterministic dQ kernel (query-tile-outer): the forward's warp layout, KV steps short enough for
// S, dP and dQ in registers.
DUALKV_TILE_FN Sm80FwdTiles sm80_dq_tiles(int head_dim) {
  return Sm80FwdTiles{head_dim <= 128 ? 2 : 1, 32};
}

// Backward main kernel (KV-tile-outer): 8 warps as 4 x 2, each owning row_blocks x 16 KV rows of
// the plan's KV tile and half of its columns.
DUALKV_TILE_FN int sm80_bwd_row_blocks(int head_dim) { return plan_tiles(head_dim).bwd_block_n / 64; }

// ---- sm90 (wgmma + TMA) kernels ----
// Forward KV rows per pipeline stage: 128 up to D = 128, 64 above (shared memory: Q 64 KiB plus
// two stages of K and V).
DUALKV_TILE_FN int sm90_fwd_block_n(int head_dim) { return head_dim <= 128 ? 128 : 64; }

}  // namespace dualkv

#undef DUALKV_TILE_FN
