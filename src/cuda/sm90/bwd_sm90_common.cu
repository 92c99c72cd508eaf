// Host helpers of the sm90 backward shared by every instantiation.
#include <stdint.h>

#include "sm90/bwd_sm90.h"

namespace dualkv::cuda::sm90 {

// DUALKV_SM90_BWD_HDIM_<d> is defined (sources.cmake) for every head dim with an sm90 backward.
bool bwd_supported(int head_dim) {
  switch (head_dim) {
#ifdef DUALKV_SM90_BWD_HDIM_64
    case 64: return true;
#endif
#ifdef DUALKV_SM90_BWD_HDIM_128
    case 128: return true;
#endif
#ifdef DUALKV_SM90_BWD_HDIM_256
    case 256: return true;
#endif
    default: return false;
  }
}

static bool bwd_tma_ok(const void* p, int64_t ts, int64_t hs, int heads, int element_bytes) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  if (ts <= 0 || (ts * element_bytes) % 16 != 0) return false;
  if (heads > 1 && (hs <= 0 || (hs * element_bytes) % 16 != 0)) return false;
  return true;
}

bool bwd_args_supported(const BwdArgs& a, int head_dim, int element_bytes) {
#ifdef DUALKV_SM90_BWD_HDIM_256
  const bool dim_ok = head_dim == 64 || head_dim == 128 || head_dim == 256;
#else
  const bool dim_ok = head_dim == 64 || head_dim == 128;
#endif
  if (!dim_ok || element_bytes != 2) return false;
  if (a.layout.num_tokens <= 0 || a.num_heads <= 0 || a.num_kv_heads <= 0) return false;
  if (a.num_heads % a.num_kv_heads != 0) return false;
  if (!a.deterministic && a.dq_accum == nullptr) return false;
  // The dQ accumulator is a TMA reduce target (global address 16-byte aligned). Head dim 256 is one
  // only in a DUALKV_SM90_BWD_D256_DQ_BULK build (else per-thread atomics); the check is harmless there.
  if (!a.deterministic && reinterpret_cast<uintptr_t>(a.dq_accum) % 16 != 0) return false;
  // The epilogue stores pairs of elements (4 bytes) straight from registers.
  if (reinterpret_cast<uintptr_t>(a.dk) % 4 != 0 || a.dk_ts % 2 != 0 || a.dk_hs % 2 != 0) return false;
  if (reinterpret_cast<uintptr_t>(a.dv) % 4 != 0 || a.dv_ts % 2 != 0 || a.dv_hs % 2 != 0) return false;
  return bwd_tma_ok(a.q, a.q_ts, a.q_hs, a.num_heads, element_bytes) &&
         bwd_tma_ok(a.dout, a.do_ts, a.do_hs, a.num_heads, element_bytes) &&
         bwd_tma_ok(a.k, a.k_ts, a.k_hs, a.num_kv_heads, element_bytes) &&
         bwd_tma_ok(a.v, a.v_ts, a.v_hs, a.num_kv_heads, element_bytes);
}

}  // namespace dualkv::cuda::sm90
