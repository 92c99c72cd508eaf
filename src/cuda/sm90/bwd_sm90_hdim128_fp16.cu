// sm90 backward main-kernel instantiation: head dim 128, fp16.
#include "sm90/bwd_sm90_launch.cuh"

namespace dualkv::cuda::sm90 {
template cudaError_t run_bwd_main<__half, 128>(const BwdArgs& args, cudaStream_t stream);
template cudaError_t run_bwd<__half, 128>(const BwdArgs& args, cudaStream_t stream);
}  // namespace dualkv::cuda::sm90
