// Random ops: rand/randn determinism under kiln::manual_seed, distinct values per call, moments
// over 100k samples; dropout's drop fraction, scaling and identity cases.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "ops/ops.h"
#include "tests/support/compare.h"

using kiln::DType;
using kiln::Tensor;

TEST_CASE("rand and randn: determinism, distinct calls, moments", "[forward][random]") {
  const int64_t n = 100000;
  kiln::manual_seed(1234);
  Tensor u1 = kiln::rand({n}), u2 = kiln::rand({n});
  Tensor g1 = kiln::randn({n});
  Tensor d1 = kiln::randn({n}, DType::Float64);
  kiln::sync({u1, u2, g1, d1});
  kiln::manual_seed(1234);
  Tensor u1_again = kiln::rand({n});
  kiln::manual_seed(99);
  Tensor u_other = kiln::rand({n});
  kiln::sync({u1_again, u_other});
  std::vector<float> a = u1.to_vector<float>(), b = u2.to_vector<float>();
  CHECK(a == u1_again.to_vector<float>());
  CHECK(a != b);
  CHECK(a != u_other.to_vector<float>());

  auto moments = [](const std::vector<double>& v) {
    double mean = 0, var = 0;
    for (double x : v) mean += x;
    mean /= static_cast<double>(v.size());
    for (double x : v) var += (x - mean) * (x - mean);
    return std::pair<double, double>{mean, var / static_cast<double>(v.size())};
  };
  for (const Tensor& u : {u1, u2, u_other}) {
    std::vector<double> v = u.to_doubles();
    auto [mean, var] = moments(v);
    CHECK(mean == Approx(0.5).margin(0.005));
    CHECK(var == Approx(1.0 / 12).margin(0.002));
    CHECK(*std::min_element(v.begin(), v.end()) >= 0.0);
    CHECK(*std::max_element(v.begin(), v.end()) < 1.0);
    // Neighbouring elements are uncorrelated.
    double cov = 0;
    for (size_t i = 1; i < v.size(); ++i) cov += (v[i] - mean) * (v[i - 1] - mean);
    CHECK(cov / static_cast<double>(v.size()) / var == Approx(0).margin(0.02));
  }
  for (const Tensor& g : {g1, d1}) {
    CAPTURE(g.str());
    std::vector<double> v = g.to_doubles();
    auto [mean, var] = moments(v);
    CHECK(mean == Approx(0).margin(0.015));
    CHECK(var == Approx(1).margin(0.02));
    int64_t within_one = std::count_if(v.begin(), v.end(), [](double x) { return std::abs(x) < 1; });
    CHECK(static_cast<double>(within_one) / n == Approx(0.6827).margin(0.01));
    CHECK(std::all_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); }));
  }
  CHECK(kiln::rand({4}, DType::Float64).dtype() == DType::Float64);
  CHECK_THROWS_AS(kiln::rand({4}, DType::Int32), kiln::Error);
}

TEST_CASE("dropout", "[forward][random]") {
  const int64_t n = 100000;
  kiln::manual_seed(7);
  Tensor x = kiln::ones({n}) * 2.0;
  for (double p : {0.1, 0.5}) {
    CAPTURE(p);
    std::vector<double> y = kiln::dropout(x, p).to_doubles();
    int64_t zeros = std::count(y.begin(), y.end(), 0.0);
    CHECK(static_cast<double>(zeros) / n == Approx(p).margin(0.01));
    const double kept = 2.0 / (1.0 - p);
    CHECK(std::all_of(y.begin(), y.end(),
                      [&](double v) { return v == 0.0 || std::abs(v - kept) <= 1e-6 * kept; }));
  }
  // Two calls drop different elements.
  CHECK(kiln::dropout(x, 0.5).to_doubles() != kiln::dropout(x, 0.5).to_doubles());
  // Identity when not training or p = 0.
  CHECK(kiln::dropout(x, 0.5, false).node() == x.node());
  CHECK(kiln::dropout(x, 0.0).node() == x.node());
  CHECK_THROWS_AS(kiln::dropout(x, 1.0), kiln::Error);
  CHECK_THROWS_AS(kiln::dropout(x, -0.1), kiln::Error);
}
