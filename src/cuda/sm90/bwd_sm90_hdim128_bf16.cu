// sm90 backward main-kernel instantiation: head dim 128, bf16.
#include "sm90/bwd_sm90_launch.cuh"

namespace dualkv::cuda::sm90 {
template cudaError_t run_bwd_main<__nv_bfloat16, 128>(const BwdArgs& args, cudaStream_t stream);
template cudaError_t run_bwd<__nv_bfloat16, 128>(const BwdArgs& args, cudaStream_t stream);
}  // namespace dualkv::cuda::sm90
