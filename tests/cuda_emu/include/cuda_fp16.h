// Host stand-in for CUDA's cuda_fp16.h, for running kernels/*.cu on the CPU (tests/cuda_emu).
// Storage and conversions only (IEEE binary16, round to nearest even, subnormals, inf, NaN);
// no half arithmetic operators: kernels that compute in half would fail to compile here, loudly.
#pragma once
#include "cuda_emu_types.h"

struct __half_raw { unsigned short x; };

struct __half {
  unsigned short __x;
  __half() = default;
  constexpr __half(__half_raw r) : __x(r.x) {}
  __half(float f);
  operator float() const;
};
struct __half2 {
  __half x, y;
  __half2() = default;
  constexpr __half2(__half a, __half b) : x(a), y(b) {}
};
typedef __half half;
typedef __half2 half2;
static_assert(sizeof(__half) == 2 && sizeof(__half2) == 4, "fp16 storage");

namespace emu {
inline unsigned short float_to_half_rn(float f) {
  unsigned int x = bits_of(f);
  const unsigned int sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return (unsigned short)(sign | 0x7e00u | ((x >> 13) & 0x3ffu));  // NaN stays NaN
  if (x >= 0x47800000u) return (unsigned short)(sign | 0x7c00u);                       // >= 2^16: inf
  if (x < 0x38800000u) {                                                               // half subnormal
    if (x < 0x33000000u) return (unsigned short)sign;                                  // <= 2^-25: 0
    const unsigned int e = x >> 23;
    const unsigned int m = (x & 0x7fffffu) | 0x800000u;
    const unsigned int shift = 126u - e;                                               // 14 .. 24
    unsigned int h = m >> shift;
    const unsigned int rem = m & ((1u << shift) - 1u);
    const unsigned int halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
    return (unsigned short)(sign | h);
  }
  unsigned int h = (x >> 13) - (112u << 10);
  const unsigned int rem = x & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;                              // may carry to inf
  return (unsigned short)(sign | h);
}
inline float half_to_float(unsigned short h) {
  const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
  const unsigned int e = (h >> 10) & 0x1fu;
  const unsigned int m = h & 0x3ffu;
  if (e == 0) {
    const float v = (float)m * 5.9604644775390625e-08f;  // m * 2^-24, exact
    return sign ? -v : v;
  }
  if (e == 31) return float_of(sign | 0x7f800000u | (m << 13));
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
}
}  // namespace emu

inline __half::__half(float f) : __x(emu::float_to_half_rn(f)) {}
inline __half::operator float() const { return emu::half_to_float(__x); }

inline __half __float2half_rn(float f) { return __half_raw{emu::float_to_half_rn(f)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline float __half2float(__half h) { return emu::half_to_float(h.__x); }
inline __half __ushort_as_half(unsigned short u) { return __half_raw{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __short_as_half(short s) { return __half_raw{(unsigned short)s}; }
inline short __half_as_short(__half h) { return (short)h.__x; }
inline float2 __half22float2(__half2 h) { return make_float2(__half2float(h.x), __half2float(h.y)); }
inline __half2 __float22half2_rn(float2 f) { return __half2(__float2half_rn(f.x), __float2half_rn(f.y)); }
inline __half2 __floats2half2_rn(float a, float b) { return __half2(__float2half_rn(a), __float2half_rn(b)); }
inline __half2 __halves2half2(__half a, __half b) { return __half2(a, b); }
inline __half2 __half2half2(__half a) { return __half2(a, a); }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline bool __hisnan(__half h) { return (h.__x & 0x7fffu) > 0x7c00u; }
inline bool __hisinf(__half h) { return (h.__x & 0x7fffu) == 0x7c00u; }
