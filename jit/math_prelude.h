// Float math that CPU and CUDA kernels must round bit for bit alike, as one text both renderers
// (and the CUDA host emulator) put after their own prelude: the normal transform of
// jit/random_prelude.h takes kiln_logf of a uniform, so both backends draw the same normals only
// if their logs agree in every bit. The other fast math (exp, tanh, erf: backends/cpu/cpu_prelude.h)
// is CPU-only; CUDA kernels use CUDA's own, compared with a tolerance.
//
// The including prelude defines KILN_FN (the function qualifiers) and kiln_bits_f / kiln_f_bits
// (a float's bits and back), and compiles without multiply-add contraction (the host compiler's
// -ffp-contract=off, NVRTC's --fmad=false) so every float operation rounds alike.
#pragma once

namespace kiln::jit {

inline constexpr const char* kMathPrelude = R"KILN(
// log: m * 2^e with m in [sqrt(1/2), sqrt(2)); log m = 2 atanh((m-1)/(m+1)).
KILN_FN float kiln_logf(float x) {
  // Subnormal inputs have no implicit leading 1: scale them by 2^23 into the normal range first.
  int32_t subnormal = (kiln_f_bits(x) & 0x7f800000u) == 0;
  uint32_t u = kiln_f_bits(subnormal ? x * 8388608.0f : x);
  int32_t e = (int32_t)((u >> 23) & 0xff) - 127 - (subnormal ? 23 : 0);
  float m = kiln_bits_f((u & 0x007fffffu) | 0x3f800000u);
  if (m > 1.41421356f) { m *= 0.5f; e += 1; }
  float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
  float p = 2.0f * s * (1.0f + s2 * (0.333333333f + s2 * (0.2f + s2 * (0.142857143f + s2 * 0.111111111f))));
  float y = p + (float)e * 0.693147181f;
  const float inf = kiln_bits_f(0x7f800000u);
  y = x == 0.0f ? -inf : y;
  y = x < 0.0f ? kiln_bits_f(0x7fc00000u) : y;  // the quiet NaN
  y = x == inf ? x : y;
  return x != x ? x : y;
}
)KILN";

}  // namespace kiln::jit
