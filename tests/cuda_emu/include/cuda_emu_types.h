// CUDA vector types and bit casts for the host emulation of kernels/*.cu (tests/cuda_emu).
#pragma once
#include <cstring>

namespace emu {
inline unsigned int bits_of(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline float float_of(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
}  // namespace emu

#define EMU_VEC2(T, N, A) struct alignas(A) N { T x, y; }; \
  inline N make_##N(T x, T y) { N v; v.x = x; v.y = y; return v; }
#define EMU_VEC3(T, N) struct N { T x, y, z; }; \
  inline N make_##N(T x, T y, T z) { N v; v.x = x; v.y = y; v.z = z; return v; }
#define EMU_VEC4(T, N, A) struct alignas(A) N { T x, y, z, w; }; \
  inline N make_##N(T x, T y, T z, T w) { N v; v.x = x; v.y = y; v.z = z; v.w = w; return v; }

EMU_VEC2(char, char2, 2) EMU_VEC2(unsigned char, uchar2, 2) EMU_VEC2(short, short2, 4)
EMU_VEC2(unsigned short, ushort2, 4) EMU_VEC2(int, int2, 8) EMU_VEC2(unsigned int, uint2, 8)
EMU_VEC2(float, float2, 8) EMU_VEC2(long long, longlong2, 16) EMU_VEC2(unsigned long long, ulonglong2, 16)
EMU_VEC2(double, double2, 16)
EMU_VEC3(int, int3) EMU_VEC3(unsigned int, uint3) EMU_VEC3(float, float3)
EMU_VEC4(char, char4, 4) EMU_VEC4(unsigned char, uchar4, 4) EMU_VEC4(short, short4, 8)
EMU_VEC4(unsigned short, ushort4, 8) EMU_VEC4(int, int4, 16) EMU_VEC4(unsigned int, uint4, 16)
EMU_VEC4(float, float4, 16)
#undef EMU_VEC2
#undef EMU_VEC3
#undef EMU_VEC4

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
