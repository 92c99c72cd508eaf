// The CPU backend's entry points: the fp64 reference for float64 inputs and
// DUALKV_FLAG_ACCUMULATE_FP64, the blocked fp32 path otherwise (backends.h). Both are
// deterministic: every output element is computed by one work item in a fixed order, so results
// are bit-identical for any thread count.
#include <exception>
#include <new>

#include "cpu/backends.h"
#include "cpu/tile_kernels.h"
#include "dualkv/dualkv.h"
#include "internal.h"

namespace dualkv::detail {
namespace {

bool use_fp64(int32_t dtype, int32_t flags) {
  return dtype == DUALKV_DTYPE_FLOAT64 || (flags & DUALKV_FLAG_ACCUMULATE_FP64);
}

template <typename Fn>
dualkv_status guarded(const char* what, Fn&& fn) {
  try {
    fn();
    return DUALKV_OK;
  } catch (const std::bad_alloc&) {
    return fail(DUALKV_ERROR_INTERNAL, "%s (cpu): out of host memory", what);
  } catch (const std::exception& e) {
    return fail(DUALKV_ERROR_INTERNAL, "%s (cpu): %s", what, e.what());
  }
}

}  // namespace

size_t cpu_fwd_workspace_bytes(const dualkv_fwd_params&) { return 0; }
size_t cpu_bwd_workspace_bytes(const dualkv_bwd_params&) { return 0; }

dualkv_status cpu_fwd(const dualkv_fwd_params& p) {
  return guarded("fwd", [&] { use_fp64(p.dtype, p.flags) ? cpu::reference_forward(p) : cpu::blocked_forward(p); });
}

dualkv_status cpu_bwd(const dualkv_bwd_params& p) {
  return guarded("bwd", [&] { use_fp64(p.dtype, p.flags) ? cpu::reference_backward(p) : cpu::blocked_backward(p); });
}

// The widest set in use: amx where bfloat16 runs on AMX tiles (everything else then runs avx512).
const char* cpu_isa() { return cpu::tile_kernels(DUALKV_DTYPE_BFLOAT16).isa; }

}  // namespace dualkv::detail
