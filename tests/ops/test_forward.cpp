// Forward values of elementwise, dtype, cast, creation, movement, indexing, matmul and composite
// ops against plain loops and closed forms, in float32, integer, bool and half-precision types.
// Reductions, the fast float32 math, random ops and error messages have files of their own.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "core/dtype.h"
#include "ops/ops.h"
#include "tests/support/compare.h"
#include "tests/support/mlp.h"

using kiln::DType;
using kiln::Shape;
using kiln::Tensor;
using namespace kiln::testing;  // check_close, f32/i32/i64, kInf, kNaN, Index3, ...


TEST_CASE("float32 unary ops against libm", "[forward][elementwise]") {
  std::vector<double> x = {-3.7, -2.5, -1.0, -0.3, -1e-3, 1e-3, 0.25, 0.5, 1.0, 2.0, 3.3, 7.5};
  for (double& v : x) v = as_float(v);
  Tensor t = f32(x, {3, 4});
  Tensor pos = kiln::abs(t);
  std::vector<Tensor> outs = {kiln::neg(t),  kiln::sqrt(pos),      kiln::rsqrt(pos),        kiln::sin(t),
                              kiln::cos(t),  kiln::abs(t),         kiln::reciprocal(t),     kiln::sign(t),
                              kiln::floor(t), kiln::sigmoid(t),    kiln::relu(t),           kiln::silu(t),
                              kiln::gelu(t), kiln::gelu(t, true), kiln::clamp(t, -1.0, 2.0), -t * 2.0 + 1.0};
  kiln::sync(outs);
  const double k = std::sqrt(2.0 / M_PI);
  std::vector<std::function<double(double)>> refs = {
      [](double v) { return -v; },
      [](double v) { return std::sqrt(std::abs(v)); },
      [](double v) { return 1.0 / std::sqrt(std::abs(v)); },
      [](double v) { return std::sin(v); },
      [](double v) { return std::cos(v); },
      [](double v) { return std::abs(v); },
      [](double v) { return 1.0 / v; },
      [](double v) { return v > 0 ? 1.0 : (v < 0 ? -1.0 : 0.0); },
      [](double v) { return std::floor(v); },
      [](double v) { return 1.0 / (1.0 + std::exp(-v)); },
      [](double v) { return v > 0 ? v : 0.0; },
      [](double v) { return v / (1.0 + std::exp(-v)); },
      [](double v) { return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0))); },
      [k](double v) { return 0.5 * v * (1.0 + std::tanh(k * (v + 0.044715 * v * v * v))); },
      [](double v) { return std::min(std::max(v, -1.0), 2.0); },
      [](double v) { return -v * 2.0 + 1.0; },
  };
  REQUIRE(refs.size() == outs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    CAPTURE(i);
    CHECK(outs[i].dtype() == DType::Float32);
    CHECK(outs[i].shape() == Shape{3, 4});
    check_close(outs[i], map_values(x, refs[i]), 1e-5, 1e-6, x);
  }
}

TEST_CASE("float32 erf and exp stay within their documented error over a dense grid", "[forward][elementwise]") {
  // 2^20 points on [-6, 6] (erf) and [-80, 80] (exp): relative error against the double libm.
  constexpr int64_t n = int64_t{1} << 20;
  Tensor u = iota({n}, 0, DType::Float32) * (1.0 / static_cast<double>(n - 1));
  Tensor xe = (u * 12.0 - 6.0).realize(), xx = (u * 160.0 - 80.0).realize();
  std::vector<float> ae = xe.to_vector<float>(), ax = xx.to_vector<float>();
  std::vector<float> e = kiln::erf(xe).to_vector<float>(), x = kiln::exp(xx).to_vector<float>();
  double worst_erf = 0, worst_exp = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double r = std::erf(static_cast<double>(ae[i]));
    if (r != 0) worst_erf = std::max(worst_erf, std::abs(e[i] - r) / std::abs(r));
    const double q = std::exp(static_cast<double>(ax[i]));
    worst_exp = std::max(worst_exp, std::abs(x[i] - q) / q);
  }
  CHECK(worst_erf < 4e-7);  // backends/cpu/cpu_prelude.h: 3.9e-7 at worst over every float in [-5, 5]
  CHECK(worst_exp < 2.5e-7);
}

TEST_CASE("float32 binary ops with broadcasting", "[forward][elementwise][broadcast]") {
  std::vector<double> a = {-1.5, 0.5, 2.0}, b = {0.25, -2.0, 3.0, 1.5};
  Tensor ta = f32(a, {3, 1}), tb = f32(b, {1, 4});
  std::vector<Tensor> outs = {ta + tb, ta - tb, ta * tb, ta / tb, kiln::maximum(ta, tb), kiln::minimum(ta, tb),
                              kiln::pow(kiln::abs(ta), tb), 1.0 / tb - ta};
  kiln::sync(outs);
  std::vector<std::function<double(double, double)>> refs = {
      [](double x, double y) { return x + y; },          [](double x, double y) { return x - y; },
      [](double x, double y) { return x * y; },          [](double x, double y) { return x / y; },
      [](double x, double y) { return std::max(x, y); }, [](double x, double y) { return std::min(x, y); },
      [](double x, double y) { return std::pow(std::abs(x), y); },
      [](double x, double y) { return 1.0 / y - x; }};
  for (size_t n = 0; n < outs.size(); ++n) {
    CAPTURE(n);
    REQUIRE(outs[n].shape() == Shape{3, 4});
    std::vector<double> want;
    for (double x : a)
      for (double y : b) want.push_back(refs[n](x, y));
    check_close(outs[n], want);
  }
  // A transposed operand and a 0-d one.
  Tensor m = f32({1, 2, 3, 4, 5, 6}, {2, 3});
  check_close(m.t() * f32({10, 100}, {2}) + kiln::scalar(0.5), {10.5, 400.5, 20.5, 500.5, 30.5, 600.5});
  // NaN propagates through maximum/minimum from either side.
  check_close(kiln::maximum(f32({kNaN, 1.0}), f32({1.0, kNaN})), {kNaN, kNaN}, 0, 0);
  check_close(kiln::minimum(f32({kNaN, 1.0}), f32({1.0, kNaN})), {kNaN, kNaN}, 0, 0);
}

TEST_CASE("comparisons and logical ops give bool", "[forward][elementwise][dtype]") {
  Tensor a = f32({1, 2, 3, 4}), b = f32({4, 2, 1, 4});
  std::vector<Tensor> outs = {kiln::lt(a, b), kiln::le(a, b), kiln::gt(a, b), kiln::ge(a, b),
                              kiln::eq(a, b), kiln::ne(a, b), a < b,          a > b};
  kiln::sync(outs);
  std::vector<std::vector<bool>> want = {{1, 0, 0, 0}, {1, 1, 0, 1}, {0, 0, 1, 0}, {0, 1, 1, 1},
                                         {0, 1, 0, 1}, {1, 0, 1, 0}, {1, 0, 0, 0}, {0, 0, 1, 0}};
  for (size_t i = 0; i < outs.size(); ++i) {
    CAPTURE(i);
    CHECK(outs[i].dtype() == DType::Bool);
    CHECK(outs[i].to_vector<bool>() == want[i]);
  }
  Tensor p = kiln::from_vector<bool>({true, true, false, false}, {4});
  Tensor q = kiln::from_vector<bool>({true, false, true, false}, {4});
  CHECK(kiln::logical_and(p, q).to_vector<bool>() == std::vector<bool>{1, 0, 0, 0});
  CHECK(kiln::logical_or(p, q).to_vector<bool>() == std::vector<bool>{1, 1, 1, 0});
  CHECK(kiln::logical_not(p).to_vector<bool>() == std::vector<bool>{0, 0, 1, 1});
  // Integers count as true when nonzero.
  CHECK(kiln::logical_and(i64({0, 3, -2, 0}, {4}), i64({5, 0, 7, 0}, {4})).to_vector<bool>() ==
        std::vector<bool>{0, 0, 1, 0});
  // Integer comparisons, broadcast against a scalar.
  CHECK(kiln::ge(i32({-3, 0, 7}, {3}), kiln::scalar(0, DType::Int32)).to_vector<bool>() == std::vector<bool>{0, 1, 1});
}

TEST_CASE("comparison operators <=, >=, == and != match le, ge, eq and ne", "[forward][elementwise][dtype]") {
  // Mixed equal and unequal pairs, a broadcast row and integers: every operator against its
  // named op and against the expected truth table.
  Tensor a = f32({1, 2, 3, 4}), b = f32({4, 2, 1, 4});
  std::vector<Tensor> outs = {a <= b, a >= b, a == b, a != b};
  kiln::sync(outs);
  std::vector<std::vector<bool>> want = {{1, 1, 0, 1}, {0, 1, 1, 1}, {0, 1, 0, 1}, {1, 0, 1, 0}};
  for (size_t i = 0; i < outs.size(); ++i) {
    CAPTURE(i);
    CHECK(outs[i].dtype() == DType::Bool);
    CHECK(outs[i].to_vector<bool>() == want[i]);
  }
  Tensor m = f32({1, 5, 3, 2, 2, 7}, {2, 3}), row = f32({2, 5, 3}, {3});  // (2, 3) against (3)
  CHECK((m <= row).to_vector<bool>() == kiln::le(m, row).to_vector<bool>());
  CHECK((m >= row).to_vector<bool>() == std::vector<bool>{0, 1, 1, 1, 0, 1});
  CHECK((m == row).to_vector<bool>() == std::vector<bool>{0, 1, 1, 1, 0, 0});
  CHECK((m != row).to_vector<bool>() == std::vector<bool>{1, 0, 0, 0, 1, 1});
  Tensor ints = i64({-1, 0, 7}, {3}), zero = kiln::scalar(0, DType::Int64);
  CHECK((ints == zero).to_vector<bool>() == std::vector<bool>{0, 1, 0});
  CHECK((ints != zero).to_vector<bool>() == std::vector<bool>{1, 0, 1});
  CHECK((ints <= zero).to_vector<bool>() == std::vector<bool>{1, 1, 0});
  CHECK((ints >= zero).to_vector<bool>() == std::vector<bool>{0, 1, 1});
  // Operands that need gradients compare the same (the comparison passes no gradient back).
  Tensor w = f32({0.5, -1}, {2}).requires_grad_();
  CHECK((w >= kiln::zeros_like(w)).to_vector<bool>() == std::vector<bool>{1, 0});
}

TEST_CASE("integer arithmetic and dtype promotion", "[forward][elementwise][dtype]") {
  Tensor a = i32({7, -7, 3, 100000}, {4}), b = i32({2, 2, -4, 3}, {4});
  Tensor sum = a + b, prod = a * b, diff = a - b, q = a / b, neg = -a, mag = kiln::abs(a);
  kiln::sync({sum, prod, diff, q, neg, mag});
  CHECK(sum.dtype() == DType::Int32);
  CHECK(sum.to_vector<int32_t>() == std::vector<int32_t>{9, -5, -1, 100003});
  CHECK(prod.to_vector<int32_t>() == std::vector<int32_t>{14, -14, -12, 300000});
  CHECK(diff.to_vector<int32_t>() == std::vector<int32_t>{5, -9, 7, 99997});
  CHECK(neg.to_vector<int32_t>() == std::vector<int32_t>{-7, 7, -3, -100000});
  CHECK(mag.to_vector<int32_t>() == std::vector<int32_t>{7, 7, 3, 100000});
  // Integer division is true division in float32.
  CHECK(q.dtype() == DType::Float32);
  check_close(q, {3.5, -3.5, -0.75, 100000.0 / 3});

  Tensor big = i64({int64_t{1} << 40, -(int64_t{1} << 41)}, {2});
  CHECK((big * 2).to_vector<int64_t>() == std::vector<int64_t>{int64_t{1} << 41, -(int64_t{1} << 42)});
  CHECK((big * 2).dtype() == DType::Int64);
  CHECK((a * 2.5).dtype() == DType::Float32);  // a fractional number makes an int tensor float32
  check_close(a * 2.5, {17.5, -17.5, 7.5, 250000});
  CHECK((a + f32({0.5, 0.5, 0.5, 0.5})).dtype() == DType::Float32);
  Tensor u8 = kiln::from_vector<uint8_t>({200, 3}, {2}), s8 = kiln::from_vector<int8_t>({-100, 4}, {2});
  Tensor mixed = u8 + s8;
  CHECK(mixed.dtype() == DType::Int32);
  CHECK(mixed.to_vector<int32_t>() == std::vector<int32_t>{100, 7});
  Tensor half = kiln::from_doubles({1.5, -2}, {2}, DType::Float16);
  Tensor brain = kiln::from_doubles({0.25, 4}, {2}, DType::BFloat16);
  CHECK((half + brain).dtype() == DType::Float32);
  check_close(half + brain, {1.75, 2});
  CHECK((half * half).dtype() == DType::Float16);
  check_close(half * half, {2.25, 4});
  // Transcendental ops of integers compute in float32.
  CHECK(kiln::exp(i32({0, 1}, {2})).dtype() == DType::Float32);
  check_close(kiln::sqrt(i64({4, 9}, {2})), {2, 3});
}

TEST_CASE("where with float, integer and broadcast operands", "[forward][elementwise][dtype]") {
  Tensor c = kiln::from_vector<bool>({true, false, true}, {3, 1});
  Tensor a = f32({1, 2, 3, 4}, {1, 4}), b = kiln::scalar(-1.0);
  check_close(kiln::where(c, a, b), {1, 2, 3, 4, -1, -1, -1, -1, 1, 2, 3, 4});
  Tensor wi = kiln::where(c, i64({7}, {1}), i64({1, 2, 3}, {3, 1}));
  CHECK(wi.dtype() == DType::Int64);
  CHECK(wi.to_vector<int64_t>() == std::vector<int64_t>{7, 2, 7});
  // A non-bool condition is true where nonzero.
  check_close(kiln::where(f32({0, 0.5, -2}), f32({1, 1, 1}), f32({9, 9, 9})), {9, 1, 1});
  // A condition computed from the data.
  Tensor x = f32({-2, 3, -1, 5});
  check_close(kiln::where(x > kiln::scalar(0.0), x, x * 0.1), {-0.2, 3, -0.1, 5});
}

TEST_CASE("casts between dtypes", "[forward][dtype]") {
  Tensor x = f32({-2.7, -0.5, 0.0, 0.4, 1.9, 3.0});
  CHECK(kiln::cast(x, DType::Int32).to_vector<int32_t>() == std::vector<int32_t>{-2, 0, 0, 0, 1, 3});  // toward 0
  CHECK(kiln::cast(x, DType::Int64).to_vector<int64_t>() == std::vector<int64_t>{-2, 0, 0, 0, 1, 3});
  CHECK(kiln::cast(x, DType::Bool).to_vector<bool>() == std::vector<bool>{1, 1, 0, 1, 1, 1});
  CHECK(kiln::cast(kiln::from_vector<bool>({true, false}, {2}), DType::Float32).to_vector<float>() ==
        std::vector<float>{1, 0});
  CHECK(kiln::cast(i64({-5, 300}, {2}), DType::Float64).to_vector<double>() == std::vector<double>{-5, 300});
  CHECK(x.cast(DType::Float64).to_doubles() == f32({-2.7, -0.5, 0.0, 0.4, 1.9, 3.0}).to_doubles());
  // Same dtype: no new node.
  CHECK(kiln::cast(x, DType::Float32).node() == x.node());
}

TEST_CASE("float16 and bfloat16 round trips", "[forward][dtype]") {
  // Exact in both formats, halfway cases (round to even), overflow, tiny values and NaN.
  std::vector<double> x = {0.0, 1.0, -2.5, 0.1, 3.14159, 1.0 + std::ldexp(1.0, -11), 1.0 + 3 * std::ldexp(1.0, -11),
                           1.0 + std::ldexp(1.0, -8), 1.0 + 3 * std::ldexp(1.0, -8), 65504.0, 70000.0, -1e6, 1e-5,
                           6e-8, 3e38, kInf, -kInf, kNaN};
  for (double& v : x) v = as_float(v);
  Tensor t = f32(x);
  Tensor h = kiln::cast(t, DType::Float16), bf = kiln::cast(t, DType::BFloat16);
  Tensor h_back = kiln::cast(h, DType::Float32), bf_back = kiln::cast(bf, DType::Float32);
  kiln::sync({h, bf, h_back, bf_back});
  CHECK(h.dtype() == DType::Float16);
  CHECK(bf.dtype() == DType::BFloat16);
  std::vector<double> want_h, want_bf;
  for (double v : x) {
    want_h.push_back(kiln::half_to_float(kiln::float_to_half(static_cast<float>(v))));
    want_bf.push_back(kiln::bfloat16_to_float(kiln::float_to_bfloat16(static_cast<float>(v))));
  }
  // The host conversions themselves: round half to even, overflow to inf.
  CHECK(want_h[5] == 1.0);
  CHECK(want_h[6] == 1.0 + std::ldexp(1.0, -9));
  CHECK(want_bf[7] == 1.0);
  CHECK(want_bf[8] == 1.0 + std::ldexp(1.0, -6));
  CHECK(want_h[10] == kInf);
  CHECK(std::isfinite(want_bf[14]));
  check_close(h_back, want_h, 0, 0, x);
  check_close(bf_back, want_bf, 0, 0, x);
  check_close(h, want_h, 0, 0, x);
  check_close(bf, want_bf, 0, 0, x);
  // Integers through half types.
  CHECK(kiln::cast(kiln::cast(i32({-1000, 2049}, {2}), DType::Float16), DType::Int32).to_vector<int32_t>() ==
        std::vector<int32_t>{-1000, 2048});
}

TEST_CASE("full, zeros, ones, scalar, iota and arange", "[forward][creation]") {
  Tensor f = kiln::full({2, 3}, 2.5), z = kiln::zeros({4}, DType::Int32), o = kiln::ones({2}, DType::Float64);
  check_close(f, std::vector<double>(6, 2.5));
  CHECK(z.to_vector<int32_t>() == std::vector<int32_t>(4, 0));
  CHECK(o.to_vector<double>() == std::vector<double>{1, 1});
  CHECK(kiln::zeros_like(o).dtype() == DType::Float64);
  check_close(kiln::ones_like(f), std::vector<double>(6, 1));
  Tensor s = kiln::scalar(-4.0);
  CHECK(s.dim() == 0);
  CHECK(s.item() == -4.0);
  CHECK(kiln::iota({2, 3}, 1).to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 0, 1, 2});
  CHECK(kiln::iota({2, 3}, 0).to_vector<int64_t>() == std::vector<int64_t>{0, 0, 0, 1, 1, 1});
  CHECK(kiln::iota({2, 3}, -1).to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 0, 1, 2});
  check_close(kiln::iota({3, 2}, 0, DType::Float32), {0, 0, 1, 1, 2, 2});
  Tensor r = kiln::arange(5);
  CHECK(r.dtype() == DType::Int64);
  CHECK(r.to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 3, 4});
  check_close(kiln::arange(4, DType::Float32) * 0.5, {0, 0.5, 1, 1.5});
  CHECK(kiln::arange(0).numel() == 0);
}

TEST_CASE("reshape, permute, transpose, flatten, unsqueeze and squeeze", "[forward][movement]") {
  std::vector<double> x(24);
  for (int i = 0; i < 24; ++i) x[i] = i;
  Tensor t = f32(x, {2, 3, 4});
  const Index3 at{2, 3, 4};
  check_close(t.reshape({4, 6}), x);
  CHECK(t.reshape({-1, 8}).shape() == Shape{3, 8});
  std::vector<double> want;  // permute {2, 0, 1}: out[k][i][j] = t[i][j][k]
  for (int k = 0; k < 4; ++k)
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j) want.push_back(x[at(i, j, k)]);
  Tensor p = kiln::permute(t, {2, 0, 1});
  CHECK(p.shape() == Shape{4, 2, 3});
  check_close(p, want);
  check_close(kiln::permute(t, {-1, 0, 1}), want);
  want.clear();  // transpose(0, 2): out[k][j][i]
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < 3; ++j)
      for (int i = 0; i < 2; ++i) want.push_back(x[at(i, j, k)]);
  check_close(kiln::transpose(t, 0, 2), want);
  // A reshape of a permuted view has to copy in the permuted order.
  check_close(kiln::transpose(t, 0, 2).reshape({24}), want);
  CHECK(kiln::flatten(t).shape() == Shape{24});
  CHECK(kiln::flatten(t, 1).shape() == Shape{2, 12});
  CHECK(kiln::flatten(t, 0, 1).shape() == Shape{6, 4});
  CHECK(kiln::flatten(kiln::scalar(1.0)).shape() == Shape{1});
  check_close(kiln::flatten(t, 1), x);
  CHECK(kiln::unsqueeze(t, 0).shape() == Shape{1, 2, 3, 4});
  CHECK(kiln::unsqueeze(t, -1).shape() == Shape{2, 3, 4, 1});
  CHECK(kiln::unsqueeze(t, 2).shape() == Shape{2, 3, 1, 4});
  CHECK(kiln::squeeze(kiln::unsqueeze(t, 1), 1).shape() == Shape{2, 3, 4});
  CHECK(kiln::squeeze(t, 0).shape() == Shape{2, 3, 4});  // not size 1: unchanged
  check_close(kiln::unsqueeze(t, 2).reshape({24}), x);
}

TEST_CASE("expand and broadcast_to", "[forward][movement][broadcast]") {
  Tensor col = f32({1, 2, 3}, {3, 1});
  check_close(kiln::expand(col, {2, 3, 2}), {1, 1, 2, 2, 3, 3, 1, 1, 2, 2, 3, 3});
  check_close(col.expand({-1, 4}), {1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3});
  check_close(kiln::broadcast_to(f32({5, 6}), {2, 2}), {5, 6, 5, 6});
  check_close(kiln::broadcast_to(kiln::scalar(7.0), {3}), {7, 7, 7});
  // A computed value broadcast and then used twice.
  Tensor e = kiln::expand(col * 2.0, {3, 2});
  check_close(e + e, {4, 4, 8, 8, 12, 12});
}

TEST_CASE("slice with steps and negative bounds", "[forward][movement]") {
  std::vector<double> x(30);
  for (int i = 0; i < 30; ++i) x[i] = i;
  Tensor t = f32(x, {5, 6});
  auto pick = [&](std::vector<int> rows, std::vector<int> cols) {
    std::vector<double> out;
    for (int r : rows)
      for (int c : cols) out.push_back(x[r * 6 + c]);
    return out;
  };
  std::vector<int> all_rows = {0, 1, 2, 3, 4}, all_cols = {0, 1, 2, 3, 4, 5};
  check_close(t.slice(0, 1, 3), pick({1, 2}, all_cols));
  check_close(t.slice(1, 0, 6, 2), pick(all_rows, {0, 2, 4}));
  check_close(t.slice(1, 1, 6, 2), pick(all_rows, {1, 3, 5}));
  check_close(t.slice(0, 0, 5, 3), pick({0, 3}, all_cols));
  check_close(t.slice(1, -2, 6), pick(all_rows, {4, 5}));
  check_close(t.slice(1, -5, -1, 2), pick(all_rows, {1, 3}));
  check_close(t.slice(-1, 4, 100), pick(all_rows, {4, 5}));  // stop clamps to the size
  CHECK(t.slice(0, 3, 1).shape() == Shape{0, 6});          // empty
  check_close(t.slice(0, 1, 5, 2).slice(1, 5, 6), pick({1, 3}, {5}));
  check_close(t.t().slice(0, 2, 4), {2, 8, 14, 20, 26, 3, 9, 15, 21, 27});
  CHECK(t.slice(0, 0, 5).node() == t.node());  // the full range is the tensor itself
}

TEST_CASE("pad and concat", "[forward][movement]") {
  Tensor a = f32({1, 2, 3, 4}, {2, 2});
  check_close(kiln::pad(a, {{1, 0}, {0, 2}}), {0, 0, 0, 0, 1, 2, 0, 0, 3, 4, 0, 0});
  CHECK(kiln::pad(a, {{0, 1}}).shape() == Shape{3, 2});
  check_close(kiln::pad(a, {{0, 1}}), {1, 2, 3, 4, 0, 0});
  check_close(kiln::pad(a.t(), {{0, 0}, {1, 1}}), {0, 1, 3, 0, 0, 2, 4, 0});
  Tensor b = f32({5, 6}, {1, 2}), c = f32({7, 8, 9, 10}, {2, 2});
  check_close(kiln::concat({a, b}, 0), {1, 2, 3, 4, 5, 6});
  check_close(kiln::concat({a, c}, 1), {1, 2, 7, 8, 3, 4, 9, 10});
  check_close(kiln::concat({a, c, a}, -1), {1, 2, 7, 8, 1, 2, 3, 4, 9, 10, 3, 4});
  check_close(kiln::concat({a.t(), b}, 0), {1, 3, 2, 4, 5, 6});
  check_close(kiln::concat({a}, 0), {1, 2, 3, 4});
  // Mixed dtypes promote; integer pieces concatenate exactly.
  Tensor mixed = kiln::concat({i32({1, 2}, {2}), f32({0.5})}, 0);
  CHECK(mixed.dtype() == DType::Float32);
  check_close(mixed, {1, 2, 0.5});
  CHECK(kiln::concat({i64({1 << 30}, {1}), i64({-3, 4}, {2})}).to_vector<int64_t>() ==
        std::vector<int64_t>{1 << 30, -3, 4});
}

TEST_CASE("chains of views feeding reductions, gathers and pads", "[forward][movement][view]") {
  std::vector<double> x(60);
  for (int i = 0; i < 60; ++i) x[i] = as_float(std::cos(0.9 * i) * 4);
  Tensor t = f32(x, {3, 4, 5});  // x[(i * 4 + j) * 5 + k]
  auto at = [&](int i, int j, int k) { return x[(i * 4 + j) * 5 + k]; };
  // permute -> stepped slice -> pad -> sum over the padded axis.
  // p = permute(t, {2, 0, 1}): p[k][i][j]; slice k in {1, 3}; pad j by (1, 2) with zeros.
  Tensor p = kiln::pad(kiln::permute(t, {2, 0, 1}).slice(0, 1, 5, 2), {{0, 0}, {0, 0}, {1, 2}});
  CHECK(p.shape() == Shape{2, 3, 7});
  std::vector<double> want;
  for (int k : {1, 3})
    for (int i = 0; i < 3; ++i) {
      double s = 0;
      for (int j = 0; j < 4; ++j) s += at(i, j, k);
      want.push_back(s);
    }
  check_close(kiln::sum(p, {2}), want);
  // The max over a padded axis sees the zeros of the padding.
  Tensor negative = -kiln::abs(t) - 1.0;
  check_close(kiln::max(kiln::pad(negative, {{0, 0}, {0, 1}}), {1}), std::vector<double>(15, 0.0), 0, 0);
  // Gather from a computed, sliced value; the gathered rows then broadcast against a reduction.
  Tensor e = kiln::exp(t.slice(2, 1, 4) * 0.1);  // (3, 4, 3)
  Tensor g = kiln::gather(e, 1, i64({3, 0, 2, 1, 1, 1, 0, 3, 3}, {3, 1, 3}));  // (3, 1, 3)
  Tensor r = g * kiln::sum(e, {1}, true);  // (3, 1, 3)
  std::vector<int> idx = {3, 0, 2, 1, 1, 1, 0, 3, 3};
  want.clear();
  for (int i = 0; i < 3; ++i)
    for (int k = 0; k < 3; ++k) {
      double s = 0;
      for (int j = 0; j < 4; ++j) s += std::exp(at(i, j, k + 1) * 0.1);
      want.push_back(std::exp(at(i, idx[i * 3 + k], k + 1) * 0.1) * s);
    }
  check_close(r, want);
  // A view of a realized result, read back through two more views.
  Tensor m = (t * 2.0).realize();
  Tensor v = m.transpose(0, 2).slice(1, 1, 4, 2).reshape({5, 2, 3});
  want.clear();
  for (int k = 0; k < 5; ++k)
    for (int j : {1, 3})
      for (int i = 0; i < 3; ++i) want.push_back(2 * at(i, j, k));
  check_close(v, want);
  check_close(kiln::concat({kiln::sum(m, {0, 1}), kiln::max(v, {1, 2})}, 0), [&] {
    std::vector<double> w;
    for (int k = 0; k < 5; ++k) {
      double s = 0;
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 4; ++j) s += 2 * at(i, j, k);
      w.push_back(s);
    }
    for (int k = 0; k < 5; ++k) w.push_back(std::max({want[k * 6], want[k * 6 + 1], want[k * 6 + 2], want[k * 6 + 3],
                                                       want[k * 6 + 4], want[k * 6 + 5]}));
    return w;
  }());
}

TEST_CASE("gather, scatter_add, index_select and one_hot", "[forward][index]") {
  Tensor a = f32({10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32, 33}, {3, 4});
  check_close(kiln::gather(a, 1, i64({3, 0, 0, 2, 1, 1}, {3, 2})), {13, 10, 20, 22, 31, 31});
  check_close(kiln::gather(a, 0, i64({2, 0, 1, 2, 0, 0, 0, 0}, {2, 4})), {30, 11, 22, 33, 10, 11, 12, 13});
  check_close(kiln::gather(a, -1, i32({1, 2, 3}, {3, 1})), {11, 22, 33});
  check_close(kiln::gather(a.t(), 0, i64({2, 0, 1}, {1, 3})), {12, 20, 31});

  Tensor s = kiln::scatter_add({2, 3}, 1, i64({0, 2, 0, 1, 1, 1}, {2, 3}), f32({1, 2, 3, 4, 5, 6}, {2, 3}));
  check_close(s, {4, 0, 2, 0, 15, 0});
  Tensor s0 = kiln::scatter_add({3, 2}, 0, i64({2, 2}, {1, 2}), f32({7, 8}, {1, 2}));
  check_close(s0, {0, 0, 0, 0, 7, 8});

  // Along a leading axis with many columns (an embedding's gradient: 16 columns at a time per
  // row): the same sums, added in row order, as a loop.
  const int64_t rows = 70, cols = 50, table = 9;
  std::vector<int64_t> at(rows * cols);
  std::vector<float> src(rows * cols), want(table * cols, 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      at[r * cols + c] = (r * 7 + c / 3) % table;
      src[r * cols + c] = static_cast<float>((r * 31 + c * 17) % 23) / 7.0f - 1.5f;
      want[at[r * cols + c] * cols + c] += src[r * cols + c];
    }
  Tensor wide = kiln::scatter_add({table, cols}, 0, i64(at, {rows, cols}), kiln::from_vector<float>(src, {rows, cols}));
  if (wide.device().is_cpu()) CHECK(wide.to_vector<float>() == want);  // a GPU's atomics add in any order
  check_close(wide, std::vector<double>(want.begin(), want.end()));
  check_close(kiln::index_select(a, 0, i64({2, 0, 2}, {3})), {30, 31, 32, 33, 10, 11, 12, 13, 30, 31, 32, 33});
  check_close(kiln::index_select(a, 1, i64({3, 1}, {2})), {13, 11, 23, 21, 33, 31});
  Tensor emb = kiln::index_select(f32({0, 1, 10, 11, 20, 21}, {3, 2}), 0, i32({1, 1, 2}, {3}));
  check_close(emb, {10, 11, 10, 11, 20, 21});

  Tensor oh = kiln::one_hot(i64({2, 0, 1}, {3}), 4);
  CHECK(oh.shape() == Shape{3, 4});
  CHECK(oh.dtype() == DType::Float32);
  check_close(oh, {0, 0, 1, 0, 1, 0, 0, 0, 0, 1, 0, 0});
  Tensor oh2 = kiln::one_hot(i32({1, 0, 2, 2}, {2, 2}), 3, DType::Int64);
  CHECK(oh2.shape() == Shape{2, 2, 3});
  CHECK(oh2.to_vector<int64_t>() == std::vector<int64_t>{0, 1, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1});
}

TEST_CASE("matmul of padded, stepped and transposed operands against a reference loop", "[forward][matmul][view]") {
  // Views of realized buffers: a transpose or a stepped slice reaches the library as strides, a
  // pad (whose zeros no stride expresses) must be stored first. Float32 (float64 products are
  // reductions, not library calls); whole numbers keep every sum exact.
  std::vector<double> xv(12), yv(40);
  for (int i = 0; i < 12; ++i) xv[i] = i % 5 - 2;
  for (int i = 0; i < 40; ++i) yv[i] = i % 7 - 3;
  Tensor x = kiln::from_doubles(xv, {3, 4}, DType::Float32), y = kiln::from_doubles(yv, {5, 8}, DType::Float32);
  Tensor a = kiln::pad(x, {{1, 0}, {0, 2}});                    // (4, 6): a[i][k] = x[i-1][k] or 0
  Tensor b = kiln::transpose(y.slice(1, 0, 8, 2), 0, 1).slice(0, 0, 4).slice(1, 0, 5);  // (4, 5)
  Tensor bp = kiln::pad(b, {{0, 2}, {0, 0}});                  // (6, 5): b padded below
  auto a_at = [&](int i, int k) { return i >= 1 && k < 4 ? xv[(i - 1) * 4 + k] : 0.0; };
  auto b_at = [&](int k, int j) { return k < 4 ? yv[j * 8 + 2 * k] : 0.0; };
  std::vector<double> want;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 5; ++j) {
      double s = 0;
      for (int k = 0; k < 6; ++k) s += a_at(i, k) * b_at(k, j);
      want.push_back(s);
    }
  CHECK(kiln::matmul(a, bp).to_doubles() == want);
  // The same products with the padded operand on the other side.
  Tensor t = kiln::matmul(kiln::transpose(bp, 0, 1), kiln::transpose(a, 0, 1));  // (5, 4) = (a bp)^T
  std::vector<double> got = t.to_doubles(), want_t;
  for (int j = 0; j < 5; ++j)
    for (int i = 0; i < 4; ++i) want_t.push_back(want[i * 5 + j]);
  CHECK(got == want_t);
}

TEST_CASE("float32 matmul against a reference loop", "[forward][matmul]") {
  // out[b][i][j] = sum_k a[b][i][k] * b[b][k][j], with batch broadcasting done by the caller.
  auto reference = [](const std::vector<double>& a, const std::vector<double>& b, int64_t batch, int64_t a_batch,
                      int64_t b_batch, int64_t M, int64_t K, int64_t N) {
    std::vector<double> out;
    for (int64_t n = 0; n < batch; ++n)
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double s = 0;
          for (int64_t k = 0; k < K; ++k)
            s += a[(n % a_batch) * M * K + i * K + k] * b[(n % b_batch) * K * N + k * N + j];
          out.push_back(s);
        }
    return out;
  };
  auto values = [](int64_t count, double scale) {
    std::vector<double> v;
    for (int64_t i = 0; i < count; ++i) v.push_back(as_float(std::cos(scale * static_cast<double>(i + 1))));
    return v;
  };
  std::vector<double> a = values(2 * 3 * 4, 0.7), b = values(2 * 4 * 5, 1.3);
  Tensor ta = f32(a, {2, 3, 4}), tb = f32(b, {2, 4, 5});
  Tensor mm = kiln::matmul(ta, tb);
  CHECK(mm.shape() == Shape{2, 3, 5});
  check_close(mm, reference(a, b, 2, 2, 2, 3, 4, 5));
  std::vector<double> a2(a.begin(), a.begin() + 12), b2(b.begin(), b.begin() + 20);
  check_close(kiln::matmul(f32(a2, {3, 4}), f32(b2, {4, 5})), reference(a2, b2, 1, 1, 1, 3, 4, 5));
  check_close(kiln::matmul(ta, f32(b2, {4, 5})), reference(a, b2, 2, 2, 1, 3, 4, 5));  // batch @ 2-d
  check_close(kiln::matmul(f32(a2, {3, 4}), tb), reference(a2, b, 2, 1, 2, 3, 4, 5));  // 2-d @ batch
  Tensor bcast = kiln::matmul(f32(a, {2, 1, 3, 4}), f32(b, {2, 4, 5}));                // (2,1) x (2) batches
  CHECK(bcast.shape() == Shape{2, 2, 3, 5});
  std::vector<double> want;
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      std::vector<double> ai(a.begin() + i * 12, a.begin() + (i + 1) * 12), bj(b.begin() + j * 20, b.begin() + (j + 1) * 20);
      auto r = reference(ai, bj, 1, 1, 1, 3, 4, 5);
      want.insert(want.end(), r.begin(), r.end());
    }
  check_close(bcast, want);
  // 1-d operands.
  std::vector<double> v4(b.begin(), b.begin() + 4);
  Tensor mv = kiln::matmul(f32(a2, {3, 4}), f32(v4));
  CHECK(mv.shape() == Shape{3});
  check_close(mv, reference(a2, v4, 1, 1, 1, 3, 4, 1));
  Tensor vm = kiln::matmul(f32(v4), f32(b2, {4, 5}));
  CHECK(vm.shape() == Shape{5});
  check_close(vm, reference(v4, b2, 1, 1, 1, 1, 4, 5));
  Tensor dot = kiln::matmul(f32(v4), f32(v4));
  CHECK(dot.dim() == 0);
  check_close(dot, reference(v4, v4, 1, 1, 1, 1, 4, 1));
  // Operands stored transposed: (4,3)^T @ (5,4)^T.
  std::vector<double> a2t(12), b2t(20);
  for (int i = 0; i < 3; ++i)
    for (int k = 0; k < 4; ++k) a2t[k * 3 + i] = a2[i * 4 + k];
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < 5; ++j) b2t[j * 4 + k] = b2[k * 5 + j];
  check_close(kiln::matmul(f32(a2t, {4, 3}).t(), f32(b2t, {5, 4}).t()), reference(a2, b2, 1, 1, 1, 3, 4, 5));
  // Integer operands compute in float32.
  Tensor im = kiln::matmul(i32({1, 2, 3, 4}, {2, 2}), i32({5, 6, 7, 8}, {2, 2}));
  CHECK(im.dtype() == DType::Float32);
  check_close(im, {19, 22, 43, 50});
  // float64 takes the fused multiply-reduce path: same numbers.
  check_close(kiln::matmul(kiln::cast(ta, DType::Float64), kiln::cast(tb, DType::Float64)),
              reference(a, b, 2, 2, 2, 3, 4, 5), 1e-12, 1e-12);
}

TEST_CASE("softmax, log_softmax, layer_norm and losses", "[forward][composite]") {
  std::vector<double> x = {1, 2, 3, -1, 0.5, 0.5, 100, 101, 99};  // a large row checks the max shift
  Tensor t = f32(x, {3, 3});
  std::vector<double> sm, lsm, ln;
  for (int r = 0; r < 3; ++r) {
    double m = std::max({x[r * 3], x[r * 3 + 1], x[r * 3 + 2]}), s = 0;
    for (int c = 0; c < 3; ++c) s += std::exp(x[r * 3 + c] - m);
    double mean = (x[r * 3] + x[r * 3 + 1] + x[r * 3 + 2]) / 3, var = 0;
    for (int c = 0; c < 3; ++c) var += (x[r * 3 + c] - mean) * (x[r * 3 + c] - mean) / 3;
    for (int c = 0; c < 3; ++c) {
      sm.push_back(std::exp(x[r * 3 + c] - m) / s);
      lsm.push_back(x[r * 3 + c] - m - std::log(s));
      ln.push_back((x[r * 3 + c] - mean) / std::sqrt(var + 1e-5));
    }
  }
  check_close(kiln::softmax(t), sm);
  check_close(kiln::softmax(t, 1), sm);
  check_close(kiln::log_softmax(t, -1), lsm);
  check_close(kiln::sum(kiln::softmax(t, 0), {0}), {1, 1, 1});
  check_close(kiln::layer_norm(t, {3}), ln, 1e-5, 1e-5);
  Tensor w = f32({1, 2, -1}), b = f32({0, 0.5, 1});
  std::vector<double> ln_wb;
  for (size_t i = 0; i < ln.size(); ++i) ln_wb.push_back(ln[i] * std::vector<double>{1, 2, -1}[i % 3] + std::vector<double>{0, 0.5, 1}[i % 3]);
  check_close(kiln::layer_norm(t, {3}, w, b), ln_wb, 1e-5, 1e-5);
  // Over both dims: one normalization of all nine values.
  std::vector<double> z = kiln::layer_norm(t, {3, 3}).to_doubles();
  double zm = 0, zv = 0;
  for (double v : z) zm += v / 9;
  for (double v : z) zv += (v - zm) * (v - zm) / 9;
  CHECK(zm == Approx(0).margin(1e-5));
  CHECK(zv == Approx(1).margin(1e-3));

  // cross_entropy: mean over rows of -log p[label]; smoothing mixes in the mean of -log p.
  Tensor labels = i64({2, 0, 1}, {3});
  double nll = -(lsm[2] + lsm[3] + lsm[7]) / 3, uniform = 0;
  for (double v : lsm) uniform -= v / 9;
  check_close(kiln::cross_entropy(t, labels), {nll});
  check_close(kiln::cross_entropy(t, labels, kiln::CrossEntropyOptions().label_smoothing(0.2)),
              {0.8 * nll + 0.2 * uniform});
  check_close(kiln::cross_entropy(t, i32({2, 0, 1}, {3})), {nll});
  CHECK(kiln::cross_entropy(t, labels).dim() == 0);
  check_close(kiln::mse_loss(f32({1, 2, 3}), f32({1.5, 2, 1})), {(0.25 + 0 + 4) / 3});
}
