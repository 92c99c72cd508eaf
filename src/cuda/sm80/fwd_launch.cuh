// Host side of the portable forward: shared-memory opt-in and a persistent launch.
#pragma once

#include <cuda_runtime.h>

#include "launch.h"
#include "sm80/arch.h"
#include "sm80/fwd_kernel.cuh"

namespace dualkv::cuda::sm80 {

template <int D, typename T, typename Mods>
cudaError_t run_fwd(const FwdArgs& args, int sms, cudaStream_t stream) {
  const cudaError_t err = cudaMemsetAsync(args.counter, 0, sizeof(int32_t), stream);
  if (err != cudaSuccess) return err;
  if (args.prefix_k != nullptr) {  // external prefix (issue 17): instantiated without modifiers only
    if constexpr (std::is_same_v<Mods, NoModifiers>)
      return launch_on_sms<fwd_kernel<D, T, Mods, true>>(FwdConfig<D>::kThreads, sizeof(FwdSmemOf<D, T>), sms, args,
                                                         stream);
    else
      return cudaErrorNotSupported;  // api.cpp refuses a modifier with external prefixes first
  }
  return launch_on_sms<fwd_kernel<D, T, Mods, false>>(FwdConfig<D>::kThreads, sizeof(FwdSmemOf<D, T>), sms, args,
                                                      stream);
}

}  // namespace dualkv::cuda::sm80
