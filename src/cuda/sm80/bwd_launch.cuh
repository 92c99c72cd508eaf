// Host side of the portable backward: preprocess, the main kernel (Q stages chosen by the device's
// shared memory), the deterministic dQ kernel or nothing, postprocess.
#pragma once

#include <cuda_runtime.h>

#include "bwd_prepost.cuh"
#include "launch.h"
#include "sm80/arch.h"
#include "sm80/bwd_dq_kernel.cuh"
#include "sm80/bwd_kernel.cuh"

namespace dualkv::cuda::sm80 {

// sm_80's opt-in shared memory per block (A100); sm_86/89 have 99 KB.
constexpr size_t kSm80SmemBytes = 163 * 1024;

template <int D, typename T, bool kAtomicDq, int kQStages>
cudaError_t launch_bwd_kv(const BwdArgs& args, int sms, cudaStream_t stream) {
  using C = BwdConfig<D>;
  constexpr size_t smem = sizeof(BwdSmem<D, T, kQStages>);
  auto kernel = bwd_kv_kernel<D, T, kAtomicDq, kQStages>;
  static int bps = occupancy_blocks(kernel, C::kThreads, smem);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  kernel<<<sms * bps, C::kThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

// Two Q buffers where the device's shared memory holds them (every head dim on Hopper; up to 192
// on sm_80), else one (the kernel with one buffer is instantiated only where two exceed sm_80's).
template <int D, typename T, bool kAtomicDq>
cudaError_t launch_bwd_kv(const BwdArgs& args, int sms, cudaStream_t stream) {
  if constexpr (sizeof(BwdSmem<D, T, 2>) > kSm80SmemBytes) {
    if (sizeof(BwdSmem<D, T, 2>) > device_smem_limit()) return launch_bwd_kv<D, T, kAtomicDq, 1>(args, sms, stream);
  }
  return launch_bwd_kv<D, T, kAtomicDq, 2>(args, sms, stream);
}

template <int D, typename T>
cudaError_t run_bwd(const BwdArgs& args, int sms, cudaStream_t stream) {
  cudaError_t err;
  if ((err = launch_bwd_preprocess<D, T>(args, sms, stream)) != cudaSuccess) return err;
  err = args.deterministic ? launch_bwd_kv<D, T, false>(args, sms, stream) : launch_bwd_kv<D, T, true>(args, sms, stream);
  if (err != cudaSuccess) return err;
  if (args.deterministic && (err = launch_bwd_dq<D, T>(args, sms, stream)) != cudaSuccess) return err;
  return launch_bwd_postprocess<D, T>(args, sms, stream);
}

}  // namespace dualkv::cuda::sm80
