// Source text placed at the top of every generated C++ translation unit: element conversions and
// vectorizable float math (exp, tanh, erf). After it come the texts shared with CUDA kernels:
// jit/math_prelude.h (kiln_logf, which must round as on CUDA) and jit/random_prelude.h (Philox).
#pragma once

namespace kiln::cpu {

inline constexpr const char* kCpuPrelude = R"KILN(
#include <stdint.h>
typedef uint16_t kiln_half;
typedef uint16_t kiln_bf16;
// clang before 15 has no _Float16 on x86; its __fp16 is the same binary16, as a storage type.
#if defined(__clang__) && __clang_major__ < 15
typedef __fp16 kiln_f16;
#else
typedef _Float16 kiln_f16;
#endif
static inline float kiln_h2f(uint16_t h) { kiln_f16 f; __builtin_memcpy(&f, &h, 2); return (float)f; }
static inline uint16_t kiln_f2h(float x) { kiln_f16 f = (kiln_f16)x; uint16_t h; __builtin_memcpy(&h, &f, 2); return h; }
static inline float kiln_bits_f(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
static inline uint32_t kiln_f_bits(float f) { uint32_t u; __builtin_memcpy(&u, &f, 4); return u; }
static inline float kiln_bf2f(uint16_t b) { return kiln_bits_f((uint32_t)b << 16); }
// Round to nearest even; a NaN stays a (quiet) NaN. Branch-free selects, so loops of them
// vectorize.
static inline uint32_t kiln_bf_bits(float x) {
  uint32_t u = kiln_f_bits(x);
  uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return ((u & 0x7fffffffu) > 0x7f800000u ? u | 0x400000u : rounded) & 0xffff0000u;
}
static inline uint16_t kiln_f2bf(float x) { return (uint16_t)(kiln_bf_bits(x) >> 16); }
// A float that is a bfloat16 value already (every bfloat16-typed value of a kernel is): its top half.
static inline uint16_t kiln_f2bf_exact(float x) { return (uint16_t)(kiln_f_bits(x) >> 16); }
static inline float kiln_round_h(float x) { return kiln_h2f(kiln_f2h(x)); }
static inline float kiln_round_bf(float x) { return kiln_bits_f(kiln_bf_bits(x)); }

// exp: 2^n * e^r with |r| <= ln2/2, degree-7 polynomial (about 1 ulp).
static inline float kiln_expf(float x) {
  float xc = x < -87.33654f ? -87.33654f : (x > 88.72283f ? 88.72283f : x);
  float n = __builtin_rintf(xc * 1.44269504f);
  float r = xc - n * 0.693145752f - n * 1.42860677e-6f;
  float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f + r * (0.00833333377f +
            r * (0.00138888892f + r * 0.000198412701f))))));
  // 2^n as two factors: n reaches 128 (x near 88.7, result still finite) and -126, and a single
  // 2^n would overflow the exponent field at 128.
  int32_t ni = (int32_t)n, half = ni >> 1;
  float y = p * kiln_bits_f((uint32_t)(half + 127) << 23) * kiln_bits_f((uint32_t)(ni - half + 127) << 23);
  y = x > 88.72283f ? __builtin_inff() : y;
  y = x < -87.33654f ? 0.0f : y;
  return x != x ? x : y;
}
static inline float kiln_tanhf(float x) {
  float a = x < 0 ? -x : x;
  float x2 = x * x;
  float small = x * (1.0f + x2 * (-0.333333333f + x2 * (0.133333333f + x2 * (-0.0539682540f + x2 * 0.0218694885f))));
  float e = kiln_expf(-2.0f * a);
  float big = (1.0f - e) / (1.0f + e);
  big = x < 0 ? -big : big;
  return a < 0.1f ? small : big;
}
// erf: x P(x^2) / Q(x^2) on [-4, 4] (beyond 4, erf is 1 in float). Coefficients fitted for kiln
// by iteratively reweighted least squares on relative error: at most 3.9e-7 relative when
// evaluated in float (every float in [-5, 5] against double erf). One division and no exp, so it vectorizes; clamped so |erf| never exceeds 1. Horner steps
// are explicit fused multiply-adds (the same bits in every kernel, fused or not, whatever
// -ffp-contract says): half the instructions of a multiply and an add.
static inline float kiln_erff(float x) {
  float c = x < -4.0f ? -4.0f : (x > 4.0f ? 4.0f : x);
  float z = c * c;
  float p = -1.3173756604745287e-08f;
  p = __builtin_fmaf(p, z, 4.6806406144515125e-06f);
  p = __builtin_fmaf(p, z, 0.0003794239771022433f);
  p = __builtin_fmaf(p, z, 0.003846896708382652f);
  p = __builtin_fmaf(p, z, 0.054306011194403495f);
  p = __builtin_fmaf(p, z, 0.18514519454067913f);
  p = __builtin_fmaf(p, z, 1.1283791694439855f);
  float q = 6.30736212661557e-05f;
  q = __builtin_fmaf(q, z, 0.001306784038519625f);
  q = __builtin_fmaf(q, z, 0.015455907081364977f);
  q = __builtin_fmaf(q, z, 0.11393160572546802f);
  q = __builtin_fmaf(q, z, 0.497414072204301f);
  q = __builtin_fmaf(q, z, 1.0f);
  float r = c * p / q;
  return r < -1.0f ? -1.0f : (r > 1.0f ? 1.0f : r);
}
// Copies a kernel's finished tile (in L1) to its output with non-temporal stores: an output
// larger than the last-level cache is written without first reading each line into the cache
// (a third of the traffic of y = f(x)). `dst` is 64-byte aligned. Callers fence once at the end.
static inline void kiln_stream(void* dst, const void* src, int64_t bytes) {
  int64_t j = 0;
#if defined(__AVX512F__) || defined(__AVX__)
#if defined(__AVX512F__)
#define KILN_NT_BYTES 64
#else
#define KILN_NT_BYTES 32
#endif
  typedef long long kiln_vnt __attribute__((vector_size(KILN_NT_BYTES)));
  for (; j + KILN_NT_BYTES <= bytes; j += KILN_NT_BYTES) {
    kiln_vnt v;
    __builtin_memcpy(&v, (const char*)src + j, KILN_NT_BYTES);
#if defined(__clang__)
    __builtin_nontemporal_store(v, (kiln_vnt*)((char*)dst + j));
#elif defined(__AVX512F__)
    __builtin_ia32_movntdq512((kiln_vnt*)((char*)dst + j), v);
#else
    __builtin_ia32_movntdq256((kiln_vnt*)((char*)dst + j), v);
#endif
  }
#endif
  __builtin_memcpy((char*)dst + j, (const char*)src + j, (unsigned long)(bytes - j));
}
static inline void kiln_sfence(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_sfence();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}
static inline int64_t kiln_check_index(int64_t j, int64_t extent, int64_t* err) {
  if (j < 0 || j >= extent) { __atomic_store_n(err, j == INT64_MIN ? -1 : j, __ATOMIC_RELAXED); __atomic_store_n(err + 1, 1, __ATOMIC_RELAXED); return 0; }
  return j;
}
#define KILN_FN static inline
#define KILN_SQRTF(x) __builtin_sqrtf(x)
#define KILN_SQRT(x) __builtin_sqrt(x)
#define KILN_LOG(x) __builtin_log(x)
#define KILN_COS(x) __builtin_cos(x)
// NaN-propagating; a tie gives b. Tested on b first: GCC 12 turns `a != a` of a nested max into a
// select between booleans, which it neither vectorizes nor keeps branch-free.
#define KILN_MAX(a, b) (((b) >= (a) || (b) != (b)) ? (b) : (a))
#define KILN_MIN(a, b) (((b) <= (a) || (b) != (b)) ? (b) : (a))
// Max reductions of floats combine partial results with KILN_MAX, so a NaN anywhere wins.
#pragma omp declare reduction(kiln_max : float : omp_out = KILN_MAX(omp_in, omp_out)) initializer(omp_priv = -__builtin_inff())
#pragma omp declare reduction(kiln_max : double : omp_out = KILN_MAX(omp_in, omp_out)) initializer(omp_priv = -__builtin_inf())
)KILN";

}  // namespace kiln::cpu
