// Kernel-side parameter blocks (plain structs passed by value), the same for every arch: each
// arch folder's arch.h declares run_fwd / run_bwd over them.
#pragma once

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "dualkv/dualkv.h"

namespace dualkv::cuda {

struct LayoutPtrs {
  const int32_t* offsets;
  const int32_t* parent;
  const int32_t* subtree_end;
  int32_t num_segments;
  int32_t num_tokens;
  // external prefix (issue 17): the prefix table (device memory), null without external prefixes
  const int32_t* seg_prefix;      // [S] prefix held by segment s, or -1
  const int32_t* prefix_offsets;  // [E+1] rows of each prefix in the prefix buffers
  const int32_t* position_offset;  // [S] (mask modifiers, issue 16: positions for the window)
};

struct FwdArgs {
  LayoutPtrs layout;
  const int32_t* plan;
  int64_t plan_len;
  int32_t fwd_block_m;  // the plan's forward query tile rows (its key names them: dispatch.cu)
  int32_t long_kv_walks;  // the plan key's long-walk bit: kernels with a long-walk build run it (tile_size.h)
  int32_t ragged_tiles;   // the plan key's ragged-tiles bit: the window kernels pack query heads only then
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;  // may be null
  int64_t q_ts, q_hs, k_ts, k_hs, v_ts, v_hs, o_ts, o_hs, lse_hs;
  int32_t num_heads, num_kv_heads;
  float scale;       // softmax scale
  float scale_log2;  // scale * log2(e)
  int32_t* counter;  // work-item counter, zeroed before the launch
  // external prefix (issue 17): the prefix key/value buffers [rows, Hk, D] (null without external
  // prefixes: the launchers then run the kernels' default instantiations)
  const void* prefix_k;
  const void* prefix_v;
  int64_t pk_ts, pk_hs, pv_ts, pv_hs;
  int32_t prefix_rows;  // rows of the prefix buffers (the Hopper kernels' TMA maps)
  // mask modifiers (issue 16): each off when zero / null. The kernels take which modifiers run as
  // compile-time flags (modifiers.cuh: Modifiers<softcap, sinks, window>) and these values at run
  // time; the window also keys the plan (plan_key), whose items are cut to it.
  int32_t window;
  float softcap;              // c > 0: scores s = scale q.k become c tanh(s / c)
  float softcap_exp2_factor;  // 2 log2(e) scale / c: tanh(scale q.k / c) from exp2(q.k factor)
  const float* sinks;         // [H] sink logits (natural units), or null
};

// Bytes of the backward workspace's counter block, its first piece (dispatch.cu lays it out; the
// fp32 dQ accumulator follows it, so one memset zeroes both: bwd_prepost.cuh).
constexpr size_t kBwdCounterBytes = 256;

struct BwdArgs {
  LayoutPtrs layout;
  const int32_t* plan;
  int64_t plan_len;
  int32_t fwd_block_m;  // the plan's forward query tile rows (the deterministic dQ kernel walks them)
  const void* q;
  const void* k;
  const void* v;
  const void* out;
  const void* dout;
  const float* lse;
  const float* dlse;  // may be null
  void* dq;
  void* dk;
  void* dv;
  int64_t q_ts, q_hs, k_ts, k_hs, v_ts, v_hs, o_ts, o_hs, do_ts, do_hs;
  int64_t lse_hs, dlse_hs;
  int64_t dq_ts, dq_hs, dk_ts, dk_hs, dv_ts, dv_hs;
  int32_t num_heads, num_kv_heads;
  float scale, scale_log2;
  bool deterministic;  // dQ query-outer, no accumulator (dispatch.cu bwd_dq_query_outer: also at D 256 on Hopper)
  int32_t n_slots;     // split-partial slots in the plan (from the plan key)
  // workspace pieces
  int32_t* counters;   // [4] at the start of a kBwdCounterBytes block, zeroed before the launches
  float* delta;        // [H, T]: rowsum(dO * O) - dlse
  float* dq_accum;     // [T, H, D] fp32 (atomic mode only; the portable kernels' columns in quad order:
                       // bwd_prepost.cuh, the accumulator's column order)
  float* partials;     // [n_slots, Hk, 2, BlockN, D] fp32 split partial dK / dV
  // external prefix (issue 17): the prefix key/value buffers and their gradients [rows, Hk, D],
  // which the prefix rows' dK / dV are ADDED into (null without external prefixes)
  const void* prefix_k;
  const void* prefix_v;
  void* prefix_dk;
  void* prefix_dv;
  int64_t pk_ts, pk_hs, pv_ts, pv_hs, pdk_ts, pdk_hs, pdv_ts, pdv_hs;
  int32_t prefix_rows;  // rows of the prefix buffers (the Hopper kernels' TMA maps)
  // mask modifiers (issue 16): each off when zero / null. The kernels take which modifiers run as
  // compile-time flags (modifiers.cuh: Modifiers<softcap, sinks, window>) and these values at run
  // time; the window also keys the plan (plan_key), whose items are cut to it.
  int32_t window;
  float softcap;              // c > 0: scores s = scale q.k become c tanh(s / c)
  float softcap_exp2_factor;  // 2 log2(e) scale / c: tanh(scale q.k / c) from exp2(q.k factor)
  const float* sinks;         // [H] sink logits (natural units), or null
  float* dsinks;              // [H] d loss / d sinks (written), with sinks
};

}  // namespace dualkv::cuda
