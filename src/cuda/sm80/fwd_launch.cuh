// Host side of the portable forward: shared-memory opt-in and a persistent launch.
#pragma once

#include <cuda_runtime.h>

#include "launch.h"
#include "sm80/arch.h"
#include "sm80/fwd_kernel.cuh"

namespace dualkv::cuda::sm80 {

template <int D, int kTileM, typename T, typename Mods>
cudaError_t launch_fwd(const FwdArgs& args, int sms, cudaStream_t stream) {
  constexpr int kThreads = FwdConfig<D, kTileM>::kThreads;
  constexpr size_t kSmem = sizeof(FwdSmemOf<D, kTileM, T>);
  if (args.prefix_k != nullptr) {  // external prefix (issue 17): instantiated without modifiers only
    if constexpr (std::is_same_v<Mods, NoModifiers>)
      return launch_on_sms<fwd_kernel<D, kTileM, T, Mods, true>>(kThreads, kSmem, sms, args, stream);
    else
      return cudaErrorNotSupported;  // api.cpp refuses a modifier with external prefixes first
  }
  return launch_on_sms<fwd_kernel<D, kTileM, T, Mods, false>>(kThreads, kSmem, sms, args, stream);
}

// The kernel built for the plan's query tiles (args.fwd_block_m, config.h with_plan_tile).
template <int D, typename T, typename Mods>
cudaError_t run_fwd(const FwdArgs& args, int sms, cudaStream_t stream) {
  const cudaError_t err = cudaMemsetAsync(args.counter, 0, sizeof(int32_t), stream);
  if (err != cudaSuccess) return err;
  return with_plan_tile<D>(args.fwd_block_m,
                           [&](auto m) { return launch_fwd<D, decltype(m)::value, T, Mods>(args, sms, stream); });
}

}  // namespace dualkv::cuda::sm80
