// Internal interfaces between the C ABI layer (api.cpp) and the backends.
//
// api.cpp validates every argument and then dispatches; a backend may assume its params are
// valid (shapes, strides, layout derived, workspace large enough) and only reports failures of
// its own (e.g. a CUDA launch error) through set_error().
#ifndef DUALKV_SRC_INTERNAL_H_
#define DUALKV_SRC_INTERNAL_H_

#include <cstdarg>
#include <string>

#include "dualkv/dualkv.h"

namespace dualkv::detail {

// Records the thread-local last error and returns `status`, so call sites read
// `return fail(DUALKV_ERROR_INVALID_ARGUMENT, "q: ...", ...);`.
dualkv_status fail(dualkv_status status, const char* format, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void clear_error();

const char* dtype_name(int32_t dtype);
size_t dtype_size(int32_t dtype);

// Validates a host layout completely: re-derives it from seg_offsets/seg_parent (and the external
// prefixes, NULL for none) and compares the derived arrays, so that no entry point taking a layout
// can index out of bounds through inconsistent metadata (src/layout.cpp). O(S).
dualkv_status check_host_layout(const dualkv_layout& layout, const dualkv_prefixes* prefixes = nullptr);

// Rounds a workspace offset up to the 256-byte alignment the ABI promises.
constexpr size_t align_workspace(size_t bytes) { return (bytes + 255) & ~size_t(255); }

// ---- CPU backend (src/cpu/) ----
size_t cpu_fwd_workspace_bytes(const dualkv_fwd_params& p);
dualkv_status cpu_fwd(const dualkv_fwd_params& p);
size_t cpu_bwd_workspace_bytes(const dualkv_bwd_params& p);
dualkv_status cpu_bwd(const dualkv_bwd_params& p);
// Instruction set of the CPU backend's blocked kernels on this processor ("avx512", ...).
const char* cpu_isa();

// ---- CUDA backend (src/cuda/), present when built with DUALKV_WITH_CUDA ----
#if defined(DUALKV_WITH_CUDA)
// DUALKV_OK if this (dtype, head_dim) was built and runs on device `device_index`; otherwise an
// UNSUPPORTED/CUDA status with the last error set to say why.
dualkv_status cuda_check_supported(int32_t device_index, int32_t dtype, int32_t head_dim);
// Plans for a device (plan.h), cut to `window` (0: none), with the external prefix table
// `prefixes` (host memory; NULL: none), for the kernel family `tiles` (DUALKV_PLAN_TILES_*;
// DEVICE: the one the dispatcher runs the forward with on this device now).
dualkv_status cuda_plan_size(const dualkv_layout& host_layout, const dualkv_prefixes* prefixes, int32_t device_index,
                             int32_t dtype, int32_t head_dim, int32_t window, int32_t tiles, int64_t* plan_len,
                             uint64_t* plan_key);
dualkv_status cuda_plan_build(const dualkv_layout& host_layout, const dualkv_prefixes* prefixes, int32_t device_index,
                              int32_t dtype, int32_t head_dim, int32_t window, int32_t tiles, int32_t* plan,
                              int64_t plan_len);
size_t cuda_fwd_workspace_bytes(const dualkv_fwd_params& p);
dualkv_status cuda_fwd(const dualkv_fwd_params& p);
size_t cuda_bwd_workspace_bytes(const dualkv_bwd_params& p);
dualkv_status cuda_bwd(const dualkv_bwd_params& p);
// JSON fragment describing what was built, e.g. "\"cuda_archs\": [\"80\"], \"head_dims\": [64]".
std::string cuda_build_info_json();
#endif

}  // namespace dualkv::detail

#endif  // DUALKV_SRC_INTERNAL_H_
