// When the Hopper kernels take a call (arch.h).
#include <stdint.h>

#include "sm90/arch.h"

namespace dualkv::cuda::sm90 {

namespace {

// A [T, heads, D] 16-bit operand TMA can describe.
bool tma_ok(const void* p, int64_t ts, int64_t hs, int heads) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  if (ts <= 0 || (ts * 2) % 16 != 0) return false;
  if (heads > 1 && (hs <= 0 || (hs * 2) % 16 != 0)) return false;
  return true;
}

// An output the epilogues store in element pairs (4 bytes) straight from registers.
bool pairs_ok(const void* p, int64_t ts, int64_t hs) {
  return reinterpret_cast<uintptr_t>(p) % 4 == 0 && ts % 2 == 0 && hs % 2 == 0;
}

}  // namespace

bool fwd_args_ok(const FwdArgs& a, int head_dim) {
  if (head_dim % 64 != 0) return false;
  if (a.layout.num_tokens <= 0 || a.num_heads <= 0 || a.num_kv_heads <= 0) return false;
  // external prefix (issue 17): the prefix buffers are TMA-loaded like k and v.
  if (a.prefix_k != nullptr &&
      !(tma_ok(a.prefix_k, a.pk_ts, a.pk_hs, a.num_kv_heads) && tma_ok(a.prefix_v, a.pv_ts, a.pv_hs, a.num_kv_heads)))
    return false;
  return pairs_ok(a.out, a.o_ts, a.o_hs) && tma_ok(a.q, a.q_ts, a.q_hs, a.num_heads) &&
         tma_ok(a.k, a.k_ts, a.k_hs, a.num_kv_heads) && tma_ok(a.v, a.v_ts, a.v_hs, a.num_kv_heads);
}

bool bwd_args_ok(const BwdArgs& a, int head_dim) {
  if (head_dim % 64 != 0) return false;
  if (a.layout.num_tokens <= 0 || a.num_heads <= 0 || a.num_kv_heads <= 0) return false;
  if (a.num_heads % a.num_kv_heads != 0) return false;
  // The dQ accumulator is a TMA reduce target (global address 16-byte aligned).
  if (!a.deterministic && (a.dq_accum == nullptr || reinterpret_cast<uintptr_t>(a.dq_accum) % 16 != 0)) return false;
  // external prefix (issue 17): the prefix buffers are TMA-loaded like k and v; their gradients are
  // stored in element pairs like dk and dv.
  if (a.prefix_k != nullptr &&
      !(tma_ok(a.prefix_k, a.pk_ts, a.pk_hs, a.num_kv_heads) && tma_ok(a.prefix_v, a.pv_ts, a.pv_hs, a.num_kv_heads) &&
        pairs_ok(a.prefix_dk, a.pdk_ts, a.pdk_hs) && pairs_ok(a.prefix_dv, a.pdv_ts, a.pdv_hs)))
    return false;
  return pairs_ok(a.dk, a.dk_ts, a.dk_hs) && pairs_ok(a.dv, a.dv_ts, a.dv_hs) &&
         tma_ok(a.q, a.q_ts, a.q_hs, a.num_heads) && tma_ok(a.dout, a.do_ts, a.do_hs, a.num_heads) &&
         tma_ok(a.k, a.k_ts, a.k_hs, a.num_kv_heads) && tma_ok(a.v, a.v_ts, a.v_hs, a.num_kv_heads);
}

}  // namespace dualkv::cuda::sm90
