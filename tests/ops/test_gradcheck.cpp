// Gradient checks of every differentiable op in ops/ops.h: kiln::grad against central finite
// differences in float64 (tests/support/gradcheck.h). Inputs stay away from kinks (abs at 0,
// max ties, relu at 0) unless a test is about them; shapes are tiny so each check stays fast.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "core/autograd.h"
#include "ops/ops.h"
#include "tests/support/gradcheck.h"

using kiln::DType;
using kiln::Tensor;
using kiln::testing::away_from_zero;
using kiln::testing::distinct;
using kiln::testing::gradcheck;
using kiln::testing::uniform;
using Inputs = std::vector<Tensor>;

namespace {

Tensor index64(const std::vector<int64_t>& values, kiln::Shape shape) {
  return kiln::from_vector<int64_t>(values, std::move(shape));
}

}  // namespace

TEST_CASE("gradcheck passes a correct gradient and catches a wrong one", "[gradcheck]") {
  auto square = [](const Inputs& x) { return x[0] * x[0]; };
  CHECK(gradcheck(square, {uniform({2, 3}, -1, 1, 1)}).ok);
  // detach() hides half of d(x*x)/dx from autograd: the analytic gradient is x, not 2x.
  auto half_hidden = [](const Inputs& x) { return x[0] * x[0].detach(); };
  auto result = gradcheck(half_hidden, {uniform({2, 3}, 0.5, 1, 2)});
  CHECK_FALSE(result.ok);
  CHECK_THAT(result.report, Catch::Contains("FAIL"));
}

TEST_CASE("gradients of unary ops", "[gradcheck][elementwise]") {
  Tensor any = uniform({2, 3}, -2, 2, 10);
  Tensor positive = uniform({2, 3}, 0.3, 3, 11);
  Tensor nonzero = away_from_zero({2, 3}, 0.2, 2, 12);
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::neg(x[0]); }, {any});
  CHECK_GRADIENTS([](const Inputs& x) { return -x[0] * x[0]; }, {any});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::exp(x[0]); }, {any});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::log(x[0]); }, {positive});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::sqrt(x[0]); }, {positive});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::rsqrt(x[0]); }, {positive});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::sin(x[0]); }, {any});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::cos(x[0]); }, {any});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::tanh(x[0]); }, {any});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::erf(x[0]); }, {any});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::abs(x[0]); }, {nonzero});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::reciprocal(x[0]); }, {nonzero});
  // Tensor methods route to the same ops.
  CHECK_GRADIENTS([](const Inputs& x) { return x[0].abs().sqrt().log().tanh(); }, {nonzero});
}

TEST_CASE("gradients of unary ops on non-contiguous views", "[gradcheck][elementwise][view]") {
  Tensor x = uniform({3, 4}, 0.3, 2, 20);
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::exp(v[0].t()) * kiln::log(v[0].t()); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::sqrt(v[0].slice(1, 1, 4, 2)); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::sin(v[0].t().slice(0, -3, 4)) * 2.0; }, {x});
}

TEST_CASE("gradient of cast between float types", "[gradcheck][elementwise]") {
  // float64 -> float32 -> float64: the rounding makes finite differences coarse, so use a wide step.
  kiln::testing::GradcheckOptions coarse;
  coarse.eps = 1e-3;
  coarse.atol = 1e-3;
  coarse.rtol = 1e-3;
  auto round_trip = [](const Inputs& x) {
    Tensor y = kiln::cast(x[0], DType::Float32);
    return kiln::cast(y * y, DType::Float64);
  };
  CHECK_GRADIENTS(round_trip, {uniform({2, 3}, -2, 2, 30)}, coarse);
  // The gradient reaching a float64 leaf through a float32 cast is float64.
  Tensor x = uniform({3}, -1, 1, 31).requires_grad_();
  Tensor g = kiln::grad(kiln::sum(kiln::cast(x, DType::Float32)), {x})[0];
  CHECK(g.dtype() == DType::Float64);
  CHECK(g.to_doubles() == std::vector<double>{1, 1, 1});
  // An integer cast stops the gradient: floor-like steps have zero derivative.
  auto through_int = [](const Inputs& v) {
    return kiln::cast(kiln::cast(v[0] * 3.0, DType::Int64), DType::Float64) + v[0];
  };
  CHECK_GRADIENTS(through_int, {kiln::from_vector<double>({0.1, 0.45, 1.2, -0.7}, {4})});
}

TEST_CASE("gradients of binary ops", "[gradcheck][elementwise]") {
  Tensor a = uniform({2, 3}, -2, 2, 40), b = uniform({2, 3}, -2, 2, 41);
  Tensor b_nonzero = away_from_zero({2, 3}, 0.5, 2, 42);
  CHECK_GRADIENTS([](const Inputs& x) { return x[0] + x[1]; }, {a, b});
  CHECK_GRADIENTS([](const Inputs& x) { return x[0] - x[1]; }, {a, b});
  CHECK_GRADIENTS([](const Inputs& x) { return x[0] * x[1]; }, {a, b});
  CHECK_GRADIENTS([](const Inputs& x) { return x[0] / x[1]; }, {a, b_nonzero});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::add(x[0], x[1]) * kiln::sub(x[0], x[1]); }, {a, b});
  // A value used by several consumers accumulates its gradient.
  CHECK_GRADIENTS([](const Inputs& x) { return x[0] * x[0] * x[0] + x[0] / x[1] - x[1]; }, {a, b_nonzero});
  // Operators with plain numbers.
  CHECK_GRADIENTS([](const Inputs& x) { return (2.0 - x[0]) * 3.0 + 1.5 / x[1] - x[0] / 4.0 + (x[0] + 0.5); },
                  {a, b_nonzero});
}

TEST_CASE("gradients of broadcasting binary ops", "[gradcheck][elementwise][broadcast]") {
  Tensor col = uniform({3, 1}, -2, 2, 50), row = uniform({1, 4}, -2, 2, 51);
  Tensor row_nonzero = away_from_zero({4}, 0.5, 2, 52);
  CHECK_GRADIENTS([](const Inputs& x) { return x[0] + x[1]; }, {col, row});
  CHECK_GRADIENTS([](const Inputs& x) { return x[0] - x[1]; }, {col, row});
  CHECK_GRADIENTS([](const Inputs& x) { return x[0] * x[1]; }, {col, row});
  CHECK_GRADIENTS([](const Inputs& x) { return x[0] / x[1]; }, {col, row_nonzero});  // (3,1) / (4,)
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::maximum(x[0], x[1]); }, {col, distinct({1, 4}, 0.37, 53)});
  // A 0-d operand and a transposed one.
  CHECK_GRADIENTS([](const Inputs& x) { return x[0].t() * x[1] + x[1]; },
                  {uniform({4, 3}, -1, 1, 54), uniform({}, -1, 1, 55)});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::broadcast_to(x[0], {2, 3, 4}) * x[1]; },
                  {uniform({3, 1}, -1, 1, 56), uniform({2, 1, 4}, -1, 1, 57)});
}

TEST_CASE("gradients of pow", "[gradcheck][elementwise]") {
  Tensor base = uniform({2, 3}, 0.3, 2, 60), exponent = uniform({2, 3}, -2, 2, 61);
  Tensor any = away_from_zero({2, 3}, 0.3, 2, 62);
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::pow(x[0], x[1]); }, {base, exponent});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::pow(x[0], x[1]); },
                  {uniform({3, 1}, 0.5, 2, 63), uniform({1, 2}, -1, 2, 64)});
  for (double e : {2.5, -1.5, 0.5, -1.0, 2.0, 1.0, 0.0})
    CHECK_GRADIENTS([e](const Inputs& x) { return kiln::pow(x[0], e) * x[0]; }, {base});
  // Integer exponents of negative bases.
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::pow(x[0], 3.0); }, {any});
  CHECK_GRADIENTS([](const Inputs& x) { return x[0].pow(-2.0); }, {any});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::pow(x[0], kiln::scalar(3.0, DType::Float64)); }, {any});
}

TEST_CASE("gradients of maximum, minimum, clamp and where", "[gradcheck][elementwise]") {
  Tensor a = distinct({2, 3}, 0.5, 70), b = distinct({2, 3}, 0.5, 71);
  b = b + 0.1;  // no ties with a: a's values are k*0.5 + [0, 0.125), b's are shifted by 0.1
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::maximum(x[0], x[1]); }, {a, b});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::minimum(x[0], x[1]); }, {a, b});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::minimum(x[0], x[1] * x[1]); }, {a, b});
  // Ties split the gradient evenly, which is also what central differences measure.
  Tensor t = kiln::from_vector<double>({1.0, -2.0, 3.0, 0.5}, {4});
  Tensor u = kiln::from_vector<double>({1.0, -1.0, 3.0, 0.25}, {4});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::maximum(x[0], x[1]); }, {t, u});
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::minimum(x[0], x[1]); }, {t, u});

  Tensor c = kiln::from_vector<double>({-1.7, -0.6, 0.2, 0.4, 0.75, 1.9}, {2, 3});  // none near -0.5 or 0.8
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::clamp(x[0], -0.5, 0.8) * x[0]; }, {c});

  Tensor cond = kiln::from_vector<bool>({true, false, false, true, true, false}, {2, 3});
  CHECK_GRADIENTS([cond](const Inputs& x) { return kiln::where(cond, x[0] * x[0], x[1]); }, {a, b});
  // Broadcast condition and branches: (3, 1) condition, (1, 4) and 0-d values.
  Tensor col_cond = kiln::from_vector<bool>({true, false, true}, {3, 1});
  CHECK_GRADIENTS([col_cond](const Inputs& x) { return kiln::where(col_cond, x[0], x[1]); },
                  {uniform({1, 4}, -1, 1, 72), uniform({}, -1, 1, 73)});
  // A condition computed from the input itself.
  CHECK_GRADIENTS([](const Inputs& x) { return kiln::where(x[0] > x[1], x[0] - x[1], x[1] * 2.0); }, {a, b});
}

TEST_CASE("gradients of reshape, permute, transpose and flatten", "[gradcheck][movement]") {
  Tensor x = uniform({2, 3, 4}, -1, 1, 80);
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::exp(kiln::reshape(v[0], {4, 6})); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::reshape(v[0], {-1, 2}) * 2.0; }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::sin(kiln::permute(v[0], {2, 0, 1})); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::permute(v[0], {1, 2, 0}).reshape({12, 2}); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::transpose(v[0], 0, 2) * kiln::transpose(v[0], -1, 0); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::flatten(v[0], 1) * 3.0; }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::tanh(kiln::flatten(v[0])); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::flatten(v[0].t(), 0, 1); }, {uniform({3, 4}, -1, 1, 81)});
}

TEST_CASE("gradients of expand, unsqueeze and squeeze", "[gradcheck][movement]") {
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::exp(kiln::expand(v[0], {2, 3, 4})); },
                  {uniform({3, 1}, -1, 1, 90)});
  CHECK_GRADIENTS([](const Inputs& v) { return v[0].expand({4, -1}) * v[0].expand({4, 3}); },
                  {uniform({3}, -1, 1, 91)});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::broadcast_to(v[0], {2, 3}); }, {uniform({}, -1, 1, 92)});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::unsqueeze(v[0], 1) * kiln::unsqueeze(v[0], 0); },
                  {uniform({3}, -1, 1, 93)});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::squeeze(v[0], 1) * kiln::squeeze(v[0], -2); },
                  {uniform({3, 1, 2}, -1, 1, 94)});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::unsqueeze(v[0], -1).expand({3, 2, 4}); },
                  {uniform({3, 2}, -1, 1, 95)});
}

TEST_CASE("gradients of slice", "[gradcheck][movement]") {
  Tensor x = uniform({5, 6}, -1, 1, 100);
  auto sq = [](const Tensor& t) { return t * t; };
  CHECK_GRADIENTS([sq](const Inputs& v) { return sq(v[0].slice(0, 1, 4)); }, {x});
  CHECK_GRADIENTS([sq](const Inputs& v) { return sq(v[0].slice(1, 0, 6, 2)); }, {x});
  CHECK_GRADIENTS([sq](const Inputs& v) { return sq(v[0].slice(1, 1, 6, 2)); }, {x});   // ends on the last column
  CHECK_GRADIENTS([sq](const Inputs& v) { return sq(v[0].slice(0, 0, 5, 3)); }, {x});   // rows 0, 3
  CHECK_GRADIENTS([sq](const Inputs& v) { return sq(v[0].slice(0, 1, 5, 4)); }, {x});   // one row
  CHECK_GRADIENTS([sq](const Inputs& v) { return sq(v[0].slice(1, -4, -1)); }, {x});   // negative start/stop
  CHECK_GRADIENTS([sq](const Inputs& v) { return sq(v[0].slice(0, -3, 5, 2)); }, {x});
  CHECK_GRADIENTS([sq](const Inputs& v) { return sq(v[0].slice(0, 1, 100).slice(1, 2, 5, 2)); }, {x});
  // Slices of a transposed view, and two overlapping slices of one tensor.
  CHECK_GRADIENTS([sq](const Inputs& v) { return sq(v[0].t().slice(0, 1, 5, 3).slice(1, 1, 4)); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return v[0].slice(1, 0, 4) * v[0].slice(1, 2, 6); }, {x});
  CHECK_GRADIENTS([sq](const Inputs& v) { return sq(kiln::slice(v[0], 0, 1, 3, 1)); }, {uniform({4}, -1, 1, 101)});
}

TEST_CASE("gradients of pad and concat", "[gradcheck][movement]") {
  Tensor x = uniform({2, 3}, -1, 1, 110);
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::exp(kiln::pad(v[0], {{1, 2}, {0, 1}})); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::pad(v[0] * v[0], {{0, 0}, {2, 0}}); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::pad(v[0].t(), {{1, 1}}); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::concat({v[0], v[1] * v[1], v[0]}, 0); },
                  {x, uniform({1, 3}, -1, 1, 111)});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::sin(kiln::concat({v[0], v[1]}, -1)); },
                  {x, uniform({2, 2}, -1, 1, 112)});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::concat({v[0].t(), v[1]}, 1); },
                  {x, uniform({3, 1}, -1, 1, 113)});
}

TEST_CASE("gradients of sum and mean", "[gradcheck][reduce]") {
  Tensor x = uniform({2, 3, 4}, -1, 1, 120);
  auto sq = [](const Tensor& t) { return t * t; };
  CHECK_GRADIENTS([sq](const Inputs& v) { return kiln::sum(sq(v[0])); }, {x});
  for (bool keep : {false, true}) {
    CAPTURE(keep);
    CHECK_GRADIENTS([sq, keep](const Inputs& v) { return kiln::sum(sq(v[0]), {0}, keep); }, {x});
    CHECK_GRADIENTS([sq, keep](const Inputs& v) { return kiln::sum(sq(v[0]), {-1}, keep); }, {x});
    CHECK_GRADIENTS([sq, keep](const Inputs& v) { return kiln::sum(sq(v[0]), {2, 0}, keep); }, {x});
    CHECK_GRADIENTS([sq, keep](const Inputs& v) { return kiln::mean(sq(v[0]), {1}, keep); }, {x});
    CHECK_GRADIENTS([sq, keep](const Inputs& v) { return kiln::mean(sq(v[0]), {0, 1}, keep); }, {x});
  }
  CHECK_GRADIENTS([sq](const Inputs& v) { return sq(v[0]).mean(); }, {x});
  // A reduction of a transposed view feeding a broadcast.
  CHECK_GRADIENTS([](const Inputs& v) { return v[0] * kiln::sum(v[0].t(), {0}, true).t(); },
                  {uniform({3, 4}, -1, 1, 121)});
}

TEST_CASE("gradients of max and min", "[gradcheck][reduce]") {
  Tensor x = distinct({2, 3, 4}, 0.1, 130);
  for (bool keep : {false, true}) {
    CAPTURE(keep);
    CHECK_GRADIENTS([keep](const Inputs& v) { return kiln::max(v[0], {1}, keep); }, {x});
    CHECK_GRADIENTS([keep](const Inputs& v) { return kiln::max(v[0], {0, 2}, keep); }, {x});
    CHECK_GRADIENTS([keep](const Inputs& v) { return kiln::min(v[0], {-1}, keep); }, {x});
    CHECK_GRADIENTS([keep](const Inputs& v) { return kiln::min(v[0] * v[0], {0}, keep); }, {x});
  }
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::max(v[0]); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::min(v[0]); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return v[0].t().max({1}); }, {distinct({3, 4}, 0.1, 131)});
  // Tied maxima share the gradient evenly, as central differences do.
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::max(v[0], {1}); },
                  {kiln::from_vector<double>({1, 3, 3, 2, 5, 0, 5, 4}, {2, 4})});
}

TEST_CASE("gradients of var and logsumexp", "[gradcheck][reduce]") {
  Tensor x = uniform({3, 4}, -2, 2, 140);
  for (bool keep : {false, true})
    for (bool unbiased : {false, true}) {
      CAPTURE(keep, unbiased);
      CHECK_GRADIENTS([=](const Inputs& v) { return kiln::var(v[0], {1}, keep, unbiased); }, {x});
      CHECK_GRADIENTS([=](const Inputs& v) { return kiln::var(v[0], {0}, keep, unbiased); }, {x});
    }
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::var(v[0]); }, {x});
  for (bool keep : {false, true}) {
    CAPTURE(keep);
    CHECK_GRADIENTS([keep](const Inputs& v) { return kiln::logsumexp(v[0], {1}, keep); }, {x});
    CHECK_GRADIENTS([keep](const Inputs& v) { return kiln::logsumexp(v[0], {0, 1}, keep); }, {x});
  }
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::logsumexp(v[0].t() * 3.0, {-1}); }, {x});
}

TEST_CASE("gradients of gather, scatter_add and index_select", "[gradcheck][index]") {
  Tensor x = uniform({3, 4}, -1, 1, 150);
  Tensor rows = index64({2, 0, 1, 0, 2, 2, 1, 1}, {2, 4});  // axis 0: repeated rows
  Tensor cols = index64({3, 0, 3, 1, 1, 2}, {3, 2});        // axis 1: repeated columns
  CHECK_GRADIENTS([rows](const Inputs& v) { return kiln::gather(v[0] * v[0], 0, rows); }, {x});
  CHECK_GRADIENTS([cols](const Inputs& v) { return kiln::exp(kiln::gather(v[0], 1, cols)); }, {x});
  CHECK_GRADIENTS([cols](const Inputs& v) { return kiln::gather(v[0], -1, cols); }, {x});
  // An index smaller than the input in the other dims.
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::gather(v[0], 0, index64({2, 0, 0, 2}, {2, 2})); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::gather(v[0], 1, index64({3, 1, 0, 0}, {2, 2})); }, {x});
  // Gather from a transposed view.
  Tensor trows = index64({1, 3, 0, 2, 2, 0}, {2, 3});
  CHECK_GRADIENTS([trows](const Inputs& v) { return kiln::gather(v[0].t(), 0, trows); }, {x});

  Tensor src = uniform({3, 2}, -1, 1, 151);
  CHECK_GRADIENTS([cols](const Inputs& v) { return kiln::scatter_add({3, 4}, 1, cols, v[0] * v[0]); }, {src});
  CHECK_GRADIENTS([rows](const Inputs& v) { return kiln::sin(kiln::scatter_add({3, 5}, 0, rows, v[0])); },
                  {uniform({2, 4}, -1, 1, 152)});
  // scatter_add and gather are adjoint: a round trip through both.
  CHECK_GRADIENTS([cols](const Inputs& v) { return kiln::gather(kiln::scatter_add({3, 4}, 1, cols, v[0]), 1, cols); },
                  {src});

  Tensor pick = index64({2, 0, 2, 1}, {4});
  CHECK_GRADIENTS([pick](const Inputs& v) { return kiln::index_select(v[0], 0, pick) * 2.0; }, {x});
  CHECK_GRADIENTS([pick](const Inputs& v) { return kiln::tanh(kiln::index_select(v[0], 1, pick)); }, {x});
  Tensor pick32 = kiln::from_vector<int32_t>({3, 3, 1}, {3});
  CHECK_GRADIENTS([pick32](const Inputs& v) { return kiln::index_select(v[0].t(), 0, pick32); }, {x});
}

TEST_CASE("gradients of float64 matmul", "[gradcheck][matmul]") {
  auto mm = [](const Inputs& v) { return kiln::matmul(v[0], v[1]); };
  CHECK_GRADIENTS(mm, {uniform({3, 4}, -1, 1, 160), uniform({4, 2}, -1, 1, 161)});
  CHECK_GRADIENTS(mm, {uniform({2, 3, 4}, -1, 1, 162), uniform({2, 4, 2}, -1, 1, 163)});   // batched
  CHECK_GRADIENTS(mm, {uniform({2, 1, 2, 3}, -1, 1, 164), uniform({3, 3, 2}, -1, 1, 165)});  // broadcast batch
  CHECK_GRADIENTS(mm, {uniform({2, 2, 3}, -1, 1, 166), uniform({3, 4}, -1, 1, 167)});  // batch @ 2-d
  CHECK_GRADIENTS(mm, {uniform({2, 3}, -1, 1, 168), uniform({2, 3, 2}, -1, 1, 169)});  // 2-d @ batch
  CHECK_GRADIENTS(mm, {uniform({4}, -1, 1, 170), uniform({4, 3}, -1, 1, 171)});        // 1-d @ 2-d
  CHECK_GRADIENTS(mm, {uniform({3, 4}, -1, 1, 172), uniform({4}, -1, 1, 173)});        // 2-d @ 1-d
  CHECK_GRADIENTS(mm, {uniform({4}, -1, 1, 174), uniform({4}, -1, 1, 175)});           // dot product
  CHECK_GRADIENTS(mm, {uniform({2, 3, 4}, -1, 1, 176), uniform({4}, -1, 1, 177)});     // batch @ 1-d
  // Transposed and sliced operands.
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::matmul(v[0].t(), v[1].t()); },
                  {uniform({4, 3}, -1, 1, 178), uniform({2, 4}, -1, 1, 179)});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::matmul(v[0].slice(1, 0, 6, 2), v[1]).tanh(); },
                  {uniform({3, 6}, -1, 1, 180), uniform({3, 2}, -1, 1, 181)});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::matmul(v[0], v[0].t()); }, {uniform({3, 2}, -1, 1, 182)});
}

namespace {

// The gradient of a float32 function (oneDNN matmul) against the same function in float64, at the
// same (float32-rounded) point.
void check_float32_gradients(const kiln::testing::TensorFn& f, const Inputs& inputs) {
  std::vector<Tensor> rounded;
  for (const Tensor& t : inputs) rounded.push_back(kiln::cast(kiln::cast(t, DType::Float32), DType::Float64));
  auto g32 = kiln::testing::analytic_gradients(f, rounded, DType::Float32);
  auto g64 = kiln::testing::analytic_gradients(f, rounded, DType::Float64);
  // The float64 path is itself checked against finite differences.
  CHECK_GRADIENTS(f, rounded);
  REQUIRE(g32.size() == g64.size());
  for (size_t i = 0; i < g32.size(); ++i)
    for (size_t j = 0; j < g32[i].size(); ++j) {
      CAPTURE(i, j, g32[i][j], g64[i][j]);
      if (std::abs(g32[i][j] - g64[i][j]) > 1e-4 + 1e-4 * std::abs(g64[i][j])) FAIL_CHECK("float32 gradient differs");
    }
}

}  // namespace

TEST_CASE("gradients of float32 (oneDNN) matmul against float64", "[gradcheck][matmul][onednn]") {
  auto mm = [](const Inputs& v) { return kiln::matmul(v[0], v[1]); };
  check_float32_gradients(mm, {uniform({3, 4}, -1, 1, 190), uniform({4, 5}, -1, 1, 191)});
  check_float32_gradients(mm, {uniform({2, 3, 4}, -1, 1, 192), uniform({2, 4, 5}, -1, 1, 193)});
  check_float32_gradients(mm, {uniform({2, 3, 4}, -1, 1, 194), uniform({4, 5}, -1, 1, 195)});
  check_float32_gradients(mm, {uniform({3, 4}, -1, 1, 196), uniform({2, 4, 5}, -1, 1, 197)});
  check_float32_gradients(mm, {uniform({2, 1, 3, 4}, -1, 1, 198), uniform({3, 4, 2}, -1, 1, 199)});
  check_float32_gradients(mm, {uniform({4}, -1, 1, 200), uniform({4, 3}, -1, 1, 201)});
  check_float32_gradients(mm, {uniform({3, 4}, -1, 1, 202), uniform({4}, -1, 1, 203)});
  check_float32_gradients([](const Inputs& v) { return kiln::matmul(v[0].t(), v[1].t()); },
                          {uniform({4, 3}, -1, 1, 204), uniform({5, 4}, -1, 1, 205)});
  check_float32_gradients([](const Inputs& v) { return kiln::matmul(v[0].slice(1, 1, 7, 2), v[1]).tanh(); },
                          {uniform({3, 7}, -1, 1, 206), uniform({3, 2}, -1, 1, 207)});
}

TEST_CASE("gradients of activations", "[gradcheck][composite]") {
  Tensor x = away_from_zero({2, 4}, 0.1, 3, 210);  // no element at relu's kink
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::relu(v[0]); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return v[0].relu() * v[0]; }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::gelu(v[0]); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::gelu(v[0], true); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::sigmoid(v[0]); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::silu(v[0]); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::silu(v[0].t()); }, {x});
}

TEST_CASE("gradients of softmax and log_softmax", "[gradcheck][composite]") {
  Tensor x = uniform({3, 4}, -2, 2, 220);
  for (int64_t axis : {0, 1, -1}) {
    CAPTURE(axis);
    CHECK_GRADIENTS([axis](const Inputs& v) { return kiln::softmax(v[0], axis); }, {x});
    CHECK_GRADIENTS([axis](const Inputs& v) { return kiln::log_softmax(v[0], axis); }, {x});
  }
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::softmax(v[0].t() * 2.0, -1); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::log_softmax(v[0], 1); }, {uniform({2, 2, 3}, -2, 2, 221)});
}

TEST_CASE("gradients of layer_norm", "[gradcheck][composite]") {
  Tensor x = uniform({2, 5}, -2, 2, 230);
  Tensor w = uniform({5}, 0.5, 1.5, 231), b = uniform({5}, -1, 1, 232);
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::layer_norm(v[0], {5}); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::layer_norm(v[0], {5}, v[1], v[2]); }, {x, w, b});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::layer_norm(v[0], {5}, v[1]); }, {x, w});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::layer_norm(v[0], {5}, {}, v[1]); }, {x, b});
  // Normalizing over two trailing dims, of a transposed input.
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::layer_norm(v[0].transpose(0, 2), {3, 2}, v[1], v[2]); },
                  {uniform({2, 3, 2}, -2, 2, 233), uniform({3, 2}, 0.5, 1.5, 234), uniform({3, 2}, -1, 1, 235)});
}

TEST_CASE("gradients of losses", "[gradcheck][composite]") {
  Tensor logits = uniform({4, 3}, -2, 2, 240);
  Tensor labels = index64({2, 0, 1, 2}, {4});
  Tensor labels32 = kiln::from_vector<int32_t>({1, 1, 0, 2}, {4});
  CHECK_GRADIENTS([labels](const Inputs& v) { return kiln::cross_entropy(v[0], labels); }, {logits});
  CHECK_GRADIENTS([labels32](const Inputs& v) { return kiln::cross_entropy(v[0], labels32); }, {logits});
  for (double smoothing : {0.1, 0.5}) {
    CAPTURE(smoothing);
    CHECK_GRADIENTS(
        [labels, smoothing](const Inputs& v) {
          return kiln::cross_entropy(v[0], labels, kiln::CrossEntropyOptions().label_smoothing(smoothing));
        },
        {logits});
  }
  CHECK_GRADIENTS(
      [labels](const Inputs& v) {
        return kiln::cross_entropy(v[0].t(), labels, kiln::CrossEntropyOptions().label_smoothing(0.2));
      },
      {uniform({3, 4}, -2, 2, 241)});
  // The per-row form (Reduction::None), weighted so that each row's gradient is checked apart.
  Tensor row_weights = uniform({4}, 0.5, 2, 244);
  CHECK_GRADIENTS(
      [labels, row_weights](const Inputs& v) {
        auto options = kiln::CrossEntropyOptions().label_smoothing(0.3).reduction(kiln::Reduction::None);
        return kiln::sum(kiln::cross_entropy(v[0], labels, options) * row_weights);
      },
      {logits});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::mse_loss(v[0], v[1]); }, {logits, uniform({4, 3}, -2, 2, 242)});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::mse_loss(v[0] * v[0], v[1].t()); },
                  {logits, uniform({3, 4}, -2, 2, 243)});
}

TEST_CASE("gradients reach every input of a small network", "[gradcheck][composite]") {
  // (N=3, D=4) -> linear (4, 5) + bias -> gelu -> layer_norm -> linear (5, 2) -> cross entropy
  auto net = [](const Inputs& v) {
    Tensor h = kiln::gelu(kiln::matmul(v[0], v[1]) + v[2]);
    h = kiln::layer_norm(h, {5});
    Tensor logits = kiln::matmul(h, v[3]);
    return kiln::cross_entropy(logits, index64({1, 0, 1}, {3}), kiln::CrossEntropyOptions().label_smoothing(0.1));
  };
  CHECK_GRADIENTS(net, {uniform({3, 4}, -1, 1, 250), uniform({4, 5}, -1, 1, 251), uniform({5}, -0.5, 0.5, 252),
                        uniform({5, 2}, -1, 1, 253)});
}
