// Host side of the sm90 forward: TMA descriptors, shared-memory opt-in, persistent launch.
// Included by the per-(head dim, dtype) translation units only.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>

#include "sm90/fwd_sm90.h"
#include "sm90/fwd_sm90_kernel.cuh"

namespace dualkv::cuda::sm90 {

namespace detail {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda).
inline EncodeTiledFn encode_fn() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      ptr = nullptr;
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

// Tensor map over a [T, heads, D] token-major tensor: box = 64 columns x 1 head x `rows` tokens,
// 128-byte swizzle, zero fill past T.
inline bool make_map(CUtensorMap* map, CUtensorMapDataType dt, const void* base, int D, int heads, int T,
                     int64_t hs, int64_t ts, int rows) {
  EncodeTiledFn fn = encode_fn();
  if (fn == nullptr) return false;
  const int64_t hs_bytes = heads > 1 ? hs * 2 : static_cast<int64_t>(D) * 2;
  cuuint64_t dims[3] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(T)};
  cuuint64_t strides[2] = {static_cast<cuuint64_t>(hs_bytes), static_cast<cuuint64_t>(ts * 2)};
  cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(rows)};
  cuuint32_t estr[3] = {1, 1, 1};
  return fn(map, dt, 3, const_cast<void*>(base), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

inline int sm_count() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  static std::mutex mu;
  static int cache[64] = {0};
  std::lock_guard<std::mutex> lock(mu);
  if (dev >= 0 && dev < 64 && cache[dev] > 0) return cache[dev];
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 0;
  if (dev >= 0 && dev < 64) cache[dev] = n;
  return n;
}

}  // namespace detail


template <typename Element, int HeadDim>
cudaError_t run_fwd(const FwdArgs& args, cudaStream_t stream) {
  using C = Sm90FwdConfig<HeadDim>;
  // The plan's forward items are query tiles of plan_tiles(head_dim).fwd_block_m rows; the kernel
  // holds one such tile per CTA.
  static_assert(plan_tiles(HeadDim).fwd_block_m == C::kBlockM, "sm90 forward: plan query tiles must be kBlockM rows");
  constexpr CUtensorMapDataType dt = Pack2<Element>::kTmaType;
  const int T = args.layout.num_tokens;
  const int H = args.num_heads, Hk = args.num_kv_heads;
  if (!fwd_args_supported(args, HeadDim, 2)) return cudaErrorNotSupported;
  Sm90FwdParams<HeadDim> p;
  p.a = args;
  p.tile_window = kTileWindow;
  if (!detail::make_map(&p.tq, dt, args.q, HeadDim, H, T, args.q_hs, args.q_ts, C::kBlockM) ||
      !detail::make_map(&p.tk, dt, args.k, HeadDim, Hk, T, args.k_hs, args.k_ts, C::kBlockN) ||
      !detail::make_map(&p.tv, dt, args.v, HeadDim, Hk, T, args.v_hs, args.v_ts, C::kBlockN))
    return cudaErrorNotSupported;
  auto kernel = fwd_sm90_kernel<Element, HeadDim>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(C::kSmemBytes));
  if (err != cudaSuccess) return err;
  const int sms = detail::sm_count();
  if (sms <= 0) return cudaErrorInvalidDevice;
  if ((err = cudaMemsetAsync(args.counter, 0, sizeof(int32_t), stream)) != cudaSuccess) return err;
  kernel<<<sms, C::kThreads, C::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}


}  // namespace dualkv::cuda::sm90
