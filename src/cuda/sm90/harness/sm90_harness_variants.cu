// Test-only: the alternative (non-default) variant of the hdim-128 sm90 forward, for A/B runs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "sm90/fwd_sm90_launch.cuh"

using dualkv::cuda::FwdArgs;
namespace s9 = dualkv::cuda::sm90;

cudaError_t sm90_test_alt_variant(int dtype, int head_dim, const FwdArgs& a, cudaStream_t st, int window) {
  if (head_dim != 128) return cudaErrorInvalidValue;
  if (dtype == 1) return s9::launch_fwd_variant<__half, 128, !s9::kDefaultPingPong>(a, st, window > 0 ? window : s9::kDefaultTileWindow);
  return s9::launch_fwd_variant<__nv_bfloat16, 128, !s9::kDefaultPingPong>(a, st, window > 0 ? window : s9::kDefaultTileWindow);
}
