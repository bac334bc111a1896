// Source text placed at the top of every generated CUDA translation unit, in two parts.
// kCudaTypes is what NVRTC (which has no standard headers) needs first: fixed-width integer types,
// CUDA's fp16/bf16 headers and vector loads; the host emulator (backends/cuda/cuda_emulator.h) puts
// its own definitions of those and of CUDA's built-ins in its place. kCudaPrelude, compiled by
// both, holds the helpers backends/cpu/cpu_prelude.h defines under the same names (element
// conversions, float bits, KILN_MAX/MIN, the index check) and what only CUDA needs (warp shuffles
// of any accumulator type, atomic adds of any element type, block-wide folds). After it come the
// texts shared with CPU kernels: jit/math_prelude.h (kiln_logf) and jit/random_prelude.h (Philox).
#pragma once

namespace kiln::cuda {

inline constexpr const char* kCudaTypes = R"KILN(
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#define INT8_MIN (-128)
#define INT32_MIN (-2147483647 - 1)
#define INT64_MIN (-9223372036854775807LL - 1)

// V elements in one aligned load or store (16 bytes at most: one LDG.128 / STG.128). The
// renderer checks the alignment before it takes this path.
template <class T, int V> struct alignas(sizeof(T) * V) kiln_vec { T v[V]; };
template <int V, class T> static __device__ __forceinline__ kiln_vec<T, V> kiln_vload(const T* p) {
  return *reinterpret_cast<const kiln_vec<T, V>*>(p);
}
template <int V, class T> static __device__ __forceinline__ void kiln_vstore(T* p, const kiln_vec<T, V>& x) {
  *reinterpret_cast<kiln_vec<T, V>*>(p) = x;
}
)KILN";

inline constexpr const char* kCudaPrelude = R"KILN(
#define KILN_INF __int_as_float(0x7f800000)
typedef __half kiln_half;
typedef __nv_bfloat16 kiln_bf16;
static __device__ __forceinline__ float kiln_h2f(kiln_half h) { return __half2float(h); }
static __device__ __forceinline__ kiln_half kiln_f2h(float x) { return __float2half_rn(x); }
static __device__ __forceinline__ float kiln_bf2f(kiln_bf16 b) { return __bfloat162float(b); }
static __device__ __forceinline__ kiln_bf16 kiln_f2bf(float x) { return __float2bfloat16_rn(x); }
static __device__ __forceinline__ float kiln_round_h(float x) { return kiln_h2f(kiln_f2h(x)); }
static __device__ __forceinline__ float kiln_round_bf(float x) { return kiln_bf2f(kiln_f2bf(x)); }
static __device__ __forceinline__ float kiln_bits_f(uint32_t u) { return __uint_as_float(u); }
static __device__ __forceinline__ uint32_t kiln_f_bits(float f) { return __float_as_uint(f); }
#define KILN_MAX(a, b) (((a) != (a) || (a) > (b)) ? (a) : (b))
#define KILN_MIN(a, b) (((a) != (a) || (a) < (b)) ? (a) : (b))

// An index out of [0, extent) is recorded in err[0..1] (value, flag) and read as 0.
static __device__ __forceinline__ int64_t kiln_check_index(int64_t j, int64_t extent, int64_t* err) {
  if (j < 0 || j >= extent) {
    atomicExch((unsigned long long*)err, (unsigned long long)(j == INT64_MIN ? -1 : j));
    atomicExch((unsigned long long*)(err + 1), 1ull);
    return 0;
  }
  return j;
}

// Warp shuffles of every accumulator type (sub-word integers and bool travel as int).
template <class T> static __device__ __forceinline__ T kiln_shfl_down(T v, int delta) {
  return __shfl_down_sync(0xffffffffu, v, delta);
}
template <> __device__ __forceinline__ bool kiln_shfl_down(bool v, int delta) {
  return __shfl_down_sync(0xffffffffu, (int)v, delta) != 0;
}
template <> __device__ __forceinline__ int8_t kiln_shfl_down(int8_t v, int delta) {
  return (int8_t)__shfl_down_sync(0xffffffffu, (int)v, delta);
}
template <> __device__ __forceinline__ uint8_t kiln_shfl_down(uint8_t v, int delta) {
  return (uint8_t)__shfl_down_sync(0xffffffffu, (int)v, delta);
}

// *p += v for scatter_add: hardware atomics where they exist, else a compare-and-swap on the
// aligned 32-bit word holding the byte.
static __device__ __forceinline__ void kiln_atomic_add(float* p, float v) { atomicAdd(p, v); }
static __device__ __forceinline__ void kiln_atomic_add(double* p, double v) { atomicAdd(p, v); }
static __device__ __forceinline__ void kiln_atomic_add(kiln_half* p, float v) { atomicAdd(p, kiln_f2h(v)); }
static __device__ __forceinline__ void kiln_atomic_add(kiln_bf16* p, float v) { atomicAdd(p, kiln_f2bf(v)); }
static __device__ __forceinline__ void kiln_atomic_add(int32_t* p, int32_t v) { atomicAdd(p, v); }
static __device__ __forceinline__ void kiln_atomic_add(int64_t* p, int64_t v) {
  atomicAdd((unsigned long long*)p, (unsigned long long)v);
}
static __device__ __forceinline__ void kiln_atomic_add_byte(void* p, int v, bool is_bool) {
  unsigned int* word = (unsigned int*)((uint64_t)p & ~(uint64_t)3);
  const unsigned int shift = ((unsigned int)((uint64_t)p & 3)) * 8;
  unsigned int old = *word, assumed;
  do {
    assumed = old;
    unsigned int byte = ((assumed >> shift) & 0xffu) + (unsigned int)v;
    if (is_bool) byte = (byte & 0xffu) != 0;
    old = atomicCAS(word, assumed, (assumed & ~(0xffu << shift)) | ((byte & 0xffu) << shift));
  } while (old != assumed);
}
static __device__ __forceinline__ void kiln_atomic_add(int8_t* p, int8_t v) { kiln_atomic_add_byte(p, v, false); }
static __device__ __forceinline__ void kiln_atomic_add(uint8_t* p, uint8_t v) { kiln_atomic_add_byte(p, v, false); }
static __device__ __forceinline__ void kiln_atomic_add(bool* p, bool v) { kiln_atomic_add_byte(p, v, true); }

#define KILN_FN static __device__ __forceinline__
#define KILN_SQRTF(x) sqrtf(x)
#define KILN_SQRT(x) sqrt(x)
#define KILN_LOG(x) log(x)
#define KILN_COS(x) cos(x)

// Block-wide fold of one value per thread (blockDim.x a multiple of 32, at most 1024); the result
// is valid in thread 0. `scratch` holds 32 values. Sum or NaN-propagating max.
template <bool kSum, class T> static __device__ __forceinline__ T kiln_warp_fold(T acc) {
  for (int delta = 16; delta > 0; delta >>= 1) {
    T other = kiln_shfl_down(acc, delta);
    acc = kSum ? (T)(acc + other) : KILN_MAX(other, acc);
  }
  return acc;
}
template <bool kSum, class T> static __device__ __forceinline__ T kiln_block_fold(T acc, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  acc = kiln_warp_fold<kSum>(acc);
  __syncthreads();  // scratch may still be read by the previous fold
  if (lane == 0) scratch[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = scratch[0];
    for (int w = 1; w < warps; ++w) acc = kSum ? (T)(acc + scratch[w]) : KILN_MAX(scratch[w], acc);
  }
  return acc;
}
)KILN";

}  // namespace kiln::cuda
