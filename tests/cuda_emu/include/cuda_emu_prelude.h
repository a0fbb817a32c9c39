// Prelude force-included (g++ -include) before kernels/*.cu when they are run on the CPU.
//
// It maps CUDA C++ onto host C++ and the fiber runtime in runtime.cpp: a kernel becomes a plain
// function that every CUDA thread of a block runs in its own fiber; blocks run one after another;
// __syncthreads is a block barrier and warp intrinsics meet at a warp barrier between the 32 lanes.
// __shared__ variables are static storage in the ELF section emu_shared, filled with 0xFF bytes (NaN
// as fp32/fp16/bf16, -1 as integers) before every block.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "cuda_emu_types.h"

namespace emu {
// The runtime (runtime.cpp).
const uint3& thread_idx();
extern uint3 g_block_idx;
extern dim3 g_block_dim;
extern dim3 g_grid_dim;
void syncthreads();
int syncthreads_reduce(int op, int pred);  // 0: count, 1: and, 2: or
enum WarpOp { kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll, kSyncWarp, kReduceAdd,
              kReduceMin, kReduceMax, kMatchAny };
unsigned long long warp_collective(int op, unsigned mask, unsigned long long bits, int arg, int width);
unsigned active_mask();
long long clock_ticks();
[[noreturn]] void fatal(const char* msg);
typedef void (*BodyFn)(void* ctx);
int launch(BodyFn body, void* ctx, dim3 grid, dim3 block, char* shared_lo, char* shared_hi);

template <class T> inline unsigned long long to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp shuffle of this type");
  unsigned long long b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T> inline T from_bits(unsigned long long b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

// Generated launch wrappers call this with the kernel and cuLaunchKernel-style argument pointers.
template <class... A>
struct Call {
  void (*kernel)(A...);
  void** args;
  template <size_t... I> void invoke(std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_reference_t<A>*>(args[I])...);
  }
  static void run(void* self) { static_cast<Call*>(self)->invoke(std::index_sequence_for<A...>{}); }
};
template <class... A>
int launch_kernel(void (*kernel)(A...), const unsigned* grid, const unsigned* block, void** args,
                  char* shared_lo, char* shared_hi) {
  Call<A...> call{kernel, args};
  return launch(&Call<A...>::run, &call, dim3(grid[0], grid[1], grid[2]), dim3(block[0], block[1], block[2]),
                shared_lo, shared_hi);
}
}  // namespace emu

// -- qualifiers ---------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static __attribute__((aligned(16)))
#define __constant__ static
#define __managed__
#define __grid_constant__
// __restrict__ is a g++ keyword already.

// -- built-in variables -----------------------------------------------------------------------
#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::g_block_idx)
#define blockDim (::emu::g_block_dim)
#define gridDim (::emu::g_grid_dim)
#define warpSize 32

// -- synchronisation ----------------------------------------------------------------------------
inline void __syncthreads() { ::emu::syncthreads(); }
inline int __syncthreads_count(int p) { return ::emu::syncthreads_reduce(0, p); }
inline int __syncthreads_and(int p) { return ::emu::syncthreads_reduce(1, p); }
inline int __syncthreads_or(int p) { return ::emu::syncthreads_reduce(2, p); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::emu::warp_collective(::emu::kSyncWarp, mask, 0, 0, 32); }
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}
inline unsigned __activemask() { return ::emu::active_mask(); }

// -- warp shuffles and votes -------------------------------------------------------------------
template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return ::emu::from_bits<T>(::emu::warp_collective(::emu::kShflIdx, mask, ::emu::to_bits(v), src, width));
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ::emu::from_bits<T>(::emu::warp_collective(::emu::kShflUp, mask, ::emu::to_bits(v), (int)delta, width));
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ::emu::from_bits<T>(::emu::warp_collective(::emu::kShflDown, mask, ::emu::to_bits(v), (int)delta, width));
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return ::emu::from_bits<T>(::emu::warp_collective(::emu::kShflXor, mask, ::emu::to_bits(v), lane_mask, width));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return (unsigned)::emu::warp_collective(::emu::kBallot, mask, pred != 0, 0, 32);
}
inline int __any_sync(unsigned mask, int pred) { return (int)::emu::warp_collective(::emu::kAny, mask, pred != 0, 0, 32); }
inline int __all_sync(unsigned mask, int pred) { return (int)::emu::warp_collective(::emu::kAll, mask, pred != 0, 0, 32); }
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) {
  return (unsigned)::emu::warp_collective(::emu::kReduceAdd, mask, v, 0, 32);
}
inline unsigned __reduce_min_sync(unsigned mask, unsigned v) {
  return (unsigned)::emu::warp_collective(::emu::kReduceMin, mask, v, 0, 32);
}
inline unsigned __reduce_max_sync(unsigned mask, unsigned v) {
  return (unsigned)::emu::warp_collective(::emu::kReduceMax, mask, v, 0, 32);
}
template <class T> inline unsigned __match_any_sync(unsigned mask, T v) {
  return (unsigned)::emu::warp_collective(::emu::kMatchAny, mask, ::emu::to_bits(v), 0, 32);
}

// -- atomics: fibers of one OS thread never interleave inside a read-modify-write ----------------
template <class T> inline T atomicAdd(T* p, T v) { T o = *p; *p = o + v; return o; }
template <class T> inline T atomicSub(T* p, T v) { T o = *p; *p = o - v; return o; }
template <class T> inline T atomicExch(T* p, T v) { T o = *p; *p = v; return o; }
template <class T> inline T atomicMax(T* p, T v) { T o = *p; *p = o < v ? v : o; return o; }
template <class T> inline T atomicMin(T* p, T v) { T o = *p; *p = v < o ? v : o; return o; }
template <class T> inline T atomicAnd(T* p, T v) { T o = *p; *p = o & v; return o; }
template <class T> inline T atomicOr(T* p, T v) { T o = *p; *p = o | v; return o; }
template <class T> inline T atomicXor(T* p, T v) { T o = *p; *p = o ^ v; return o; }
template <class T> inline T atomicCAS(T* p, T cmp, T v) { T o = *p; if (o == cmp) *p = v; return o; }
inline unsigned atomicInc(unsigned* p, unsigned lim) { unsigned o = *p; *p = o >= lim ? 0u : o + 1u; return o; }
inline unsigned atomicDec(unsigned* p, unsigned lim) { unsigned o = *p; *p = (o == 0u || o > lim) ? lim : o - 1u; return o; }

// -- loads and stores with cache hints ---------------------------------------------------------
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// -- math and bit intrinsics -------------------------------------------------------------------
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __log10f(float x) { return std::log10(x); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanf(float x) { return std::tan(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float rsqrtf(float a) { return 1.f / std::sqrt(a); }
inline float __frsqrt_rn(float a) { return 1.f / std::sqrt(a); }
inline float __saturatef(float a) { return a < 0.f ? 0.f : (a > 1.f ? 1.f : a); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
inline long long __double_as_longlong(double d) { long long i; std::memcpy(&i, &d, 8); return i; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline int __mul24(int a, int b) { return a * b; }
inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline long long clock64() { return ::emu::clock_ticks(); }
inline void __nanosleep(unsigned) {}

// CUDA's overloaded integer and float min/max in the global namespace.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
