// The plan reader: how every kernel, of every arch, takes its work from the plan (plan_format.h).
//
// A kernel first checks that the plan was built for its layout (S, T; the host already rejected a
// wrong plan key, this catches a stale device buffer) and otherwise does nothing. Persistent CTAs
// then take item indices from an atomic counter in the workspace; an index covers one plan entry
// and one head: in the portable forward entry i / H with query head i % H, in the Hopper forward
// KV head outer over the whole plan (decode_fwd_item, fwd_item_order.h), backward entry i / Hk with
// KV head i % Hk; either way the CTAs running at one moment share K/V.
#pragma once

#include <stdint.h>

#include "fwd_item_order.h"
#include "kernel_params.h"
#include "plan_format.h"

namespace dualkv::cuda {

__device__ __forceinline__ bool plan_matches(const int32_t* plan, const LayoutPtrs& L) {
  return plan[kHdrMagic] == kPlanMagic && plan[kHdrS] == L.num_segments && plan[kHdrT] == L.num_tokens;
}

// The item lists start at plan[kHdrFwdOffset], plan[kHdrBwdOffset] and plan[kHdrRedOffset]
// (forward query tiles (seg, q0, q1, work), backward KV items (seg, k0, k1, qa, qb, slot), split
// reductions (seg, k0, k1, slot0, nsplit, 0)). Kernels index them inline: an accessor function here
// changed ptxas' schedule of the Hopper backward (16 bytes spilled at D = 64).

// Forward item index -> (query tile, head): decode_fwd_item of fwd_item_order.h (the Hopper
// forward's order; shared with the host, which picks its window and head runs per launch).

// external prefix (issue 17): whether a backward item or reduction of segment `seg` is a prefix item
// (plan_format.h: its k0, k1 are rows of the prefix buffers). Only the kernels' prefix
// instantiations call it (a layout without prefixes has a null seg_prefix).
__device__ __forceinline__ bool is_prefix_item(const LayoutPtrs& L, int32_t seg) {
  return L.seg_prefix != nullptr && L.seg_prefix[seg] >= 0;
}

}  // namespace dualkv::cuda
