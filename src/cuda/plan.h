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

// Forward (and deterministic dQ) kernel: 8 warps x 16 query rows; KV tiles of kBlockN rows.
template <int D> struct FwdConfig {
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = 16 * kWarps;
  static constexpr int kBlockN = D <= 128 ? 64 : 32;
  static constexpr int kPitch = D + 8;  // +16 B per row: conflict-free ldmatrix without swizzle
};

// Backward KV-outer kernel: KV tile of kBlockN rows, query tiles of kBlockM rows, 8 warps.
template <int D> struct BwdConfig {
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 64;
  static constexpr int kPitch = D + 8;
  static constexpr int kPitchS = kBlockM + 8;
};

// Runtime description of the tiling, used by the planner (host) for a head dim.
struct TileShape {
  int fwd_block_m;
  int bwd_block_m;
  int bwd_block_n;
};

inline TileShape tile_shape_for(int head_dim) {
  (void)head_dim;
  return TileShape{FwdConfig<128>::kBlockM, BwdConfig<128>::kBlockM, BwdConfig<128>::kBlockN};
}

}  // namespace dualkv::cuda
