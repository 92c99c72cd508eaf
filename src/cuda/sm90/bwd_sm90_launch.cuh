// Host side of the sm90 backward: TMA descriptors, shared-memory opt-in, persistent launch of the
// main kernel, and the full backward sequence reusing the sm80 auxiliary kernels. Included by the
// per-(head dim, dtype) translation units only.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "bwd_kernel.cuh"  // the sm80 preprocess / dQ / conversion / reduction kernels
#include "sm90/bwd_sm90.h"
#include "sm90/bwd_sm90_kernel.cuh"
#include "sm90/bwd_sm90_kernel_d256.cuh"
#include "sm90/fwd_sm90_launch.cuh"  // detail::make_map, detail::sm_count

namespace dualkv::cuda::sm90 {

// Tensor map over the fp32 dQ accumulator [T, heads, D] (contiguous): box = 32 columns (128 B) x 1
// head x 64 rows, 128-byte swizzle, the layout of the kernel's dQ staging boxes. Used only to
// reduce-add into it; TMA skips the box's rows past T.
inline bool make_dq_accum_map(CUtensorMap* map, float* base, int D, int heads, int T, int rows) {
  detail::EncodeTiledFn fn = detail::encode_fn();
  if (fn == nullptr) return false;
  cuuint64_t dims[3] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(T)};
  cuuint64_t strides[2] = {static_cast<cuuint64_t>(D) * 4, static_cast<cuuint64_t>(heads) * D * 4};
  cuuint32_t box[3] = {32, 1, static_cast<cuuint32_t>(rows)};
  cuuint32_t estr[3] = {1, 1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, base, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The parameters of one main-kernel launch: the argument check, the TMA maps of Q, dO (BlockM-row
// boxes), K, V (BlockN-row boxes) and, unless deterministic (no dQ), of the fp32 dQ accumulator; the
// work counter zeroed on `stream`. cudaErrorNotSupported:
// nothing was launched (the caller falls back to the sm80 kernel).
template <typename Element, int HeadDim, int BlockM, int BlockN>
cudaError_t prepare_bwd_params(const BwdArgs& args, Sm90BwdParams<HeadDim>* p, cudaStream_t stream) {
  constexpr CUtensorMapDataType dt = Pack2<Element>::kTmaType;
  if (!bwd_args_supported(args, HeadDim, 2)) return cudaErrorNotSupported;
  const int T = args.layout.num_tokens;
  const int H = args.num_heads, Hk = args.num_kv_heads;
  p->a = args;
  p->counter = args.counters + 2;
  if (!detail::make_map(&p->tq, dt, args.q, HeadDim, H, T, args.q_hs, args.q_ts, BlockM) ||
      !detail::make_map(&p->tdo, dt, args.dout, HeadDim, H, T, args.do_hs, args.do_ts, BlockM) ||
      !detail::make_map(&p->tk, dt, args.k, HeadDim, Hk, T, args.k_hs, args.k_ts, BlockN) ||
      !detail::make_map(&p->tv, dt, args.v, HeadDim, Hk, T, args.v_hs, args.v_ts, BlockN))
    return cudaErrorNotSupported;
  if (!args.deterministic && !make_dq_accum_map(&p->tdq, args.dq_accum, HeadDim, H, T, BlockM))
    return cudaErrorNotSupported;
  if (detail::sm_count() <= 0) return cudaErrorInvalidDevice;
  return cudaMemsetAsync(p->counter, 0, sizeof(int32_t), stream);
}

// A persistent launch: one CTA per SM, `smem` bytes of dynamic shared memory (opted into first).
template <typename Params>
cudaError_t launch_persistent(void (*kernel)(Params), uint32_t smem, int threads, const Params& p,
                              cudaStream_t stream) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  kernel<<<detail::sm_count(), threads, smem, stream>>>(p);
  return cudaGetLastError();
}

// Head dim 256 (bwd_sm90_kernel_d256.cuh): 64-row KV tiles, dQ by TMA reduce-adds from the dead Q/dO
// stage (the same dq_accum tensor map as the D <= 128 kernel, 64-row boxes).
template <typename Element>
cudaError_t run_bwd_main_d256(const BwdArgs& args, cudaStream_t stream) {
  using C = Sm90BwdConfigD256;
  static_assert(plan_tiles(256).bwd_block_n == C::kBlockN, "sm90 backward d256: plan KV tiles must be kBlockN rows");
  static_assert(plan_tiles(256).bwd_block_m == C::kBlockM, "sm90 backward d256: plan splits are multiples of kBlockM");
  Sm90BwdParams<256> p;
  cudaError_t err = prepare_bwd_params<Element, 256, C::kBlockM, C::kBlockN>(args, &p, stream);
  if (err != cudaSuccess) return err;
  auto kernel = args.deterministic ? bwd_sm90_kernel_d256<Element, false> : bwd_sm90_kernel_d256<Element, true>;
  return launch_persistent(kernel, C::kSmemBytes, C::kThreads, p, stream);
}

template <typename Element, int HeadDim>
cudaError_t run_bwd_main(const BwdArgs& args, cudaStream_t stream) {
  if constexpr (HeadDim == 256) {
    return run_bwd_main_d256<Element>(args, stream);
  } else {
    using C = Sm90BwdConfig<HeadDim>;
    static_assert(plan_tiles(HeadDim).bwd_block_n == C::kBlockN, "sm90 backward: plan KV tiles must be kBlockN rows");
    static_assert(plan_tiles(HeadDim).bwd_block_m == C::kBlockM, "sm90 backward: plan splits are multiples of kBlockM");
    Sm90BwdParams<HeadDim> p;
    cudaError_t err = prepare_bwd_params<Element, HeadDim, C::kBlockM, C::kBlockN>(args, &p, stream);
    if (err != cudaSuccess) return err;
    if (args.deterministic)
      return launch_persistent(bwd_sm90_kernel<Element, HeadDim, false>, C::kSmemBytes, C::kThreads, p, stream);
    // The dQ-computing kernel has dQ staging buffers on top.
    return launch_persistent(bwd_sm90_kernel<Element, HeadDim, true>, Sm90BwdConfig<HeadDim, true>::kSmemBytes,
                             C::kThreads, p, stream);
  }
}

template <typename Element, int HeadDim>
cudaError_t run_bwd(const BwdArgs& args, cudaStream_t stream) {
  constexpr int D = HeadDim;
  using T = Element;
  if (!bwd_args_supported(args, HeadDim, 2)) return cudaErrorNotSupported;
  const int sms = detail::sm_count();
  if (sms <= 0) return cudaErrorInvalidDevice;
  cudaError_t err;
  if ((err = launch_bwd_prologue<D, T>(args, sms, stream)) != cudaSuccess) return err;
  if ((err = run_bwd_main<Element, HeadDim>(args, stream)) != cudaSuccess) return err;
  return launch_bwd_epilogue<D, T>(args, sms, stream);
}

}  // namespace dualkv::cuda::sm90
