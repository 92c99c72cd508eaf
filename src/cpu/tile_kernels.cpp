// The Eigen arithmetic of tile_kernels.h, compiled once per instruction set: sources.cmake
// defines DUALKV_CPU_ISA (generic, avx2, avx512) with the matching compiler flags, and renames
// Eigen's namespace per copy (-DEigen=...) so that the copies' Eigen instantiations are distinct
// symbols and the linker cannot mix them up.
#include <Eigen/Core>
#include <cmath>

#include "cpu/tile_kernels.h"
#include "dualkv/dualkv.h"

#ifndef DUALKV_CPU_ISA
#error "DUALKV_CPU_ISA must name the instruction set this copy is compiled for"
#endif
#define DUALKV_STR2(x) #x
#define DUALKV_STR(x) DUALKV_STR2(x)
#define DUALKV_CAT2(a, b) a##b
#define DUALKV_CAT(a, b) DUALKV_CAT2(a, b)

namespace dualkv::detail::cpu {
namespace {

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Stride = Eigen::OuterStride<>;
using Map = Eigen::Map<RowMajor, 0, Stride>;
using ConstMap = Eigen::Map<const RowMajor, 0, Stride>;
using Vector = Eigen::Map<Eigen::VectorXf>;

Map map(Matrix m) { return Map(m.data, m.rows, m.cols, Stride(m.ld)); }
ConstMap map(ConstMatrix m) { return ConstMap(static_cast<const float*>(m.data), m.rows, m.cols, Stride(m.ld)); }

void scores(ConstMatrix q, ConstMatrix k, float scale, float softcap, Matrix s) {
  map(s).noalias() = scale * (map(q) * map(k).transpose());
  if (softcap > 0) {
    Map capped = map(s);
    for (Eigen::Index i = 0; i < capped.rows(); ++i)
      capped.row(i) = softcap * (capped.row(i).array() * (1.0f / softcap)).tanh();
  }
}

void softmax_accumulate(Matrix s_, ConstMatrix v, float* row_max, float* row_sum, Matrix acc_) {
  Map s = map(s_), acc = map(acc_);
  Vector max(row_max, s.rows()), sum(row_sum, s.rows());
  const Eigen::VectorXf block_max = s.rowwise().maxCoeff();
  for (Eigen::Index i = 0; i < s.rows(); ++i) {
    const float m = std::max(max[i], block_max[i]);
    // A row that has seen only masked keys so far keeps max -inf: subtract 0 instead, so its
    // exp(-inf) stays 0 rather than exp(-inf + inf) = NaN.
    const float shift = m == -INFINITY ? 0.0f : m;
    const float rescale = std::exp(max[i] - shift);  // 0 on the first visible block
    s.row(i) = (s.row(i).array() - shift).exp();
    sum[i] = sum[i] * rescale + s.row(i).sum();
    acc.row(i) *= rescale;
    max[i] = m;
  }
  acc.noalias() += s * map(v);
}

void backward_block(Matrix s_, const float* lse, const float* delta, float softcap, ConstMatrix q, ConstMatrix k,
                    ConstMatrix v, ConstMatrix dout, Matrix scratch, Matrix dq, Matrix dk, Matrix dv) {
  // Row by row: a row of a row-major map is contiguous, so each expression is vectorised (Eigen
  // does not vectorise the column-broadcast form p.colwise() - lse over a row-major map and falls
  // back to scalar expf). dp is formed first: with a softcap, its derivative needs the scores
  // before p overwrites them.
  Map p = map(s_), dp = map(scratch);
  dp.noalias() = map(dout) * map(v).transpose();
  if (softcap > 0) {
    // dp - delta times softcap_grad = 1 - (s / c)^2, which is in [0, 1] for a capped score;
    // max(0, .) makes it 0 (not -inf) where the mask left -inf, so that ds = p * dp stays 0
    // there instead of 0 * inf = NaN.
    for (Eigen::Index i = 0; i < p.rows(); ++i)
      dp.row(i) = (dp.row(i).array() - delta[i]) * (1.0f - (p.row(i).array() * (1.0f / softcap)).square()).max(0.0f);
  }
  for (Eigen::Index i = 0; i < p.rows(); ++i) p.row(i) = (p.row(i).array() - lse[i]).exp();
  map(dv).noalias() += p.transpose() * map(dout);
  for (Eigen::Index i = 0; i < p.rows(); ++i)  // p becomes ds (with a softcap, dp holds dp - delta already)
    p.row(i) = p.row(i).array() * (dp.row(i).array() - (softcap > 0 ? 0.0f : delta[i]));
  map(dq).noalias() += p * map(k);
  map(dk).noalias() += p.transpose() * map(q);
}

const TileKernels kKernels = {DUALKV_STR(DUALKV_CPU_ISA), DUALKV_DTYPE_FLOAT32, scores, softmax_accumulate,
                              backward_block};

}  // namespace

const TileKernels* DUALKV_CAT(tile_kernels_, DUALKV_CPU_ISA)() { return &kKernels; }

}  // namespace dualkv::detail::cpu
