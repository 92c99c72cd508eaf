// Element loads and stores of the CPU backend: every supported dtype to and from float/double.
// The 16-bit conversions round to nearest even and are bit-exact with the hardware formats.
#ifndef DUALKV_SRC_CPU_CONVERT_H_
#define DUALKV_SRC_CPU_CONVERT_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dualkv/dualkv.h"

namespace dualkv::detail::cpu {

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays a (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {
    const float f = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal
    return sign ? -f : f;
  }
  const uint32_t bits = exp == 31 ? (sign | 0x7f800000u | (mant << 13))
                                  : (sign | ((exp + 112u) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return sign | (a > 0x7f800000u ? 0x7e00 : 0x7c00);  // NaN / inf
  if (a >= 0x477ff000u) return sign | 0x7c00;                              // rounds past 65504
  if (a < 0x38800000u) {  // below 2^-14: zero or a subnormal half, value = round(|f| * 2^24)
    return sign | static_cast<uint16_t>(std::nearbyint(std::fabs(f) * 16777216.0f));
  }
  const uint32_t mant = a & 0x7fffffu;
  uint32_t h = ((((a >> 23) - 112u)) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return sign | static_cast<uint16_t>(h);
}

template <typename Acc>
Acc load_element(const void* base, int64_t index, int32_t dtype) {
  switch (dtype) {
    case DUALKV_DTYPE_FLOAT32: return static_cast<Acc>(static_cast<const float*>(base)[index]);
    case DUALKV_DTYPE_FLOAT64: return static_cast<Acc>(static_cast<const double*>(base)[index]);
    case DUALKV_DTYPE_BFLOAT16: return static_cast<Acc>(bf16_to_float(static_cast<const uint16_t*>(base)[index]));
    default: return static_cast<Acc>(fp16_to_float(static_cast<const uint16_t*>(base)[index]));
  }
}

template <typename Acc>
void store_element(void* base, int64_t index, int32_t dtype, Acc value) {
  switch (dtype) {
    case DUALKV_DTYPE_FLOAT32: static_cast<float*>(base)[index] = static_cast<float>(value); break;
    case DUALKV_DTYPE_FLOAT64: static_cast<double*>(base)[index] = static_cast<double>(value); break;
    case DUALKV_DTYPE_BFLOAT16: static_cast<uint16_t*>(base)[index] = float_to_bf16(static_cast<float>(value)); break;
    default: static_cast<uint16_t*>(base)[index] = float_to_fp16(static_cast<float>(value)); break;
  }
}

// lse is float64 for float64 inputs and float32 otherwise.
inline int32_t lse_dtype(int32_t dtype) {
  return dtype == DUALKV_DTYPE_FLOAT64 ? DUALKV_DTYPE_FLOAT64 : DUALKV_DTYPE_FLOAT32;
}

}  // namespace dualkv::detail::cpu

#endif  // DUALKV_SRC_CPU_CONVERT_H_
