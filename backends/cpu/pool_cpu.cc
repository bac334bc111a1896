#include "backends/cpu/pool_cpu.h"

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <type_traits>

#include "core/error.h"

namespace kiln::cpu {
namespace {

// A bfloat16 value as stored: compared as the float it widens to (exactly), copied as its bits,
// so a pooled value (a NaN's payload included) is the input's.
struct Bf16 {
  uint16_t bits;
  operator float() const { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }
};

// The window arg-max of output rows [r0, r1) in plain C++: any window, any float type.
template <typename T, typename O>
void offsets_scalar(const T* x, O* out, int64_t OW, int64_t kh, int64_t kw, int64_t r0, int64_t r1) {
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

// Compiled for AVX-512 whatever the build's -march; called only where the CPU has it.
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

// The four elements of 2 x 2 windows as floats (bfloat16 widened), 16 windows at a time: the even
// and odd columns of both input rows, deinterleaved from two loads each (masked past the row's
// end).
struct Windows2x2 {
  __m512 v0, v1, v2, v3;
  __mmask16 store;  // the n windows of this step
};

AVX512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
// (maskz forms throughout: the plain ones' undefined sources trip GCC 12's -Wmaybe-uninitialized)
AVX512 inline __m512 load16(const Bf16* p, __mmask16 m) {
  const __m512i wide = _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, wide, 16));
}
AVX512 inline void store16(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
AVX512 inline void store16(Bf16* p, __mmask16 m, __m512 v) {  // the top halves: exact, v was widened
  const __m512i top = _mm512_maskz_srli_epi32(0xFFFF, _mm512_castps_si512(v), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_maskz_cvtepi32_epi16(0xFFFF, top));
}

// The lanes of a step of n <= 16 windows: the windows, and the 2n elements of each input row
// they cover, in two 16-lane halves.
struct Lanes2x2 {
  __mmask16 windows, lo, hi;
};

inline Lanes2x2 lanes_2x2(int64_t n) {
  return {n == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1),
          n >= 8 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (2 * n)) - 1),
          n > 8 ? static_cast<__mmask16>((1u << (2 * n - 16)) - 1) : static_cast<__mmask16>(0)};
}

template <typename T>
AVX512 inline Windows2x2 load_2x2(const T* top, int64_t W, int64_t n) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const Lanes2x2 l = lanes_2x2(n);
  const T* bottom = top + W;
  const __m512 t_lo = load16(top, l.lo), t_hi = load16(top + 16, l.hi);
  const __m512 b_lo = load16(bottom, l.lo), b_hi = load16(bottom + 16, l.hi);
  return {_mm512_permutex2var_ps(t_lo, even, t_hi), _mm512_permutex2var_ps(t_lo, odd, t_hi),
          _mm512_permutex2var_ps(b_lo, even, b_hi), _mm512_permutex2var_ps(b_lo, odd, b_hi), l.windows};
}

// The arg-max: four compares and three blends per 16 windows, without a branch.
template <typename T, typename O>
AVX512 void offsets_2x2_avx512(const T* x, O* out, int64_t OW, int64_t r0, int64_t r1) {
  const int64_t W = 2 * OW;
  const __m512i off1 = _mm512_set1_epi32(1), off2 = _mm512_set1_epi32(static_cast<int>(W)),
                off3 = _mm512_set1_epi32(static_cast<int>(W + 1));
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t ow = 0; ow < OW; ow += 16) {
      const Windows2x2 w = load_2x2(x + r * 2 * W + 2 * ow, W, std::min<int64_t>(16, OW - ow));
      const __mmask16 nan0 = _mm512_cmp_ps_mask(w.v0, w.v0, _CMP_UNORD_Q),
                      nan1 = _mm512_cmp_ps_mask(w.v1, w.v1, _CMP_UNORD_Q),
                      nan2 = _mm512_cmp_ps_mask(w.v2, w.v2, _CMP_UNORD_Q);
      const __mmask16 any_nan = nan0 | nan1 | nan2 | _mm512_cmp_ps_mask(w.v3, w.v3, _CMP_UNORD_Q);
      // Without NaNs max is exact, and the first element equal to it is the first maximum.
      // (maskz: _mm512_max_ps's undefined source trips GCC 12's -Wmaybe-uninitialized)
      const __m512 m = _mm512_maskz_max_ps(0xFFFF, _mm512_maskz_max_ps(0xFFFF, w.v0, w.v1),
                                           _mm512_maskz_max_ps(0xFFFF, w.v2, w.v3));
      const __mmask16 hit0 = (_mm512_cmp_ps_mask(w.v0, m, _CMP_EQ_OQ) & ~any_nan) | nan0;
      const __mmask16 hit1 = (_mm512_cmp_ps_mask(w.v1, m, _CMP_EQ_OQ) & ~any_nan) | nan1;
      const __mmask16 hit2 = (_mm512_cmp_ps_mask(w.v2, m, _CMP_EQ_OQ) & ~any_nan) | nan2;
      __m512i chosen = _mm512_mask_mov_epi32(off3, hit2, off2);
      chosen = _mm512_mask_mov_epi32(chosen, hit1, off1);
      chosen = _mm512_mask_mov_epi32(chosen, hit0, _mm512_setzero_si512());
      if constexpr (sizeof(O) == 1)
        _mm512_mask_cvtepi32_storeu_epi8(out + r * OW + ow, w.store, chosen);
      else
        _mm512_mask_storeu_epi32(out + r * OW + ow, w.store, chosen);
    }
}

// Which of a 2 x 2 window's elements each of 16 offsets names (0, 1, W, W + 1), and whether every
// offset of the `windows` lanes names one.
struct Picks2x2 {
  __mmask16 at0, at1, at2, at3;
  bool valid;
};

template <typename O>
AVX512 inline Picks2x2 picks_2x2(const O* offsets, __mmask16 windows, int64_t W) {
  __m512i off;
  if constexpr (sizeof(O) == 1) {
    off = _mm512_maskz_cvtepi8_epi32(0xFFFF, _mm_maskz_loadu_epi8(windows, offsets));
  } else {
    off = _mm512_maskz_loadu_epi32(windows, offsets);
  }
  const __mmask16 at0 = _mm512_cmpeq_epi32_mask(off, _mm512_setzero_si512()),
                  at1 = _mm512_cmpeq_epi32_mask(off, _mm512_set1_epi32(1)),
                  at2 = _mm512_cmpeq_epi32_mask(off, _mm512_set1_epi32(static_cast<int>(W))),
                  at3 = _mm512_cmpeq_epi32_mask(off, _mm512_set1_epi32(static_cast<int>(W + 1)));
  return {at0, at1, at2, at3, (windows & ~(at0 | at1 | at2 | at3)) == 0};
}

// The element at each offset: three blends per 16 windows. Returns false at an offset that is
// not one of the window's four.
template <typename T, typename O>
AVX512 bool gather_2x2_avx512(const T* x, const O* offsets, T* out, int64_t OW, int64_t r0, int64_t r1) {
  const int64_t W = 2 * OW;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t ow = 0; ow < OW; ow += 16) {
      const int64_t n = std::min<int64_t>(16, OW - ow);
      const Windows2x2 w = load_2x2(x + r * 2 * W + 2 * ow, W, n);
      const Picks2x2 p = picks_2x2(offsets + r * OW + ow, w.store, W);
      if (!p.valid) return false;
      __m512 y = _mm512_mask_mov_ps(w.v0, p.at1, w.v1);
      y = _mm512_mask_mov_ps(y, p.at2, w.v2);
      y = _mm512_mask_mov_ps(y, p.at3, w.v3);
      store16(out + r * OW + ow, w.store, y);
    }
  return true;
}

// The gather's gradient: each window's value at its offset, +0.0 at the others (see plus_zero),
// interleaved back into the two input rows. Returns false at an offset outside the window.
template <typename T, typename O>
AVX512 bool scatter_2x2_avx512(const T* g, const O* offsets, T* out, int64_t OW, int64_t r0, int64_t r1) {
  const int64_t W = 2 * OW;
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t ow = 0; ow < OW; ow += 16) {
      const auto [windows, lo, hi] = lanes_2x2(std::min<int64_t>(16, OW - ow));
      const Picks2x2 p = picks_2x2(offsets + r * OW + ow, windows, W);
      if (!p.valid) return false;
      const __m512 y = _mm512_maskz_add_ps(0xFFFF, load16(g + r * OW + ow, windows), _mm512_setzero_ps());
      const __m512 v0 = _mm512_maskz_mov_ps(p.at0, y), v1 = _mm512_maskz_mov_ps(p.at1, y),
                   v2 = _mm512_maskz_mov_ps(p.at2, y), v3 = _mm512_maskz_mov_ps(p.at3, y);
      T* top = out + r * 2 * W + 2 * ow;
      T* bottom = top + W;
      store16(top, lo, _mm512_permutex2var_ps(v0, first, v1));
      store16(top + 16, hi, _mm512_permutex2var_ps(v0, second, v1));
      store16(bottom, lo, _mm512_permutex2var_ps(v2, first, v3));
      store16(bottom + 16, hi, _mm512_permutex2var_ps(v2, second, v3));
    }
  return true;
}

// v + 0.0 in v's type: what a scatter-add into zeros stores (-0.0 becomes +0.0, a NaN turns quiet).
template <typename T>
T plus_zero(T v) {
  if constexpr (std::is_same_v<T, Bf16>)  // exact in float, so the top half is the bfloat16 sum
    return Bf16{static_cast<uint16_t>(std::bit_cast<uint32_t>(static_cast<float>(v) + 0.0f) >> 16)};
  else
    return v + T{0};
}

// In plain C++, the gather (`pooled` written: the input's element at each offset) or, with
// Scatter, its gradient (`input` written: each window zeros and `pooled`'s value at its offset).
// False at an offset outside its window.
template <bool Scatter, typename T, typename O>
bool by_window_scalar(const T* in, const O* offsets, T* out, int64_t OW, int64_t kh, int64_t kw, int64_t r0,
                      int64_t r1) {
  const int64_t W = OW * kw;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t ow = 0; ow < OW; ++ow) {
      const int64_t off = offsets[r * OW + ow], pooled = r * OW + ow, window = r * kh * W + ow * kw;
      if (off < 0 || off / W >= kh || off % W >= kw) return false;
      if constexpr (Scatter) {
        for (int64_t a = 0; a < kh; ++a)
          for (int64_t b = 0; b < kw; ++b) out[window + a * W + b] = T{};
        out[window + off] = plus_zero(in[pooled]);
      } else {
        out[pooled] = in[window + off];
      }
    }
  return true;
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}

// Calls body(r0, r1) over blocks of output rows, in parallel where there is enough work; false
// when a block returned false (OpenMP regions cannot throw).
template <typename Body>
bool for_row_blocks(int64_t rows, int64_t row_input_elements, Body body) {
  // Blocks of 16 KiB or more of float input, so that small poolings stay on one thread.
  const int64_t block = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, row_input_elements));
  bool ok = true;
#pragma omp parallel for schedule(static) if (rows > 2 * block) reduction(&& : ok)
  for (int64_t r0 = 0; r0 < rows; r0 += block) ok = body(r0, std::min(rows, r0 + block)) && ok;
  return ok;
}

template <typename T>
constexpr bool kVectorType = std::is_same_v<T, float> || std::is_same_v<T, Bf16>;

template <typename T, typename O>
void offsets(const T* x, O* out, int64_t planes, int64_t OH, int64_t OW, int64_t kh, int64_t kw) {
  const bool vector = kVectorType<T> && kh == 2 && kw == 2 && has_avx512();
  for_row_blocks(planes * OH, kh * kw * OW, [&](int64_t r0, int64_t r1) {
    if constexpr (kVectorType<T>)
      if (vector) return offsets_2x2_avx512(x, out, OW, r0, r1), true;
    return offsets_scalar(x, out, OW, kh, kw, r0, r1), true;
  });
}

// The gather, or with Scatter its gradient (by_window_scalar), over every window.
template <bool Scatter, typename T, typename O>
bool by_window(const T* in, const O* offsets, T* out, int64_t planes, int64_t OH, int64_t OW, int64_t kh, int64_t kw) {
  const bool vector = kVectorType<T> && kh == 2 && kw == 2 && has_avx512();
  return for_row_blocks(planes * OH, kh * kw * OW, [&](int64_t r0, int64_t r1) {
    if constexpr (kVectorType<T>)
      if (vector)
        return Scatter ? scatter_2x2_avx512(in, offsets, out, OW, r0, r1) : gather_2x2_avx512(in, offsets, out, OW, r0, r1);
    return by_window_scalar<Scatter>(in, offsets, out, OW, kh, kw, r0, r1);
  });
}

// f(T{}, O{}) for the input and offset dtypes.
template <typename F>
auto with_types(DType t, DType offset_t, F f) {
  auto as_offsets = [&](auto value) {
    return offset_t == DType::Int8 ? f(value, int8_t{}) : f(value, int32_t{});
  };
  if (t == DType::BFloat16) return as_offsets(Bf16{});
  return t == DType::Float32 ? as_offsets(float{}) : as_offsets(double{});
}

void check_types(const char* op, DType t, DType offset_t) {
  KILN_CHECK(supports_max_pool_offsets(t) && (offset_t == DType::Int8 || offset_t == DType::Int32), op,
             "takes float32, float64 or bfloat16 values and int8 or int32 offsets; got {} and {}", dtype_name(t),
             dtype_name(offset_t));
}

#undef AVX512

}  // namespace

bool supports_max_pool_offsets(DType t) {
  return t == DType::Float32 || t == DType::Float64 || t == DType::BFloat16;
}

void max_pool_offsets(DType t, DType offset_t, const void* x, void* out, int64_t planes, int64_t OH, int64_t OW,
                      int64_t kh, int64_t kw) {
  check_types("max_pool_offsets", t, offset_t);
  with_types(t, offset_t, [&](auto value, auto offset) {
    using T = decltype(value);
    using O = decltype(offset);
    offsets(static_cast<const T*>(x), static_cast<O*>(out), planes, OH, OW, kh, kw);
  });
}

namespace {

// by_window<Scatter> on typed pointers; an offset outside its window is an error naming `op`.
template <bool Scatter>
void run_by_window(const char* op, DType t, DType offset_t, const void* in, const void* offsets, void* out,
                   int64_t planes, int64_t OH, int64_t OW, int64_t kh, int64_t kw) {
  check_types(op, t, offset_t);
  const bool ok = with_types(t, offset_t, [&](auto value, auto offset) {
    using T = decltype(value);
    using O = decltype(offset);
    return by_window<Scatter>(static_cast<const T*>(in), static_cast<const O*>(offsets), static_cast<T*>(out), planes,
                              OH, OW, kh, kw);
  });
  KILN_CHECK(ok, op, "an offset lies outside its ({}, {}) window of a ({}, {}) plane; offsets come from "
             "max_pool_offsets of the input pooled", kh, kw, OH * kh, OW * kw);
}

}  // namespace

void max_pool_gather(DType t, DType offset_t, const void* x, const void* offsets, void* out, int64_t planes,
                     int64_t OH, int64_t OW, int64_t kh, int64_t kw) {
  run_by_window<false>("max_pool_gather", t, offset_t, x, offsets, out, planes, OH, OW, kh, kw);
}

void max_pool_scatter(DType t, DType offset_t, const void* g, const void* offsets, void* out, int64_t planes,
                      int64_t OH, int64_t OW, int64_t kh, int64_t kw) {
  run_by_window<true>("max_pool_scatter", t, offset_t, g, offsets, out, planes, OH, OW, kh, kw);
}

}  // namespace kiln::cpu
