// The two implementations behind the CPU backend's entry points (attention_cpu.cpp): the
// blocked fp32 path that CPU users run, and the fp64 reference that the GPU kernels and the
// blocked path are judged against. Both take validated params and throw on resource failures.
#ifndef DUALKV_SRC_CPU_BACKENDS_H_
#define DUALKV_SRC_CPU_BACKENDS_H_

#include "dualkv/dualkv.h"

namespace dualkv::detail::cpu {

// Blocked (query tile x key block), vectorised (tile_kernels.h), multi-threaded; fp32
// accumulation for float32, bfloat16 and float16 inputs.
void blocked_forward(const dualkv_fwd_params& p);
void blocked_backward(const dualkv_bwd_params& p);

// fp64 accumulation, one query row or key at a time (float64 inputs and DUALKV_FLAG_ACCUMULATE_FP64).
void reference_forward(const dualkv_fwd_params& p);
void reference_backward(const dualkv_bwd_params& p);

}  // namespace dualkv::detail::cpu

#endif  // DUALKV_SRC_CPU_BACKENDS_H_
