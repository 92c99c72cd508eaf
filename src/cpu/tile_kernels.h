// The arithmetic of the blocked CPU attention on one (query tile, key block): fp32 matrix
// products and the softmax, vectorised by Eigen. tile_kernels.cpp is compiled once per
// instruction set (sources.cmake) and `tile_kernels()` picks the best one the processor runs, so
// nothing here depends on an ISA extension for correctness.
//
// Only plain structs and function pointers cross between those translation units: no inline
// function or template is shared with them (each copy is compiled with other instruction-set
// flags, and the linker keeps only one copy of a shared inline function).
#ifndef DUALKV_SRC_CPU_TILE_KERNELS_H_
#define DUALKV_SRC_CPU_TILE_KERNELS_H_

#include <cstdint>

namespace dualkv::detail::cpu {

// Row-major fp32 matrices: element (i, j) at data[i * ld + j].
struct Matrix {
  float* data;
  int64_t rows, cols, ld;
};
struct ConstMatrix {
  const float* data;
  int64_t rows, cols, ld;
};

struct TileKernels {
  const char* isa;  // "avx512", "avx2" or "generic"

  // s = scale * q k^T for q [rows, D] and k [cols, D], then with softcap > 0 the logit softcap
  // s = softcap * tanh(s / softcap) (include/dualkv/mask.h's softcap_score, vectorised).
  void (*scores)(ConstMatrix q, ConstMatrix k, float scale, float softcap, Matrix s);

  // Forward, one more key block of a query tile (online softmax): takes the block's masked scores
  // s [rows, cols] (-inf where invisible; overwritten with probabilities), updates the running
  // row max and row sum (of exp(score - max)) and acc [rows, D] += p v, rescaling what acc and
  // the sum held before.
  void (*softmax_accumulate)(Matrix s, ConstMatrix v, float* row_max, float* row_sum, Matrix acc);

  // Backward, one (query tile, key block): s holds the masked scores (overwritten), lse and delta
  // the tile's rows (delta = rowsum(dO * O) - dlse). With p = exp(s - lse) and
  // ds = p * (dO v^T - delta):  dv += p^T dO,  dq += ds k,  dk += ds^T q  (dq, dk without the
  // softmax scale, which the caller applies once). With softcap > 0, s holds capped scores and ds
  // takes the cap's derivative (softcap_grad). scratch is [rows, cols].
  void (*backward_block)(Matrix s, const float* lse, const float* delta, float softcap, ConstMatrix q,
                         ConstMatrix k, ConstMatrix v, ConstMatrix dout, Matrix scratch, Matrix dq, Matrix dk,
                         Matrix dv);
};

// The kernels for this processor: the widest instruction set it supports among those built, or
// the one DUALKV_CPU_ISA names (avx512, avx2, generic; for tests and benchmarks). Chosen once.
const TileKernels& tile_kernels();

// One per instruction set built (tile_kernels.cpp); null where that set is not built.
const TileKernels* tile_kernels_generic();
const TileKernels* tile_kernels_avx2();
const TileKernels* tile_kernels_avx512();

}  // namespace dualkv::detail::cpu

#endif  // DUALKV_SRC_CPU_TILE_KERNELS_H_
