// The float32 fast math of backends/cpu/cpu_prelude.h (exp, log, tanh, erf) against libm over its whole
// range: overflow, underflow, subnormals, infinities and NaN included.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "ops/ops.h"
#include "tests/support/compare.h"

using kiln::Tensor;
using kiln::testing::as_float;
using kiln::testing::check_close;
using kiln::testing::f32;
using kiln::testing::kInf;
using kiln::testing::kNaN;
using kiln::testing::linspace;
using kiln::testing::map_values;

TEST_CASE("float32 exp over its whole range", "[forward][elementwise][fastmath]") {
  std::vector<double> x = linspace(-87.0, 88.0, 301);
  for (double v : {0.0, -0.0, 1e-8, -1e-8, 1e-30, 0.5, -0.5, 20.25, -87.3, -87.33, 88.3, 88.5, 88.7, 88.72})
    x.push_back(as_float(v));
  check_close(kiln::exp(f32(x)), map_values(x, [](double v) { return as_float(std::exp(v)); }), 2e-6, 0, x);
}

TEST_CASE("float32 exp at the ends: overflow, underflow, inf, NaN", "[forward][elementwise][fastmath]") {
  std::vector<double> x = {89.0, 100.0, 1e10, kInf, -88.0, -100.0, -1e4, -kInf, kNaN};
  // Below -87.34 the result is subnormal or zero; it need only be (close to) zero.
  std::vector<double> want = {kInf, kInf, kInf, kInf, std::exp(-88.0), 0, 0, 0, kNaN};
  check_close(kiln::exp(f32(x)), want, 0, 1e-37, x);
}

TEST_CASE("float32 log over its whole range", "[forward][elementwise][fastmath]") {
  std::vector<double> x;
  for (double e = -37; e <= 38; e += 0.25) x.push_back(as_float(std::pow(10.0, e)));
  for (double v : {1.0, 1.0000001, 0.9999999, 1.5, 2.0, 0.7071, 1.4142, 1.4143, 3.0, 1e-45, 1e-40, 3e-39})
    x.push_back(as_float(v));  // the last three are subnormal
  check_close(kiln::log(f32(x)), map_values(x, [](double v) { return std::log(v); }), 2e-6, 2e-7, x);
}

TEST_CASE("float32 log at the ends: 0, negatives, inf, NaN", "[forward][elementwise][fastmath]") {
  std::vector<double> x = {0.0, -0.0, -1.0, -1e-30, -kInf, kInf, kNaN};
  std::vector<double> want = {-kInf, -kInf, kNaN, kNaN, kNaN, kInf, kNaN};
  check_close(kiln::log(f32(x)), want, 0, 0, x);
}

TEST_CASE("float32 tanh and erf over a wide range", "[forward][elementwise][fastmath]") {
  std::vector<double> x = linspace(-12.0, 12.0, 241);
  for (double v : {1e-30, -1e-20, 1e-6, -1e-4, 0.0999, 0.1, 0.1001, 0.4999, 0.5, 0.5001, 30.0, -50.0, 1e30})
    x.push_back(as_float(v));
  std::vector<double> edges = {kInf, -kInf, kNaN};
  std::vector<double> all = x;
  all.insert(all.end(), edges.begin(), edges.end());
  Tensor t = kiln::tanh(f32(all)), e = kiln::erf(f32(all));
  kiln::sync({t, e});
  std::vector<double> want_tanh = map_values(x, [](double v) { return std::tanh(v); });
  std::vector<double> want_erf = map_values(x, [](double v) { return std::erf(v); });
  for (double v : {1.0, -1.0, kNaN}) want_tanh.push_back(v), want_erf.push_back(v);
  // Relative accuracy near 0 matters (tanh x ~ x); near +-1 an absolute float32 ulp is fine.
  check_close(t, want_tanh, 1e-5, 1e-7, all);
  check_close(e, want_erf, 1e-5, 1e-7, all);
}
