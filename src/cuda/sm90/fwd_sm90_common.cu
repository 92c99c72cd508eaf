// Host helpers of the sm90 forward shared by every instantiation.
#include <stdint.h>

#include "sm90/fwd_sm90.h"

namespace dualkv::cuda::sm90 {

// DUALKV_SM90_HDIM_<d> is defined (sources.cmake) for every head dim with an sm90 instantiation.
bool fwd_supported(int head_dim) {
  switch (head_dim) {
#ifdef DUALKV_SM90_HDIM_64
    case 64: return true;
#endif
#ifdef DUALKV_SM90_HDIM_128
    case 128: return true;
#endif
#ifdef DUALKV_SM90_HDIM_256
    case 256: return true;
#endif
    default: return false;
  }
}

static bool aligned16(const void* p, int64_t ts, int64_t hs, int heads, int element_bytes) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  if (ts <= 0 || (ts * element_bytes) % 16 != 0) return false;
  if (heads > 1 && (hs <= 0 || (hs * element_bytes) % 16 != 0)) return false;
  return true;
}

bool fwd_args_supported(const FwdArgs& a, int head_dim, int element_bytes) {
  if (head_dim % 64 != 0 || element_bytes != 2) return false;
  if (a.layout.num_tokens <= 0 || a.num_heads <= 0 || a.num_kv_heads <= 0) return false;
  // The epilogue stores pairs of elements (4 bytes) straight from registers.
  if (reinterpret_cast<uintptr_t>(a.out) % 4 != 0 || a.o_ts % 2 != 0 || a.o_hs % 2 != 0) return false;
  return aligned16(a.q, a.q_ts, a.q_hs, a.num_heads, element_bytes) &&
         aligned16(a.k, a.k_ts, a.k_hs, a.num_kv_heads, element_bytes) &&
         aligned16(a.v, a.v_ts, a.v_hs, a.num_kv_heads, element_bytes);
}

}  // namespace dualkv::cuda::sm90
