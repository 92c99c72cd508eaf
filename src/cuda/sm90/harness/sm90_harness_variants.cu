// Test-only: alternative (non-default) variants of the hdim-128 sm90 forward, for A/B runs.
//   variant 1: ping-pong flipped          variant 2: split K/V release flipped
//   variant 3: both flipped
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "sm90/fwd_sm90_launch.cuh"

using dualkv::cuda::FwdArgs;
namespace s9 = dualkv::cuda::sm90;

template <typename T>
static cudaError_t alt(int variant, const FwdArgs& a, cudaStream_t st, int w) {
  constexpr bool PP = s9::kDefaultPingPong, SR = s9::kDefaultSplitRelease;
  switch (variant) {
    case 1: return s9::launch_fwd_variant<T, 128, !PP, SR>(a, st, w);
    case 2: return s9::launch_fwd_variant<T, 128, PP, !SR>(a, st, w);
    case 3: return s9::launch_fwd_variant<T, 128, !PP, !SR>(a, st, w);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t sm90_test_alt_variant(int variant, int dtype, int head_dim, const FwdArgs& a, cudaStream_t st,
                                  int window) {
  if (head_dim != 128) return cudaErrorInvalidValue;
  const int w = window > 0 ? window : s9::kDefaultTileWindow;
  return dtype == 1 ? alt<__half>(variant, a, st, w) : alt<__nv_bfloat16>(variant, a, st, w);
}
