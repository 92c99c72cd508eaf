// The arithmetic of the blocked CPU attention on one (query tile, key block): the matrix products
// and the softmax. tile_kernels.cpp (fp32 products, Eigen) is compiled once per instruction set
// and tile_kernels_amx.cpp (bfloat16 products on AMX tiles) once (sources.cmake);
// `tile_kernels(dtype)` picks the best set the processor runs, so nothing here depends on an ISA
// extension for correctness.
//
// Only plain structs and function pointers cross between those translation units: no inline
// function or template is shared with them (each copy is compiled with other instruction-set
// flags, and the linker keeps only one copy of a shared inline function).
#ifndef DUALKV_SRC_CPU_TILE_KERNELS_H_
#define DUALKV_SRC_CPU_TILE_KERNELS_H_

#include <cstdint>

namespace dualkv::detail::cpu {

// Row-major matrices: element (i, j) at data[i * ld + j]. A Matrix holds fp32 (scores and
// accumulators); a ConstMatrix holds input rows (q, k, v, dout) of the kernel set's operand dtype.
struct Matrix {
  float* data;
  int64_t rows, cols, ld;
};
struct ConstMatrix {
  const void* data;
  int64_t rows, cols, ld;
};

struct TileKernels {
  const char* isa;        // "amx", "avx512", "avx2" or "generic"
  int32_t operand_dtype;  // of the ConstMatrix operands: DUALKV_DTYPE_FLOAT32, or _BFLOAT16 for amx

  // s = scale * q k^T for q [rows, D] and k [cols, D], then with softcap > 0 the logit softcap
  // s = softcap * tanh(s / softcap) (include/dualkv/mask.h's softcap_score, vectorised).
  void (*scores)(ConstMatrix q, ConstMatrix k, float scale, float softcap, Matrix s);

  // Forward, one more key block of a query tile (online softmax): takes the block's masked scores
  // s [rows, cols] (-inf where invisible; may be overwritten), updates the running row max and
  // row sum (of exp(score - max)) and acc [rows, D] += p v, rescaling what acc and the sum held
  // before.
  void (*softmax_accumulate)(Matrix s, ConstMatrix v, float* row_max, float* row_sum, Matrix acc);

  // Backward, one (query tile, key block): s holds the masked scores (overwritten), lse and delta
  // the tile's rows (delta = rowsum(dO * O) - dlse). With p = exp(s - lse) and
  // ds = p * (dO v^T - delta):  dv += p^T dO,  dq += ds k,  dk += ds^T q  (dq, dk without the
  // softmax scale, which the caller applies once). With softcap > 0, s holds capped scores and ds
  // takes the cap's derivative (softcap_grad). scratch is [rows, cols] (the amx set needs none).
  void (*backward_block)(Matrix s, const float* lse, const float* delta, float softcap, ConstMatrix q,
                         ConstMatrix k, ConstMatrix v, ConstMatrix dout, Matrix scratch, Matrix dq, Matrix dk,
                         Matrix dv);
};

// The kernels for inputs of `dtype` (a DUALKV_DTYPE_*) on this processor: the widest instruction
// set it runs among those built (amx only for bfloat16: it is avx512 plus AMX tile products), at
// most the one DUALKV_CPU_ISA names (amx, avx512, avx2, generic; for tests and benchmarks).
// Chosen once per process.
const TileKernels& tile_kernels(int32_t dtype);

// One per instruction set built (tile_kernels.cpp, tile_kernels_amx.cpp); null where that set is
// not built.
const TileKernels* tile_kernels_generic();
const TileKernels* tile_kernels_avx2();
const TileKernels* tile_kernels_avx512();
const TileKernels* tile_kernels_amx();

}  // namespace dualkv::detail::cpu

#endif  // DUALKV_SRC_CPU_TILE_KERNELS_H_
