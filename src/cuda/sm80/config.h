// The portable (sm80) kernels' configurations, from the tile-size table (tile_size.h).
#pragma once

#include "tile_size.h"

namespace dualkv::cuda::sm80 {

// Forward kernel: warps of kMI x 16 query rows filling the plan's query tile.
template <int D> struct FwdConfig {
  static constexpr int kMI = sm80_fwd_tiles(D).row_blocks;
  static constexpr int kBlockM = plan_tiles(D).fwd_block_m;
  static constexpr int kWarps = kBlockM / (16 * kMI);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockN = sm80_fwd_tiles(D).block_n;
  static constexpr int kPitch = D + 8;  // +16 B per row: conflict-free ldmatrix without swizzle
};

// Deterministic dQ kernel: the plan's query tiles (it reuses the forward items), kMI row blocks per
// warp as in the forward, KV tiles short enough for S, dP and dQ in registers.
template <int D> struct DqConfig {
  static constexpr int kMI = sm80_dq_tiles(D).row_blocks;
  static constexpr int kBlockM = plan_tiles(D).fwd_block_m;
  static constexpr int kWarps = kBlockM / (16 * kMI);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockN = sm80_dq_tiles(D).block_n;
  static constexpr int kPitch = D + 8;
};

// Backward KV-outer kernel: the plan's KV tiles (kBlockN rows) and query steps (kBlockM rows),
// 8 warps laid out 4 x 2: each owns kMI x 16 KV rows (S^T, dP^T, dK, dV) and half of the columns.
// dQ (phase 4) uses its own layout: kMQ x 16 query rows by D / kDC columns per warp.
template <int D> struct BwdConfig {
  static constexpr int kMI = sm80_bwd_row_blocks(D);
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = plan_tiles(D).bwd_block_m;
  static constexpr int kBlockN = plan_tiles(D).bwd_block_n;
  static constexpr int kMQ = (kMI == 2 && (D / 4) % 16 == 0) ? 2 : 1;
  static constexpr int kQR = kBlockM / (16 * kMQ);  // query row groups in phase 4
  static constexpr int kDC = kWarps / kQR;          // column groups in phase 4
  static constexpr int kPitch = D + 8;
  static constexpr int kPitchS = kBlockM + 8;
  static_assert(kBlockN == 4 * 16 * kMI, "4 warp rows of kMI x 16 KV rows");
  static_assert((D / kDC) % 16 == 0, "phase-4 warp columns must be a multiple of 16");
};

}  // namespace dualkv::cuda::sm80
