// Helpers for forward tests: small tensors from literals, and an elementwise comparison that
// reports the first mismatches (with their inputs) through Catch.
//
//   Tensor x = kiln::testing::f32({1, 2, 3, 4}, {2, 2});
//   kiln::testing::check_close(kiln::exp(x), {std::exp(1.0), ...});  // rtol 1e-5, atol 1e-6
#pragma once
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "core/tensor.h"

namespace kiln::testing {

inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Whether cuda:0 can run (a GPU, or the emulator under KILN_CUDA_EMULATOR=1); if not, the case
// says it was skipped and why (CTest's "emulated." entries run the [device] cases on the emulator).
bool have_cuda();

Tensor f32(const std::vector<double>& values, Shape shape);
Tensor f32(const std::vector<double>& values);  // 1-d
Tensor i64(const std::vector<int64_t>& values, Shape shape);
Tensor i32(const std::vector<int32_t>& values, Shape shape);

// `got` against `want` elementwise: |got - want| <= atol + rtol * |want|; NaN matches only NaN and
// an infinity only the same infinity. A failure is one Catch CHECK listing the first mismatches,
// with inputs[i] when given.
void check_close(const Tensor& got, const std::vector<double>& want, double rtol = 1e-5, double atol = 1e-6,
                 const std::vector<double>& inputs = {});

// The value a double takes as float32 (beyond float range: inf).
inline double as_float(double v) { return static_cast<float>(v); }
std::vector<double> map_values(const std::vector<double>& x, const std::function<double(double)>& f);
// n float32-representable values evenly spaced from lo to hi.
std::vector<double> linspace(double lo, double hi, int n);

}  // namespace kiln::testing
