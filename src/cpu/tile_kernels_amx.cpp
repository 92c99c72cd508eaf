// The tile kernels of tile_kernels.h for bfloat16 inputs on Intel AMX (Sapphire Rapids and later):
// every matrix product is a bf16 tile product with fp32 accumulation (TDPBF16PS, ~16x the fp32
// AVX-512 FMA rate); the softmax and every sum stay fp32 (AVX-512). As in the GPU kernels, scores
// and dP are fp32, P and dS enter their products rounded to bf16, dq/dk/dv accumulate in fp32.
//
// Compiled once, with the AVX-512 and AMX flags and its own name for Eigen's namespace
// (sources.cmake); tile_kernels(dtype) picks it for bfloat16 inputs only when the processor has
// AMX-BF16 and Linux lets the process use the tile registers (tile_kernels_select.cpp).
//
// The operands arrive as strided bf16 rows (q, k, v, dout of the caller's tensors) and, per
// (query tile, key block), go into the layouts the tile instructions read: an A operand
// row-major, rows padded to 16 and the inner dimension to 32 with zeros (q and dout rows are read
// in place when no padding is needed); a B operand in pairs along the inner dimension ("VNNI"),
// B[k][n] at b[(k / 2) * ld + 2 * n + k % 2], the inner dimension padded to 32 and the columns to
// 16 with zeros. Products land in an fp32 strip of 32 rows and are used from there while in L1.
#include <immintrin.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/tile_kernels.h"
#include "dualkv/dualkv.h"
#include "dualkv/mask.h"

namespace dualkv::detail::cpu {
namespace {

// Every tile is 16 rows of 64 bytes: an accumulator holds 16 x 16 fp32, an A tile 16 rows of 32
// bf16, a B tile 16 pairs of rows of 16 bf16 pairs. Tiles 0-3 accumulate, 4-5 hold A, 6-7 hold B.
constexpr int64_t kTileRows = 16;
constexpr int64_t kTileInner = 32;  // bf16 elements of the inner dimension per tile product
constexpr int64_t kTileCols = 16;   // fp32 columns of an accumulator

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

constexpr TileConfig make_config() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.bytes_per_row[t] = 64;
    c.rows[t] = kTileRows;
  }
  return c;
}
constexpr TileConfig kConfig = make_config();

// Holds the tile configuration for one kernel call. Loaded on entry because other code on the
// same thread (oneDNN under PyTorch, say) may configure the tiles between our calls; released on
// exit so the thread's tile state is back to its initial, cheap-to-switch form.
struct TileScope {
  TileScope() { _tile_loadconfig(&kConfig); }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The first n lanes of a 16- or 32-lane vector (none for n <= 0).
__mmask16 lanes16(int64_t n) { return n <= 0 ? 0 : n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1); }
__mmask32 lanes32(int64_t n) { return n <= 0 ? 0 : n >= 32 ? 0xffffffffu : (1u << n) - 1; }

// 2^y for y <= 0 (a little above is fine), to 2.2e-7 relative: y = n + f with n an integer and
// |f| <= 1/2, 2^f by a degree-5 polynomial (least-squares fit, relative weight), times 2^n by
// scalef. Below y = -125 (and for -inf) the result is 0, never a subnormal: scalef takes a
// microcode assist for a subnormal result (with -inf lanes reaching it the forward ran at 0.58x
// this speed). NaN stays NaN. Half the work of Eigen's exp; P is rounded to bf16 (2^-9) anyway.
__m512 exp2_nonpositive(__m512 y) {
  const __mmask16 normal = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ);
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.3266970636e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6754599362e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507425219e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022121727e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314694405e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192f));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

// exp(x - shift) for x <= shift (masked scores: -inf gives 0), from shift_log2e = -shift log2(e):
// one fma to the base-2 exponent.
constexpr float kLog2e = 1.4426950409f;
__m512 exp_shifted(__m512 x, __m512 shift_log2e) {
  return exp2_nonpositive(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), shift_log2e));
}

// y[j] = a x[j] (store only), or y[j] = b y[j] + x[j] (accumulate), for j < n: fp32 rows.
void scaled_copy(float* y, float a, const float* x, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes16(n - j);
    _mm512_mask_storeu_ps(y + j, m, _mm512_mul_ps(_mm512_set1_ps(a), _mm512_maskz_loadu_ps(m, x + j)));
  }
}
void scaled_add(float* y, float b, const float* x, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes16(n - j);
    _mm512_mask_storeu_ps(
        y + j, m, _mm512_fmadd_ps(_mm512_set1_ps(b), _mm512_maskz_loadu_ps(m, y + j), _mm512_maskz_loadu_ps(m, x + j)));
  }
}

// Transposes 16 rows of 16 32-bit lanes in place (lanes within 128-bit quarters, then quarters).
void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + c] holds column c of each quarter, of rows i..i+3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // output row 4q + c gathers quarter q of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i low01 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
    const __m512i low23 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee);
    const __m512i high01 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i high23 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
    t[c] = _mm512_shuffle_i32x4(low01, high01, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(low01, high01, 0xdd);
    t[8 + c] = _mm512_shuffle_i32x4(low23, high23, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(low23, high23, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// 16 32-bit lanes holding the pairs (a[j], b[j]), a in the low half: bf16 rows, or fp32 rows
// rounded to bf16 (nearest even, as everywhere here). Elements outside mask_a / mask_b are zero.
__m512i pair_lanes(const uint16_t* a, const uint16_t* b, __mmask16 mask_a, __mmask16 mask_b) {
  const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask_a, a));
  const __m512i hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask_b, b));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}
__m512i pair_lanes(const float* a, const float* b, __mmask16 mask_a, __mmask16 mask_b) {
  const __m256bh lo = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask_a, a));
  const __m256bh hi = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask_b, b));
  return _mm512_or_si512(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(lo)),
                         _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(hi)), 16));
}

// Packed operands of one product (in a thread's scratch; see the file comment for the layouts).
struct PackedA {
  const uint16_t* data;
  int64_t rows, inner, ld;  // multiples of 16 and 32; row stride ld
};
struct PackedB {
  const uint16_t* data;
  int64_t inner, cols;  // multiples of 32 and 16; a row of pairs holds 2 * cols elements
};

// A thread's packing and product buffers, grown as needed (Eigen arrays: 64-byte aligned, and no
// std:: template instantiated here that the linker could share with the other copies).
using Bf16Buffer = Eigen::Array<uint16_t, Eigen::Dynamic, 1>;
struct Scratch {
  Bf16Buffer a, b;
  Eigen::ArrayXf product, rescale;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

template <typename Array>
typename Array::Scalar* grown(Array& array, int64_t n) {
  if (array.size() < n) array.resize(n);
  return array.data();
}

const uint16_t* bf16_rows(ConstMatrix m) { return static_cast<const uint16_t*>(m.data); }

// A = m (bf16 rows: q in q k^T, dout in dO v^T): read in place when whole tiles cover m (rows a
// multiple of 16, columns of 32), else copied.
PackedA pack_a(ConstMatrix m, Bf16Buffer& buffer) {
  const int64_t rows = round_up(m.rows, kTileRows), inner = round_up(m.cols, kTileInner);
  if (rows == m.rows && inner == m.cols) return {bf16_rows(m), rows, inner, m.ld};
  uint16_t* out = grown(buffer, rows * inner);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < inner; c += kTileInner) {
      const bool row = i < m.rows;
      const uint16_t* in = bf16_rows(m) + (row ? i * m.ld + c : 0);
      const __m512i x = _mm512_maskz_loadu_epi16(row ? lanes32(m.cols - c) : 0, in);
      _mm512_store_si512(out + i * inner + c, x);
    }
  return {out, rows, inner, inner};
}

// A = bf16(m) for fp32 rows m (P, dS).
PackedA pack_a(Matrix m, Bf16Buffer& buffer) {
  const int64_t rows = round_up(m.rows, kTileRows), inner = round_up(m.cols, kTileInner);
  uint16_t* out = grown(buffer, rows * inner);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < inner; c += kTileInner) {
      const float* in = m.data + (i < m.rows ? i * m.ld + c : 0);
      const int64_t n = i < m.rows ? m.cols - c : 0;
      const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(lanes16(n - 16), in + 16),
                                             _mm512_maskz_loadu_ps(lanes16(n), in));
      _mm512_store_si512(out + i * inner + c, reinterpret_cast<const __m512i&>(x));
    }
  return {out, rows, inner, inner};
}

// A = bf16(m)^T for fp32 rows m (P^T, dS^T): row j of A holds the pairs (m[2i][j], m[2i + 1][j]),
// 16 pairs of rows by 16 columns transposed at a time.
PackedA pack_a_transposed(Matrix m, Bf16Buffer& buffer) {
  const int64_t rows = round_up(m.cols, kTileRows), inner = round_up(m.rows, kTileInner);
  uint16_t* out = grown(buffer, rows * inner);
  __m512i r[16];
  for (int64_t j = 0; j < rows; j += 16)
    for (int64_t i = 0; i < inner; i += kTileInner) {
      for (int64_t t = 0; t < 16; ++t) {
        const int64_t i0 = std::min(i + 2 * t, m.rows - 1), i1 = std::min(i + 2 * t + 1, m.rows - 1);
        r[t] = pair_lanes(m.data + i0 * m.ld + j, m.data + i1 * m.ld + j, i + 2 * t < m.rows ? lanes16(m.cols - j) : 0,
                          i + 2 * t + 1 < m.rows ? lanes16(m.cols - j) : 0);
      }
      transpose16(r);
      for (int64_t t = 0; t < 16; ++t) _mm512_store_si512(out + (j + t) * inner + i, r[t]);
    }
  return {out, rows, inner, inner};
}

// B = m, the inner dimension along m's rows (v in P v, k in dS k, dout in P^T dO, q in dS^T q):
// row r of B holds the pairs (m[2r][n], m[2r + 1][n]).
PackedB pack_b(ConstMatrix m, Bf16Buffer& buffer) {
  const int64_t inner = round_up(m.rows, kTileInner), cols = round_up(m.cols, kTileCols);
  uint16_t* out = grown(buffer, inner * cols);
  const uint16_t* in = bf16_rows(m);
  for (int64_t r = 0; r < inner; r += 2) {
    const int64_t r0 = std::min(r, m.rows - 1), r1 = std::min(r + 1, m.rows - 1);
    for (int64_t n = 0; n < cols; n += 16)
      _mm512_store_si512(out + r * cols + 2 * n,
                         pair_lanes(in + r0 * m.ld + n, in + r1 * m.ld + n, r < m.rows ? lanes16(m.cols - n) : 0,
                                    r + 1 < m.rows ? lanes16(m.cols - n) : 0));
  }
  return {out, inner, cols};
}

// B = m^T, the inner dimension along m's columns (k in q k^T, v in dO v^T): row r of B holds
// the pairs (m[n][2r], m[n][2r + 1]), 16 rows of m by 16 pairs transposed at a time.
PackedB pack_b_transposed(ConstMatrix m, Bf16Buffer& buffer) {
  const int64_t inner = round_up(m.cols, kTileInner), cols = round_up(m.rows, kTileCols);
  uint16_t* out = grown(buffer, inner * cols);
  const uint16_t* in = bf16_rows(m);
  __m512i r[16];
  for (int64_t n = 0; n < cols; n += 16)
    for (int64_t c = 0; c < inner; c += kTileInner) {
      for (int64_t t = 0; t < 16; ++t) {
        const bool row = n + t < m.rows;
        r[t] = _mm512_maskz_loadu_epi16(row ? lanes32(m.cols - c) : 0, in + (row ? (n + t) * m.ld + c : 0));
      }
      transpose16(r);
      for (int64_t t = 0; t < 16; ++t) _mm512_store_si512(out + (c / 2 + t) * 2 * cols + 2 * n, r[t]);
    }
  return {out, inner, cols};
}

// c[i][j] = sum_k a[i][k] b[k][j] over RowTiles x ColTiles accumulator tiles (1 or 2 each).
template <int RowTiles, int ColTiles>
void multiply_tiles(const uint16_t* a, int64_t a_stride, const uint16_t* b, int64_t b_stride, int64_t inner,
                    float* c, int64_t c_stride) {
  _tile_zero(0);
  if constexpr (ColTiles == 2) _tile_zero(1);
  if constexpr (RowTiles == 2) _tile_zero(2);
  if constexpr (RowTiles == 2 && ColTiles == 2) _tile_zero(3);
  for (int64_t k = 0; k < inner; k += kTileInner) {
    _tile_loadd(4, a + k, a_stride);
    _tile_loadd(6, b + k / 2 * (b_stride / 2), b_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (ColTiles == 2) {
      _tile_loadd(7, b + k / 2 * (b_stride / 2) + 2 * kTileCols, b_stride);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RowTiles == 2) {
      _tile_loadd(5, a + kTileRows * (a_stride / 2) + k, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (ColTiles == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, c_stride);
  if constexpr (ColTiles == 2) _tile_stored(1, c + kTileCols, c_stride);
  if constexpr (RowTiles == 2) _tile_stored(2, c + kTileRows * (c_stride / 4), c_stride);
  if constexpr (RowTiles == 2 && ColTiles == 2) _tile_stored(3, c + kTileRows * (c_stride / 4) + kTileCols, c_stride);
}

// The product a b in strips of 32 rows (2 x 2 accumulator tiles at a time): `use(i, rows, c)`
// gets rows [i, i + rows) of it, at most a's unpadded `rows`, as fp32 with row stride b.cols while
// they are in L1.
template <typename Use>
void multiply(PackedA a, PackedB b, int64_t rows, Eigen::ArrayXf& buffer, Use&& use) {
  constexpr int64_t kStrip = 2 * kTileRows;
  float* c = grown(buffer, kStrip * b.cols);
  const int64_t as = a.ld * 2, bs = b.cols * 4, cs = b.cols * 4;  // strides in bytes
  for (int64_t i = 0; i < rows; i += kStrip) {
    const bool two_rows = i + kTileRows < rows;
    for (int64_t j = 0; j < b.cols; j += 2 * kTileCols) {
      const uint16_t* at = a.data + i * a.ld;
      const uint16_t* bt = b.data + 2 * j;
      const bool two_cols = j + kTileCols < b.cols;
      if (two_rows && two_cols)
        multiply_tiles<2, 2>(at, as, bt, bs, a.inner, c + j, cs);
      else if (two_rows)
        multiply_tiles<2, 1>(at, as, bt, bs, a.inner, c + j, cs);
      else if (two_cols)
        multiply_tiles<1, 2>(at, as, bt, bs, a.inner, c + j, cs);
      else
        multiply_tiles<1, 1>(at, as, bt, bs, a.inner, c + j, cs);
    }
    use(i, std::min(kStrip, rows - i), static_cast<const float*>(c));
  }
}

// m[i + r] += c[r] for the rows of a product strip (fp32 accumulators: dq, dk, dv).
void add_strip(Matrix m, int64_t i, int64_t rows, const float* c, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) scaled_add(m.data + (i + r) * m.ld, 1.0f, c + r * ld, m.cols);
}

void scores(ConstMatrix q, ConstMatrix k, float scale, float softcap, Matrix s) {
  TileScope tiles;
  Scratch& w = scratch();
  const PackedB kt = pack_b_transposed(k, w.b);
  multiply(pack_a(q, w.a), kt, s.rows, w.product, [&](int64_t i, int64_t rows, const float* c) {
    for (int64_t r = 0; r < rows; ++r) {
      float* row = s.data + (i + r) * s.ld;
      scaled_copy(row, scale, c + r * kt.cols, s.cols);
      // The softcap (Gemma-2 only) in scalar tanh: AVX-512 has no tanh instruction.
      for (int64_t j = 0; softcap > 0 && j < s.cols; ++j) row[j] = dualkv::softcap_score(row[j], softcap);
    }
  });
}

// Lane r of the result = op over the 16 lanes of part[r] (16 row reductions in one transpose).
template <typename Op>
__m512 reduce_rows(__m512 part[16], Op op) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(part[i]);
  transpose16(r);
  __m512 out = _mm512_castsi512_ps(r[0]);
  for (int i = 1; i < 16; ++i) out = op(out, _mm512_castsi512_ps(r[i]));
  return out;
}

// 16 rows at a time: their block maxima, the factors exp(old max - new max) that rescale what the
// sums and acc held, then row by row p = exp(s - max) rounded to bf16 straight into the A operand
// of p v and the row sums of p in fp32 (s itself is left as it is).
void softmax_accumulate(Matrix s, ConstMatrix v, float* row_max, float* row_sum, Matrix acc) {
  Scratch& w = scratch();
  const int64_t rows = round_up(s.rows, kTileRows), inner = round_up(s.cols, kTileInner);
  uint16_t* p = grown(w.a, rows * inner);
  float* rescale = grown(w.rescale, rows);
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  const auto max = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  const auto add = [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); };
  __m512 part[16];
  for (int64_t i = 0; i < s.rows; i += 16) {
    const int64_t n = std::min<int64_t>(16, s.rows - i);
    const __mmask16 m = lanes16(n);
    for (int64_t r = 0; r < 16; ++r) {
      part[r] = minus_inf;
      const float* row = s.data + (i + r) * s.ld;
      for (int64_t c = 0; r < n && c < s.cols; c += 16)
        part[r] = _mm512_max_ps(part[r], _mm512_mask_loadu_ps(minus_inf, lanes16(s.cols - c), row + c));
    }
    const __m512 old_max = _mm512_mask_loadu_ps(minus_inf, m, row_max + i);
    const __m512 new_max = _mm512_max_ps(old_max, reduce_rows(part, max));
    // A row that has seen only masked keys so far keeps max -inf: subtract 0 instead, so its
    // exp(-inf) stays 0 rather than exp(-inf + inf) = NaN.
    const __m512 shift = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(new_max, minus_inf, _CMP_EQ_OQ), new_max,
                                              _mm512_setzero_ps());
    const __m512 shift_log2e = _mm512_mul_ps(shift, _mm512_set1_ps(-kLog2e));
    const __m512 factor = exp_shifted(old_max, shift_log2e);  // 0 on the first visible block
    _mm512_mask_storeu_ps(row_max + i, m, new_max);
    _mm512_mask_storeu_ps(rescale + i, m, factor);
    alignas(64) float shifts[16];
    _mm512_store_ps(shifts, shift_log2e);
    for (int64_t r = 0; r < 16; ++r) {
      part[r] = _mm512_setzero_ps();
      const float* row = s.data + (i + r) * s.ld;
      const __m512 row_shift = _mm512_set1_ps(shifts[r]);
      for (int64_t c = 0; r < n && c < inner; c += kTileInner) {  // masked and padding lanes load -inf: p = 0
        const __m512 lo = exp_shifted(_mm512_mask_loadu_ps(minus_inf, lanes16(s.cols - c), row + c), row_shift);
        const __m512 hi =
            exp_shifted(_mm512_mask_loadu_ps(minus_inf, lanes16(s.cols - c - 16), row + c + 16), row_shift);
        part[r] = _mm512_add_ps(part[r], _mm512_add_ps(lo, hi));
        const __m512bh pair = _mm512_cvtne2ps_pbh(hi, lo);
        _mm512_store_si512(p + (i + r) * inner + c, reinterpret_cast<const __m512i&>(pair));
      }
    }
    _mm512_mask_storeu_ps(row_sum + i, m,
                          _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, row_sum + i), factor, reduce_rows(part, add)));
  }
  std::memset(p + s.rows * inner, 0, static_cast<size_t>((rows - s.rows) * inner) * 2);
  TileScope tiles;
  const PackedB vb = pack_b(v, w.b);
  multiply(PackedA{p, rows, inner, inner}, vb, s.rows, w.product, [&](int64_t i, int64_t n, const float* c) {
    for (int64_t r = 0; r < n; ++r) scaled_add(acc.data + (i + r) * acc.ld, rescale[i + r], c + r * vb.cols, acc.cols);
  });
}

// With a softcap, cap_grad (the scratch) keeps each score's cap derivative max(0, 1 - (s / c)^2) (softcap_grad; 0,
// not -inf, where the mask left -inf) before p overwrites the scores; dS takes it as a factor.
void backward_block(Matrix s, const float* lse, const float* delta, float softcap, ConstMatrix q, ConstMatrix k,
                    ConstMatrix v, ConstMatrix dout, Matrix cap_grad, Matrix dq, Matrix dk, Matrix dv) {
  const bool capped = softcap > 0;
  const __m512 inv_cap = _mm512_set1_ps(capped ? 1.0f / softcap : 0.0f), one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < s.rows; ++i) {
    float* row = s.data + i * s.ld;
    float* grad = cap_grad.data + i * cap_grad.ld;
    for (int64_t c = 0; capped && c < s.cols; c += 16) {
      const __mmask16 m = lanes16(s.cols - c);
      const __m512 t = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + c), inv_cap);
      _mm512_mask_storeu_ps(grad + c, m, _mm512_max_ps(_mm512_fnmadd_ps(t, t, one), _mm512_setzero_ps()));
    }
    const __m512 shift = _mm512_set1_ps(-lse[i] * kLog2e);
    for (int64_t c = 0; c < s.cols; c += 16) {
      const __mmask16 m = lanes16(s.cols - c);
      _mm512_mask_storeu_ps(row + c, m, exp_shifted(_mm512_maskz_loadu_ps(m, row + c), shift));
    }
  }
  TileScope tiles;
  Scratch& w = scratch();
  // dv += p^T dO
  PackedB b = pack_b(dout, w.b);
  multiply(pack_a_transposed(s, w.a), b, s.cols, w.product,
           [&](int64_t i, int64_t n, const float* c) { add_strip(dv, i, n, c, b.cols); });
  // dP = dO v^T, and p becomes dS = p (dP - delta) strip by strip
  b = pack_b_transposed(v, w.b);
  multiply(pack_a(dout, w.a), b, s.rows, w.product, [&](int64_t i, int64_t n, const float* dp) {
    for (int64_t r = 0; r < n; ++r) {
      float* row = s.data + (i + r) * s.ld;
      for (int64_t c = 0; c < s.cols; c += 16) {
        const __mmask16 m = lanes16(s.cols - c);
        __m512 ds = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, dp + r * b.cols + c), _mm512_set1_ps(delta[i + r]));
        if (capped) ds = _mm512_mul_ps(ds, _mm512_maskz_loadu_ps(m, cap_grad.data + (i + r) * cap_grad.ld + c));
        _mm512_mask_storeu_ps(row + c, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + c), ds));
      }
    }
  });
  // dq += dS k, dk += dS^T q
  b = pack_b(k, w.b);
  multiply(pack_a(s, w.a), b, s.rows, w.product,
           [&](int64_t i, int64_t n, const float* c) { add_strip(dq, i, n, c, b.cols); });
  b = pack_b(q, w.b);
  multiply(pack_a_transposed(s, w.a), b, s.cols, w.product,
           [&](int64_t i, int64_t n, const float* c) { add_strip(dk, i, n, c, b.cols); });
}

const TileKernels kKernels = {"amx", DUALKV_DTYPE_BFLOAT16, scores, softmax_accumulate, backward_block};

}  // namespace

const TileKernels* tile_kernels_amx() { return &kKernels; }

}  // namespace dualkv::detail::cpu
