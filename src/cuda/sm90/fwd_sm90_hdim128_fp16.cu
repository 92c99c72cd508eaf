// sm90 forward instantiation: head dim 128, fp16.
#include "sm90/fwd_sm90_launch.cuh"

namespace dualkv::cuda::sm90 {
template cudaError_t run_fwd<__half, 128>(const FwdArgs& args, cudaStream_t stream);
}  // namespace dualkv::cuda::sm90
