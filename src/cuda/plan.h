// Tiling configurations and the work-plan format shared by the host planner and the kernels.
//
// A plan is one int32 buffer built on the host from the host layout (plan.cpp), uploaded once per
// layout by the caller, and read by every kernel of both directions:
//
//   header [kHeaderInts]
//   forward / dQ query tiles   n_fwd   x kFwdItemInts  (seg, q0, q1, work)
//   backward KV work items     n_bwd   x kBwdItemInts  (seg, k0, k1, qa, qb, slot)
//   split reductions           n_red   x kRedItemInts  (seg, k0, k1, slot0, nsplit, 0)
//
// Items are sorted longest-work-first; ties keep the segments of one tree (prompt + responses)
// adjacent so that their shared K/V stays in L2. Kernels grab items through an atomic counter and
// multiply them by the heads: item i covers work entry i / heads, head i % heads.
#pragma once

#include <stdint.h>

namespace dualkv::cuda {

constexpr int32_t kPlanMagic = 0x444B5631;  // "DKV1"
constexpr int32_t kPlanVersion = 1;
enum PlanHeader : int {
  kHdrMagic = 0,
  kHdrVersion,
  kHdrS,
  kHdrT,
  kHdrNumFwd,
  kHdrNumBwd,
  kHdrNumRed,
  kHdrNumSlots,
  kHdrFwdOffset,
  kHdrBwdOffset,
  kHdrRedOffset,
  kHdrTotalLen,
  kHdrHeadDim,
  kHeaderInts = 16
};
constexpr int kFwdItemInts = 4;
constexpr int kBwdItemInts = 6;
constexpr int kRedItemInts = 6;

// Forward kernel: warps of kMI x 16 query rows (kMI = 2 shares every K/V fragment between two
// row blocks, halving shared-memory traffic; D > 128 keeps 1 for registers); 128-row query tiles.
template <int D> struct FwdConfig {
  static constexpr int kMI = D <= 128 ? 2 : 1;
  static constexpr int kWarps = 8 / kMI;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = 16 * kMI * kWarps;
  static constexpr int kBlockN = D <= 128 ? 64 : 32;
  static constexpr int kPitch = D + 8;  // +16 B per row: conflict-free ldmatrix without swizzle
};

// Deterministic dQ kernel: same 128-row query tiles as the forward (it reuses the forward items);
// kMI row blocks per warp as in the forward, KV tiles short enough for S, dP and dQ in registers.
template <int D> struct DqConfig {
  static constexpr int kMI = D <= 128 ? 2 : 1;
  static constexpr int kWarps = 8 / kMI;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = 16 * kMI * kWarps;
  static constexpr int kBlockN = 32;
  static constexpr int kPitch = D + 8;
};

// Backward KV-outer kernel: KV tiles of kBlockN rows, 64-row query tiles, 8 warps laid out
// 4 x 2: each owns kMI x 16 KV rows (S^T, dP^T, dK, dV) and half of the columns. D <= 128:
// kMI = 2, 128-row KV tiles (each KV tile's dQ atomics cover twice the work of a 64-row tile);
// D > 128: kMI = 1, 64-row KV tiles (register budget). dQ (phase 4) uses its own layout:
// kMQ x 16 query rows by D / kDC columns per warp.
template <int D> struct BwdConfig {
  static constexpr int kMI = D <= 128 ? 2 : 1;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 4 * 16 * kMI;
  static constexpr int kMQ = (kMI == 2 && (D / 4) % 16 == 0) ? 2 : 1;
  static constexpr int kQR = kBlockM / (16 * kMQ);  // query row groups in phase 4
  static constexpr int kDC = kWarps / kQR;          // column groups in phase 4
  static constexpr int kPitch = D + 8;
  static constexpr int kPitchS = kBlockM + 8;
  static_assert((D / kDC) % 16 == 0, "phase-4 warp columns must be a multiple of 16");
};

// Runtime description of the tiling, used by the planner (host) for a head dim.
struct TileShape {
  int fwd_block_m;
  int bwd_block_m;
  int bwd_block_n;
};

inline TileShape tile_shape_for(int head_dim) {
  return head_dim <= 128 ? TileShape{FwdConfig<128>::kBlockM, BwdConfig<128>::kBlockM, BwdConfig<128>::kBlockN}
                         : TileShape{FwdConfig<256>::kBlockM, BwdConfig<256>::kBlockM, BwdConfig<256>::kBlockN};
}

}  // namespace dualkv::cuda
