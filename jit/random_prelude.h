// The random generators of CPU and CUDA kernels as one text, so both backends give the same
// numbers: Philox4x32-10 counters, uniform and normal transforms. The including prelude defines
// KILN_FN (the function qualifiers) and KILN_SQRTF / KILN_SQRT / KILN_LOG / KILN_COS; kiln_logf
// comes from jit/math_prelude.h, placed before this text.
#pragma once

namespace kiln::jit {

inline constexpr const char* kRandomPrelude = R"KILN(
// Philox4x32-10 (Salmon et al. 2011): key = seed, counter = element number.
KILN_FN void kiln_philox(uint64_t seed, uint64_t counter, uint32_t out[4]) {
  uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
    uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
    c1 = (uint32_t)p1; c3 = (uint32_t)p0; c0 = n0; c2 = n2;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}
KILN_FN float kiln_uniform_f(uint64_t seed, uint64_t offset, int64_t i) {
  uint32_t r[4]; kiln_philox(seed, offset + (uint64_t)i, r);
  return (float)(r[0] >> 8) * 5.9604644775390625e-08f;
}
KILN_FN double kiln_uniform_d(uint64_t seed, uint64_t offset, int64_t i) {
  uint32_t r[4]; kiln_philox(seed, offset + (uint64_t)i, r);
  uint64_t bits = ((uint64_t)r[0] << 21) ^ (uint64_t)r[1];
  return (double)(bits & ((1ull << 53) - 1)) * 1.1102230246251565e-16;
}
// cos(2 pi u) for u in [0, 1), folded by symmetry onto [0, pi/2] and a Taylor polynomial there
// (error below 1e-8): unlike libm's cosf it vectorizes, which makes randn memory-bound.
KILN_FN float kiln_cos2pi(float u) {
  float t = u < 0.5f ? u : 1.0f - u;
  float sign = t < 0.25f ? 1.0f : -1.0f;
  t = t < 0.25f ? t : 0.5f - t;
  float x = 6.28318531f * t, z = x * x;
  float c = 1.0f + z * (-0.5f + z * (4.16666667e-2f + z * (-1.38888889e-3f + z * (2.48015873e-5f +
            z * (-2.75573192e-7f + z * 2.08767570e-9f)))));
  return sign * c;
}
KILN_FN float kiln_normal_f(uint64_t seed, uint64_t offset, int64_t i) {
  uint32_t r[4]; kiln_philox(seed, offset + (uint64_t)i, r);
  float u1 = ((float)(r[0] >> 8) + 1.0f) * 5.9604644775390625e-08f;
  float u2 = (float)(r[1] >> 8) * 5.9604644775390625e-08f;
  return KILN_SQRTF(-2.0f * kiln_logf(u1)) * kiln_cos2pi(u2);
}
KILN_FN double kiln_normal_d(uint64_t seed, uint64_t offset, int64_t i) {
  uint32_t r[4]; kiln_philox(seed, offset + (uint64_t)i, r);
  double u1 = ((double)(((uint64_t)r[0] << 21) ^ r[1]) + 1.0) * 1.1102230246251565e-16;
  double u2 = (double)(((uint64_t)r[2] << 21) ^ r[3]) * 1.1102230246251565e-16;
  u1 = u1 > 1.0 ? 1.0 : u1;
  return KILN_SQRT(-2.0 * KILN_LOG(u1)) * KILN_COS(6.283185307179586 * u2);
}
)KILN";

}  // namespace kiln::jit
