// Host side of the portable forward: shared-memory opt-in and a persistent launch.
#pragma once

#include <cuda_runtime.h>

#include "launch.h"
#include "sm80/arch.h"
#include "sm80/fwd_kernel.cuh"

namespace dualkv::cuda::sm80 {

template <int D, typename T>
cudaError_t run_fwd(const FwdArgs& args, int sms, cudaStream_t stream) {
  using C = FwdConfig<D>;
  const size_t smem = sizeof(FwdSmem<D, T>);
  auto kernel = fwd_kernel<D, T>;
  static int blocks_per_sm = occupancy_blocks(kernel, C::kThreads, smem);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  if ((err = cudaMemsetAsync(args.counter, 0, sizeof(int32_t), stream)) != cudaSuccess) return err;
  kernel<<<sms * blocks_per_sm, C::kThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace dualkv::cuda::sm80
