// The portable (sm80) kernels' configurations, from the tile-size table (tile_size.h).
#pragma once

#include <type_traits>

#include "sm80/smem_tile.cuh"
#include "tile_size.h"

namespace dualkv::cuda::sm80 {

// The plan query tiles the portable forward and deterministic dQ kernels are built for: the
// portable family's, and the Hopper family's where it differs (tile_size.h fwd_block_m; windowed
// plans have the portable family's in both): the Hopper forward falls back to the portable one at
// launch, and the deterministic dQ kernel runs after the Hopper backward, on the plan the Hopper
// forward ran.
template <int D> inline constexpr int kPortableTileM = fwd_block_m(D, TileFamily::kPortable, false);
template <int D> inline constexpr int kSm90TileM = fwd_block_m(D, TileFamily::kSm90, false);
// f(std::integral_constant<int, M>{}) for M the plan's query tile rows (fwd_block_m: the
// dispatcher's fwd_tiles_ok lets only these two reach the portable kernels), the one place the
// launchers turn the plan's tile into a kernel instantiation.
template <int D, typename F>
decltype(auto) with_plan_tile(int fwd_block_m, F&& f) {
  if constexpr (kSm90TileM<D> != kPortableTileM<D>) {
    if (fwd_block_m == kSm90TileM<D>) return f(std::integral_constant<int, kSm90TileM<D>>{});
  }
  return f(std::integral_constant<int, kPortableTileM<D>>{});
}

// Forward kernel: warps of kMI x 16 query rows filling the plan's query tile of kTileM rows; kDSplit
// warps per row block, each with D / kDSplit columns of O (tile_size.h: 2 at D = 512, else 1). Warp
// w has row block w % kRowWarps and column part w / kRowWarps.
template <int D, int kTileM = kPortableTileM<D>> struct FwdConfig {
  static constexpr int kMI = sm80_fwd_tiles(D, kTileM).row_blocks;
  static constexpr int kBlockM = kTileM;
  static constexpr int kDSplit = sm80_fwd_tiles(D, kTileM).d_split;
  static constexpr int kRowWarps = kBlockM / (16 * kMI);
  static constexpr int kWarps = kRowWarps * kDSplit;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockN = sm80_fwd_tiles(D, kTileM).block_n;
  static constexpr int kWarpD = D / kDSplit;  // the warp's columns of O
  using Tile = SmemTile<D, sm80_swizzled_rows(D, false)>;  // Q, K, V rows (smem_tile.cuh)
  static constexpr int kPitch = Tile::kPitch;
  static_assert(kDSplit == 1 || kMI == 1, "split row blocks are single");
};

// Deterministic dQ kernel: the plan's query tiles of kTileM rows (it reuses the forward items), kMI
// row blocks per warp as in the forward, KV tiles short enough for S, dP and dQ in registers;
// kDSplit as the forward's (dQ's columns split as O's).
template <int D, int kTileM = kPortableTileM<D>> struct DqConfig {
  static constexpr int kMI = sm80_dq_tiles(D, kTileM).row_blocks;
  static constexpr int kBlockM = kTileM;
  static constexpr int kDSplit = sm80_dq_tiles(D, kTileM).d_split;
  static constexpr int kRowWarps = kBlockM / (16 * kMI);
  static constexpr int kWarps = kRowWarps * kDSplit;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockN = sm80_dq_tiles(D, kTileM).block_n;
  using Tile = SmemTile<D, false>;  // padded rows (tile_size.h sm80_swizzled_rows)
  static constexpr int kPitch = Tile::kPitch;
  static constexpr int kWarpD = D / kDSplit;
  static_assert(kDSplit == 1 || kMI == 1, "split row blocks are single");
};

// Backward KV-outer kernel: the plan's KV tiles (kBlockN rows) and query steps of kBlockM = kStepM
// rows: the plan's split granularity (64) by default, 128 at D = 64 where the device's shared memory
// holds it (sm80_bwd_block_m, tile_size.h; the launcher picks). 8 warps: each owns kMI x 16 KV rows
// (S^T, dP^T, dK, dV) and a part of the columns.
// dQ (phase 4) uses its own layout: kMQ x 16 query rows by D / kDC columns per warp.
// kWR x kWC warps (4 x 2 up to D = 128, 2 x 4 above: tile_size.h): warp w owns KV rows of warp row w % kWR,
// query columns (S^T, dP^T) and D columns (dK, dV) of part w / kWR. Phase 4 holds kDqCols of its
// columns at a time (kDqPasses passes).
template <int D, int kStepM = plan_tiles(D).bwd_block_m> struct BwdConfig {
  static constexpr int kMI = sm80_bwd_row_blocks(D);
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = kStepM;
  static constexpr int kBlockN = plan_tiles(D).bwd_block_n;
  static constexpr int kWR = sm80_bwd_warp_rows(D);
  static constexpr int kWC = kWarps / kWR;
  static constexpr int kMQ = (kMI == 2 && (D / 4) % 16 == 0) ? 2 : 1;
  static constexpr int kQR = kBlockM / (16 * kMQ);  // query row groups in phase 4
  static constexpr int kDC = kWarps / kQR;          // column groups in phase 4
  static constexpr int kDqCols = sm80_bwd_dq_pass_cols(D / kDC);
  static constexpr int kDqPasses = (D / kDC) / kDqCols;
  using Tile = SmemTile<D, sm80_swizzled_rows(D, true)>;  // Q, K, V, dO rows (smem_tile.cuh)
  static constexpr int kPitch = Tile::kPitch;
  static constexpr int kPitchS = kBlockM + 8;
  static_assert(kBlockN == kWR * 16 * kMI, "kWR warp rows of kMI x 16 KV rows");
  static_assert((D / kDC) % 16 == 0 && kDqCols % 16 == 0, "phase-4 warp columns must be a multiple of 16");
  static_assert((kBlockM / kWC) % 16 == 0 && (D / kWC) % 16 == 0, "warp parts of 16 columns");
  static_assert(kBlockM % plan_tiles(D).bwd_block_m == 0, "steps are whole multiples of the plan's split granularity");
};

}  // namespace dualkv::cuda::sm80
