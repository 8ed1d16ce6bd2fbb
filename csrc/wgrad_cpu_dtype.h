// Element conversions of the CPU core: bf16/fp16 <-> fp32 (round to nearest even,
// NaN preserved), one element loaded or stored as fp32 whatever its dtype, and
// beta applied to an accumulator.  Inline: the CPU core calls them per element
// in its loops (bias sums, the widening fallback, rounding a product once).
#pragma once

#include <cstdint>
#include <cstring>

#include "wgrad_core.h"

namespace pmg {

namespace cpu {
inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace cpu

inline float bf16_to_f32(uint16_t v) {
  return cpu::float_of(static_cast<uint32_t>(v) << 16);
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = cpu::bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      u = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  return cpu::float_of(u);
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t u = cpu::bits_of(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // overflow (incl. inf) -> inf
  if (a < 0x38800000u) {                        // result is subnormal or zero
    if (a < 0x33000000u) return sign;           // < half the smallest subnormal
    uint32_t man = (a & 0x7fffffu) | 0x800000u;
    int shift = 126 - static_cast<int>(a >> 23);  // 14..24
    uint32_t half = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);  // rebias 127 -> 15, round
  return sign | static_cast<uint16_t>(r >> 13);
}

namespace cpu {

inline float load(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::kF64: return static_cast<float>(static_cast<const double*>(p)[i]);
  }
  return 0.f;
}

inline void store(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(p)[i] = v; break;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
    case DType::kF16: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); break;
    case DType::kF64: static_cast<double*>(p)[i] = v; break;
  }
}

// c[0:n] *= beta (beta 0: zeros, whatever c held, NaN included; beta 1: untouched).
template <typename T>
inline void scale_or_zero(T* c, int64_t n, float beta) {
  if (beta == 1.f) return;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) c[i] = beta == 0.f ? T(0) : static_cast<T>(beta) * c[i];
}

}  // namespace cpu
}  // namespace pmg
