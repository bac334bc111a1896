#include "backends/cpu/pool_cpu.h"

#include <immintrin.h>

#include <algorithm>
#include <type_traits>

#include "core/error.h"

namespace kiln::cpu {
namespace {

// The window arg-max of output rows [r0, r1) in plain C++: any window, any float type.
template <typename T, typename O>
void rows_scalar(const T* x, O* out, int64_t OW, int64_t kh, int64_t kw, int64_t r0, int64_t r1) {
  const int64_t W = OW * kw;
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = x + r * kh * W;
    for (int64_t ow = 0; ow < OW; ++ow) {
      const T* window = row + ow * kw;
      T best = window[0];
      int64_t chosen = 0;
      bool nan = best != best;
      for (int64_t a = 0; a < kh && !nan; ++a)
        for (int64_t b = a == 0 ? 1 : 0; b < kw; ++b) {
          const T v = window[a * W + b];
          if (v != v) {
            chosen = a * W + b;
            nan = true;
            break;
          }
          if (v > best) best = v, chosen = a * W + b;  // strictly: the first of equal maxima stays
        }
      out[r * OW + ow] = static_cast<O>(chosen);
    }
  }
}

// 2 x 2 float windows, 16 outputs at a time: the even and odd columns of both input rows are
// deinterleaved from two loads each, so the four window elements are four vectors and the
// choice is four compares and three blends, without a branch.
template <typename O>
__attribute__((target("avx512f"))) void rows_2x2_avx512(const float* x, O* out, int64_t OW, int64_t r0,
                                                         int64_t r1) {
  const int64_t W = 2 * OW;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i off1 = _mm512_set1_epi32(1), off2 = _mm512_set1_epi32(static_cast<int>(W)),
                off3 = _mm512_set1_epi32(static_cast<int>(W + 1));
  for (int64_t r = r0; r < r1; ++r) {
    const float* top = x + r * 2 * W;
    const float* bottom = top + W;
    O* o = out + r * OW;
    for (int64_t ow = 0; ow < OW; ow += 16) {
      const int64_t n = std::min<int64_t>(16, OW - ow);  // outputs in this step: 2n inputs per row
      const __mmask16 lo = n >= 8 ? 0xFFFF : static_cast<__mmask16>((1u << (2 * n)) - 1);
      const __mmask16 hi = n > 8 ? static_cast<__mmask16>((1u << (2 * n - 16)) - 1) : 0;
      const __m512 t_lo = _mm512_maskz_loadu_ps(lo, top + 2 * ow), t_hi = _mm512_maskz_loadu_ps(hi, top + 2 * ow + 16);
      const __m512 b_lo = _mm512_maskz_loadu_ps(lo, bottom + 2 * ow),
                   b_hi = _mm512_maskz_loadu_ps(hi, bottom + 2 * ow + 16);
      const __m512 v0 = _mm512_permutex2var_ps(t_lo, even, t_hi), v1 = _mm512_permutex2var_ps(t_lo, odd, t_hi);
      const __m512 v2 = _mm512_permutex2var_ps(b_lo, even, b_hi), v3 = _mm512_permutex2var_ps(b_lo, odd, b_hi);
      const __mmask16 nan0 = _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q), nan1 = _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q),
                      nan2 = _mm512_cmp_ps_mask(v2, v2, _CMP_UNORD_Q);
      const __mmask16 any_nan = nan0 | nan1 | nan2 | _mm512_cmp_ps_mask(v3, v3, _CMP_UNORD_Q);
      // Without NaNs max is exact, and the first element equal to it is the first maximum.
      // (maskz: _mm512_max_ps's undefined source trips GCC 12's -Wmaybe-uninitialized)
      const __m512 m = _mm512_maskz_max_ps(0xFFFF, _mm512_maskz_max_ps(0xFFFF, v0, v1), _mm512_maskz_max_ps(0xFFFF, v2, v3));
      const __mmask16 hit0 = (_mm512_cmp_ps_mask(v0, m, _CMP_EQ_OQ) & ~any_nan) | nan0;
      const __mmask16 hit1 = (_mm512_cmp_ps_mask(v1, m, _CMP_EQ_OQ) & ~any_nan) | nan1;
      const __mmask16 hit2 = (_mm512_cmp_ps_mask(v2, m, _CMP_EQ_OQ) & ~any_nan) | nan2;
      __m512i chosen = _mm512_mask_mov_epi32(off3, hit2, off2);
      chosen = _mm512_mask_mov_epi32(chosen, hit1, off1);
      chosen = _mm512_mask_mov_epi32(chosen, hit0, _mm512_setzero_si512());
      const __mmask16 store = n == 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
      if constexpr (sizeof(O) == 1)
        _mm512_mask_cvtepi32_storeu_epi8(o + ow, store, chosen);
      else
        _mm512_mask_storeu_epi32(o + ow, store, chosen);
    }
  }
}

bool has_avx512f() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

template <typename T, typename O>
void offsets(const T* x, O* out, int64_t planes, int64_t OH, int64_t OW, int64_t kh, int64_t kw) {
  const int64_t rows = planes * OH;
  // Rows in blocks of 16 KiB or more of input, so that small poolings stay on one thread.
  const int64_t block = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, kh * OW * kw));
  const bool vector = std::is_same_v<T, float> && kh == 2 && kw == 2 && has_avx512f();
#pragma omp parallel for schedule(static) if (rows > 2 * block)
  for (int64_t r0 = 0; r0 < rows; r0 += block) {
    const int64_t r1 = std::min(rows, r0 + block);
    if constexpr (std::is_same_v<T, float>) {
      if (vector) {
        rows_2x2_avx512(x, out, OW, r0, r1);
        continue;
      }
    }
    rows_scalar(x, out, OW, kh, kw, r0, r1);
  }
}

template <typename T>
void offsets_as(DType offset_t, const void* x, void* out, int64_t planes, int64_t OH, int64_t OW, int64_t kh,
                int64_t kw) {
  if (offset_t == DType::Int8)
    offsets(static_cast<const T*>(x), static_cast<int8_t*>(out), planes, OH, OW, kh, kw);
  else
    offsets(static_cast<const T*>(x), static_cast<int32_t*>(out), planes, OH, OW, kh, kw);
}

}  // namespace

bool supports_max_pool_offsets(DType t) { return t == DType::Float32 || t == DType::Float64; }

void max_pool_offsets(DType t, DType offset_t, const void* x, void* out, int64_t planes, int64_t OH, int64_t OW,
                      int64_t kh, int64_t kw) {
  KILN_CHECK(supports_max_pool_offsets(t) && (offset_t == DType::Int8 || offset_t == DType::Int32),
             "max_pool_offsets", "takes float32 or float64 input and int8 or int32 offsets; got {} and {}",
             dtype_name(t), dtype_name(offset_t));
  if (t == DType::Float32)
    offsets_as<float>(offset_t, x, out, planes, OH, OW, kh, kw);
  else
    offsets_as<double>(offset_t, x, out, planes, OH, OW, kh, kw);
}

}  // namespace kiln::cpu
