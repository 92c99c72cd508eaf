// Host side of the Hopper kernels' TMA: tensor maps (descriptors) of the operands.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace dualkv::cuda::sm90 {

template <typename T> constexpr CUtensorMapDataType kTmaType = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
template <> constexpr CUtensorMapDataType kTmaType<__half> = CU_TENSOR_MAP_DATA_TYPE_FLOAT16;

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

// Tensor map over a [T, heads, D] token-major 16-bit tensor: box = 64 columns x `box_heads` heads x
// `rows` tokens (smem row t * box_heads + j: token t, head j of the box; the forward's packed query
// heads, Sm90FwdParams::pack_shift), 128-byte swizzle, zero fill past T.
inline bool make_map(CUtensorMap* map, CUtensorMapDataType dt, const void* base, int D, int heads, int T,
                     int64_t hs, int64_t ts, int rows, int box_heads = 1) {
  EncodeTiledFn fn = encode_fn();
  if (fn == nullptr) return false;
  const int64_t hs_bytes = heads > 1 ? hs * 2 : static_cast<int64_t>(D) * 2;
  cuuint64_t dims[3] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(T)};
  cuuint64_t strides[2] = {static_cast<cuuint64_t>(hs_bytes), static_cast<cuuint64_t>(ts * 2)};
  cuuint32_t box[3] = {64, static_cast<cuuint32_t>(box_heads), static_cast<cuuint32_t>(rows)};
  cuuint32_t estr[3] = {1, 1, 1};
  return fn(map, dt, 3, const_cast<void*>(base), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Tensor map over the fp32 dQ accumulator [T, heads, D] (contiguous), used only to reduce-add the
// backward's dQ staging boxes into it. Four dims, innermost first, the accumulator's own packed layout
// with D cut in 32-column blocks: columns within a block (32), the block (D / 32, stride 128 B), head,
// token. A box is 32 columns x 2 blocks x 1 head x 32 tokens (8 KiB), 128-byte swizzle: its smem row
// p = 2 r + b holds row r's columns 32 b .. 32 b + 31 of the box's 64, so the swizzle phase p % 8 of
// a half-warp's row groups (rows r % 4 = g % 4) moves chunk bits 1-2 while the lanes' t4 / 2 moves bit
// 0: the staging stores are bank-conflict free (bwd_stage_dq_fragment). TMA skips the box's rows past T.
inline bool make_dq_accum_map(CUtensorMap* map, float* base, int D, int heads, int T) {
  EncodeTiledFn fn = encode_fn();
  if (fn == nullptr) return false;
  cuuint64_t dims[4] = {32, static_cast<cuuint64_t>(D / 32), static_cast<cuuint64_t>(heads),
                        static_cast<cuuint64_t>(T)};
  cuuint64_t strides[3] = {128, static_cast<cuuint64_t>(D) * 4, static_cast<cuuint64_t>(heads) * D * 4};
  cuuint32_t box[4] = {32, 2, 1, 32};
  cuuint32_t estr[4] = {1, 1, 1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace dualkv::cuda::sm90
