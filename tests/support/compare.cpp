// Forward-test helpers (see compare.h).
#include "tests/support/compare.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <cmath>
#include <string>

#include "ops/ops.h"

namespace kiln::testing {

bool have_cuda() {
  if (cuda::available()) return true;
  WARN("SKIPPED: no CUDA device (" << cuda::unavailable_reason() << "); KILN_CUDA_EMULATOR=1 runs these on the host");
  return false;
}

Tensor f32(const std::vector<double>& values, Shape shape) {
  return from_doubles(values, std::move(shape), DType::Float32);
}
Tensor f32(const std::vector<double>& values) { return f32(values, {static_cast<int64_t>(values.size())}); }
Tensor i64(const std::vector<int64_t>& values, Shape shape) { return from_vector<int64_t>(values, std::move(shape)); }
Tensor i32(const std::vector<int32_t>& values, Shape shape) { return from_vector<int32_t>(values, std::move(shape)); }

void check_close(const Tensor& got_tensor, const std::vector<double>& want, double rtol, double atol,
                 const std::vector<double>& inputs) {
  REQUIRE(got_tensor.numel() == static_cast<int64_t>(want.size()));
  std::vector<double> got = got_tensor.to_doubles();
  int failures = 0;
  std::string report;
  for (size_t i = 0; i < want.size(); ++i) {
    double g = got[i], w = want[i];
    bool ok = std::isnan(w)   ? std::isnan(g)
              : std::isinf(w) ? g == w
                              : std::isfinite(g) && std::abs(g - w) <= atol + rtol * std::abs(w);
    if (!ok && ++failures <= 12)
      report += fmt::format("element {}{}: got {:.9g}, want {:.9g}\n", i,
                            i < inputs.size() ? fmt::format(" (x = {:.9g})", inputs[i]) : std::string(), g, w);
  }
  INFO(got_tensor.str() << ", " << failures << " mismatches:\n" << report);
  CHECK(failures == 0);
}

std::vector<double> map_values(const std::vector<double>& x, const std::function<double(double)>& f) {
  std::vector<double> out;
  for (double v : x) out.push_back(f(v));
  return out;
}

std::vector<double> linspace(double lo, double hi, int n) {
  std::vector<double> v;
  for (int i = 0; i < n; ++i) v.push_back(as_float(lo + (hi - lo) * i / (n - 1)));
  return v;
}

}  // namespace kiln::testing
