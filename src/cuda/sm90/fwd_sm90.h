// Hopper (sm_90a) forward attention: wgmma + TMA + warp specialisation. It consumes the same
// FwdArgs and work plan (plan.h) as the portable sm80 path, so the dispatcher can choose it on
// sm_90 devices with no other change. One translation unit per (head dim, dtype) instantiates it.
#pragma once

#include <cuda_runtime_api.h>

#include "kernel_params.h"

namespace dualkv::cuda::sm90 {

// Tiles per scheduling window (decode_item in fwd_sm90_kernel.cuh).
constexpr int kTileWindow = 16;

// Launches the forward kernel for one micro-batch on `stream`. Zeroes args.counter first (the
// work-item counter), like the sm80 launcher. Returns cudaErrorNotSupported when the inputs do not
// meet the TMA constraints (every base pointer 16-byte aligned, token and head strides multiples of
// 16 bytes): the caller may then fall back to the sm80 kernel. Requires a device of compute
// capability 9.0 (sm_90a code).
template <typename Element, int HeadDim>
cudaError_t run_fwd(const FwdArgs& args, cudaStream_t stream);

// Whether this build has an sm90 forward kernel for `head_dim` (either dtype).
bool fwd_supported(int head_dim);

// Whether `args` meets the sm90 kernel's alignment constraints for `head_dim` (see run_fwd; also:
// out 4-byte aligned with even token and head strides).
bool fwd_args_supported(const FwdArgs& args, int head_dim, int element_bytes);

}  // namespace dualkv::cuda::sm90
