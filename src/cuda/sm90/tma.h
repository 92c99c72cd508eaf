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

// Tensor map over a [T, heads, D] token-major 16-bit tensor: box = 64 columns x 1 head x `rows`
// tokens, 128-byte swizzle, zero fill past T.
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

// The smem row of row i of a dQ staging box (64 rows x 32 fp32 columns, 128-byte rows, 128B swizzle):
// row bit 2 moves to bit 0, bits 0-1 to bits 1-2, bits 3-5 stay. Why: a 64-bit store is served per
// half-warp, whose 16 lanes hold rows r % 8 = g (g 0..3, or 4..7) at column chunks 2j + t4 / 2 (j the
// same for all). With rows in place the swizzle (chunk XOR row % 8) gave the lanes four chunks: a
// two-way bank conflict on every staging store (ncu, H100, D 128 N8 P16K R2K: 33 conflicted wavefronts
// per warp and step against FA4's 1.4). In this order the phase is 2 (g & 3) + (g >> 2): the four row
// groups move chunk bits 1-2 and t4 / 2 bit 0, so a half-warp's stores cover 8 chunks x 2 word pairs.
// Session 41's cure without moving rows (lanes t4 >= 2 storing another column block through selects)
// cost four selects per store pair (1.025 of the D-256 kernel's time). bwd_stage_dq_fragment stores by
// it; make_dq_accum_map's dims read by it.
__host__ __device__ constexpr int dq_stage_row(int i) { return ((i >> 2) & 1) | ((i & 3) << 1) | (i & ~7); }

// Tensor map over the fp32 dQ accumulator [T + kDqAccumPadRows, heads, D] (contiguous), used only to
// reduce-add the backward's dQ staging boxes into it: a box is 32 columns (128 B) of one head x 64
// rows, 128-byte swizzle, its row i at smem row dq_stage_row(i). Four dims, innermost first: columns
// (heads x D: a box of head h starts at column h D + 32 b), row bit 2 (2, stride 4 rows), rows (stride
// 1 row, box 4: the box's first row is this coordinate), row bits 3-5 (8, stride 8 rows); smem row
// x1 + 2 x2 + 8 x3 holds global row (first + x2) + 4 x1 + 8 x3. TMA bounds each dim by itself, so rows
// up to 60 past T are reached: the accumulator's padding (kernel_params.h), where the staged zeros of
// rows past the item's end are added.
inline bool make_dq_accum_map(CUtensorMap* map, float* base, int D, int heads, int T) {
  EncodeTiledFn fn = encode_fn();
  if (fn == nullptr) return false;
  const cuuint64_t row = static_cast<cuuint64_t>(heads) * D * 4;
  cuuint64_t dims[4] = {static_cast<cuuint64_t>(heads) * D, 2, static_cast<cuuint64_t>(T), 8};
  cuuint64_t strides[3] = {4 * row, row, 8 * row};
  cuuint32_t box[4] = {32, 2, 4, 8};
  cuuint32_t estr[4] = {1, 1, 1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace dualkv::cuda::sm90
