// What the host emulator (backends/cuda/cuda_emulator.h) puts where NVRTC's translation unit has
// backends/cuda/cuda_prelude.h's kCudaTypes: the subset of CUDA's built-ins that kiln's kernels use, for
// the host compiler. Thread and block indices, __syncthreads and warp shuffles call into the
// emulator's fiber scheduler through one state struct; fp16/bf16 are 16-bit structs converted as
// the hardware rounds (to nearest even); atomics are plain read-modify-writes, since the fibers
// of a launch take turns on one OS thread and switch only at barriers and shuffles.
#pragma once

namespace kiln::cuda {

inline constexpr const char* kCudaEmulatorTypes = R"KILN(
#include <stdint.h>
#include <string.h>
#include <math.h>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static  /* blocks run one after another, so one copy serves each in turn */

struct kiln_uint3 { unsigned int x, y, z; };
// Layout shared with backends/cuda/cuda_emulator.cc (kiln_emu_bind returns its size as a check).
struct kiln_emu_state {
  kiln_uint3 thread_idx, block_idx, block_dim, grid_dim;
  void (*sync_threads)();
  unsigned long long (*shfl_down)(unsigned long long bits, int delta);
  void (*misaligned)(const void* p, unsigned long bytes);
};
static kiln_emu_state* kiln_emu;
extern "C" unsigned long kiln_emu_bind(kiln_emu_state* state) { kiln_emu = state; return sizeof(kiln_emu_state); }
#define threadIdx (kiln_emu->thread_idx)
#define blockIdx (kiln_emu->block_idx)
#define blockDim (kiln_emu->block_dim)
#define gridDim (kiln_emu->grid_dim)
static inline void __syncthreads() { kiln_emu->sync_threads(); }
template <class T> static inline T __shfl_down_sync(unsigned, T v, int delta) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  unsigned long long bits = 0;
  memcpy(&bits, &v, sizeof(T));
  bits = kiln_emu->shfl_down(bits, delta);
  T out;
  memcpy(&out, &bits, sizeof(T));
  return out;
}

// Vector loads and stores as backends/cuda/cuda_prelude.h has them; an address a GPU would fault on
// (misaligned for the vector's size) is reported, and the access done bytewise so the launch ends.
template <class T, int V> struct alignas(sizeof(T) * V) kiln_vec { T v[V]; };
template <int V, class T> static inline kiln_vec<T, V> kiln_vload(const T* p) {
  if ((uint64_t)p % sizeof(kiln_vec<T, V>)) kiln_emu->misaligned(p, sizeof(kiln_vec<T, V>));
  kiln_vec<T, V> x;
  memcpy(&x, p, sizeof x);
  return x;
}
template <int V, class T> static inline void kiln_vstore(T* p, const kiln_vec<T, V>& x) {
  if ((uint64_t)p % sizeof(kiln_vec<T, V>)) kiln_emu->misaligned(p, sizeof(kiln_vec<T, V>));
  memcpy(p, &x, sizeof x);
}

static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }

struct __half { uint16_t bits; };
struct __nv_bfloat16 { uint16_t bits; };
static inline float __half2float(__half h) { _Float16 f; memcpy(&f, &h.bits, 2); return (float)f; }
static inline __half __float2half_rn(float x) { _Float16 f = (_Float16)x; __half h; memcpy(&h.bits, &f, 2); return h; }
static inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float((unsigned int)b.bits << 16); }
static inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  unsigned int u = __float_as_uint(x);
  __nv_bfloat16 b;
  if ((u & 0x7fffffffu) > 0x7f800000u) { b.bits = (uint16_t)((u >> 16) | 0x40); return b; }
  u += 0x7fffu + ((u >> 16) & 1u);
  b.bits = (uint16_t)(u >> 16);
  return b;
}

static inline float atomicAdd(float* p, float v) { float old = *p; *p = old + v; return old; }
static inline double atomicAdd(double* p, double v) { double old = *p; *p = old + v; return old; }
static inline int atomicAdd(int* p, int v) { int old = *p; *p = (int)((unsigned int)old + (unsigned int)v); return old; }
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  unsigned long long old = *p; *p = old + v; return old;
}
static inline __half atomicAdd(__half* p, __half v) {
  __half old = *p; *p = __float2half_rn(__half2float(old) + __half2float(v)); return old;
}
static inline __nv_bfloat16 atomicAdd(__nv_bfloat16* p, __nv_bfloat16 v) {
  __nv_bfloat16 old = *p; *p = __float2bfloat16_rn(__bfloat162float(old) + __bfloat162float(v)); return old;
}
static inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) {
  unsigned long long old = *p; *p = v; return old;
}
static inline unsigned int atomicCAS(unsigned int* p, unsigned int compare, unsigned int v) {
  unsigned int old = *p; if (old == compare) *p = v; return old;
}
)KILN";

}  // namespace kiln::cuda
