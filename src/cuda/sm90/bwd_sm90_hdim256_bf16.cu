// sm90 backward main-kernel instantiation: head dim 256, bf16 (bwd_sm90_kernel_d256.cuh; built only
// with the CMake option DUALKV_SM90_BWD_D256).
#include "sm90/bwd_sm90_launch.cuh"

namespace dualkv::cuda::sm90 {
template cudaError_t run_bwd_main<__nv_bfloat16, 256>(const BwdArgs& args, cudaStream_t stream);
template cudaError_t run_bwd<__nv_bfloat16, 256>(const BwdArgs& args, cudaStream_t stream);
}  // namespace dualkv::cuda::sm90
