// The work plan's format, shared by the host planner (plan.cpp) and every kernel's plan reader.
//
// A plan is one int32 buffer built on the host from the host layout, uploaded once per layout by
// the caller, and read by every kernel of both directions:
//
//   header [kHeaderInts]
//   forward / dQ query tiles   n_fwd   x kFwdItemInts  (seg, q0, q1, work)
//   backward KV work items     n_bwd   x kBwdItemInts  (seg, k0, k1, qa, qb, slot)
//   split reductions           n_red   x kRedItemInts  (seg, k0, k1, slot0, nsplit, 0)
//
// An item whose segment is external (seg_prefix[seg] >= 0: a root holding prefix rows, no tokens)
// is a prefix item: its k0, k1 are rows of the prefix buffers, qa, qb tokens of the segment's subtree
// (SegmentMask::bwd_prefix_query_range), and its dK / dV are added into prefix_dk / prefix_dv.
//
// Items are sorted longest-work-first; ties keep the segments of one tree (prompt + responses)
// adjacent so that their shared K/V stays in L2. Kernels grab items through an atomic counter and
// multiply them by the heads: forward item i covers tile i / H, query head i % H; backward item i
// covers KV work entry i / Hk, KV head i % Hk.
#pragma once

#include <stdint.h>

namespace dualkv {

constexpr int32_t kPlanMagic = 0x444B5631;  // "DKV1"
// 2: backward items over external prefix segments' rows (issue 17); the key folds in the prefix table.
constexpr int32_t kPlanVersion = 2;
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

// The plan key (uint64) passed back in the params: bits 63..20 hash (plan version, head dim,
// tiling, S, T, number of external prefixes and of their rows), bits 19..0 are the number of split slots (which sizes the backward workspace).
constexpr int kPlanSlotBits = 20;
constexpr uint64_t kPlanSlotMask = (uint64_t(1) << kPlanSlotBits) - 1;

}  // namespace dualkv
