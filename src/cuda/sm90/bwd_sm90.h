// Hopper (sm_90a) backward: the KV-tile-outer main kernel on wgmma + TMA + warp specialisation.
// It consumes the same BwdArgs, work plan (plan.h) and workspace as the portable sm80 path and
// replaces only its main kernel (bwd_kv_kernel); the delta preprocess, the deterministic dQ kernel,
// the dQ conversion and the split reduction stay the sm80 kernels (../bwd_kernel.cuh).
// Compiled only with the CMake option DUALKV_SM90_BWD (defines DUALKV_WITH_SM90_BWD).
#pragma once

#include <cuda_runtime_api.h>

#include "kernel_params.h"

namespace dualkv::cuda::sm90 {

// Launches the sm90 main kernel alone on `stream`. It reads what bwd_kv_kernel reads (q, k, v,
// dout, lse, the plan, args.delta already computed by the preprocess) and writes what it writes:
// dk (times args.scale) and dv for unsplit items, args.partials[slot] (fp32, unscaled) for split
// items, and, unless args.deterministic, fp32 atomic adds of dS K (unscaled) into args.dq_accum,
// which the caller zeroes first. It uses args.counters[2] as its work counter and zeroes it itself.
// Returns cudaErrorNotSupported when bwd_args_supported() fails (the caller then runs the sm80
// kernel). Requires a device of compute capability 9.0.
template <typename Element, int HeadDim>
cudaError_t run_bwd_main(const BwdArgs& args, cudaStream_t stream);

// The whole backward with the sm90 main kernel: the sequence of launch_bwd_impl in bwd_kernel.cuh
// (zero the counters and dq_accum, delta preprocess, main kernel, dQ kernel or conversion, split
// reduction) with run_bwd_main in place of bwd_kv_kernel. Returns cudaErrorNotSupported, having
// launched nothing, when bwd_args_supported() fails.
template <typename Element, int HeadDim>
cudaError_t run_bwd(const BwdArgs& args, cudaStream_t stream);

// Whether this build has an sm90 backward main kernel for `head_dim` (either dtype).
bool bwd_supported(int head_dim);

// Whether `args` meets the kernel's constraints: q, k, v, dout 16-byte aligned with token (and,
// for more than one head, head) strides multiples of 16 bytes (TMA); dk, dv 4-byte aligned with
// even strides; head_dim 64 or 128 (or 256 in DUALKV_SM90_BWD_D256 builds).
bool bwd_args_supported(const BwdArgs& args, int head_dim, int element_bytes);

}  // namespace dualkv::cuda::sm90
