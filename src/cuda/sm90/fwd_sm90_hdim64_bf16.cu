// sm90 forward instantiation: head dim 64, bf16.
#include "sm90/fwd_sm90_launch.cuh"

namespace dualkv::cuda::sm90 {
template cudaError_t run_fwd<__nv_bfloat16, 64>(const FwdArgs& args, cudaStream_t stream);
}  // namespace dualkv::cuda::sm90
