// The work plan's format, shared by the host planner (plan.cpp) and every kernel's plan reader.
//
// A plan is one int32 buffer built on the host from the host layout, uploaded once per layout by
// the caller, and read by every kernel of both directions:
//
//   header [kHeaderInts]
//   forward / dQ query tiles   n_fwd   x kFwdItemInts  (seg, q0, q1, work): rows [q0, q1) of
//                              segment seg, or, with q1 past seg's end, the whole short leaves
//                              seg, seg + 1, ... of one parent (or roots) that follow it (a tile of
//                              siblings, SegmentMask::fwd_packs_siblings: seg's ancestors, then each
//                              sibling's own range, KvWalk; never in a windowed plan)
//   backward KV work items     n_bwd   x kBwdItemInts  (seg, k0, k1, qa, qb, slot)
//   split reductions           n_red   x kRedItemInts  (seg, k0, k1, slot0, nsplit, 0)
//   distance biases            n_bwd int32, only in a plan with a sliding window (header
//                              kHdrWindow > 0, at kHdrBwdBiasOffset): see below
//
// An item whose segment is external (seg_prefix[seg] >= 0: a root holding prefix rows, no tokens)
// is a prefix item: its k0, k1 are rows of the prefix buffers, qa, qb tokens of the segment's subtree
// (SegmentMask::bwd_prefix_query_range), and its dK / dV are added into prefix_dk / prefix_dv.
//
// Forward items are sorted longest-work-first; ties keep the segments of one tree (prompt +
// responses) adjacent so that their shared K/V stays in L2. Backward items (no window) run one
// segment's items together, longest first, segments by their longest item, so the items in flight
// share their query rows in L2 (plan.cpp). The backward items of a plan with a sliding
// window are ordered for L2 reuse of their queries instead (plan.cpp, order_windowed_items): the
// long un-windowed pieces first, then token order of the query ranges, ending on a tail of short
// items by length class. Kernels grab items through an atomic counter and
// multiply them by the heads: forward item i covers tile i / H, query head i % H; backward item i
// covers KV work entry i / Hk, KV head i % Hk.
//
// A plan built for a sliding window W (mask modifiers, issue 16) has the same lists,
// cut to the window so that the work scales with W: a forward tile's work counts only the keys
// SegmentMask::keys_in_window leaves it (the kernels' walk stops at the first ancestor the window
// cuts entirely); a backward KV tile has one item per contiguous query range that sees it: its own
// segment's queries up to where the window closes, then per descendant segment the prefix of its
// tokens that SegmentMask::queries_in_window leaves (a descendant past the window is skipped with
// its subtree), each range split as usual, or, when no pair of the tile's whole query range
// [k0, subtree_token_end) is hidden by the window, that range as one item as without a window.
// Every KV tile with more than one item goes through the split partials and a reduction. Item
// i's distance bias b_i makes pos(q) - pos(k) = (q - k) + b_i for its pairs (SegmentMask::
// window_bias; 0 in the own segment), or is -T for an un-windowed range (no pair hidden), so the
// kernels apply the window as (q - k) + b_i >= W.
#pragma once

#include <stdint.h>

namespace dualkv {

constexpr int32_t kPlanMagic = 0x444B5631;  // "DKV1"
// 2 was two versions on two branches: the window (kHdrWindow, the distance biases) and backward
// items over external prefix segments' rows (issue 17). 3 has both: the key folds in the window
// and the prefix table. 4: the key's bit 19 is the long-walk bit (slot counts below 2^19), so a
// key of 3 (whose slot count could reach bit 19) is rejected rather than misread. 5: bit 18 is the
// ragged-tiles bit (slot counts below 2^18).
constexpr int32_t kPlanVersion = 5;
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
  kHdrWindow,         // the sliding window the plan was cut to (0: none)
  kHdrBwdBiasOffset,  // the backward items' distance biases (0 without a window)
  kHeaderInts = 16
};
constexpr int kFwdItemInts = 4;
constexpr int kBwdItemInts = 6;
constexpr int kRedItemInts = 6;

// The plan key (uint64) passed back in the params: bits 63..20 hash (plan version, head dim,
// tiling, S, T, window, number of external prefixes and of their rows); bit 19 says the forward's
// KV walks are long (tile_size.h fwd_long_kv_walks; it picks the forward kernel's build: at D 128
// its KV tile width, which computes the same attention either way, not the same bits: the online
// softmax's blocks differ; a function of the layout, so not hashed); bit 18 says the forward's query
// tiles are ragged (tile_size.h fwd_ragged_tiles; the sliding-window kernels pack query heads only
// then: sm90/fwd_launch.cuh); bits 17..0 are the number of split slots (which sizes the backward
// workspace).
constexpr int kPlanKeyLowBits = 20;  // the bits below the hash
constexpr uint64_t kPlanLongWalksBit = uint64_t(1) << 19;
constexpr uint64_t kPlanRaggedTilesBit = uint64_t(1) << 18;
constexpr uint64_t kPlanSlotMask = kPlanRaggedTilesBit - 1;

}  // namespace dualkv
