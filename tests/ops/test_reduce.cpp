// Reductions (sum, max, min, mean, var, logsumexp, argmax) against reference loops: every axis
// combination and keepdim, integer and bool inputs, NaN and infinities, and sizes large enough to
// take the multi-threaded paths.
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


TEST_CASE("sum, max, min and mean over axes", "[forward][reduce]") {
  const Index3 at{2, 3, 4};
  std::vector<double> x(24);
  for (int i = 0; i < 24; ++i) x[i] = as_float(std::sin(1.7 * i) * 3);
  Tensor t = f32(x, {2, 3, 4});
  auto reference = [&](std::vector<int> axes, const std::function<double(double, double)>& combine, double init,
                       bool average) {
    // Output extents: reduced axes become 1 (keepdim layout, which is also the row-major order).
    int64_t e[3] = {2, 3, 4};
    for (int a : axes) e[a] = 1;
    std::vector<double> out(static_cast<size_t>(e[0] * e[1] * e[2]), init);
    std::vector<int> count(out.size(), 0);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j)
        for (int k = 0; k < 4; ++k) {
          int64_t o = ((e[0] == 1 ? 0 : i) * e[1] + (e[1] == 1 ? 0 : j)) * e[2] + (e[2] == 1 ? 0 : k);
          out[o] = combine(out[o], x[at(i, j, k)]);
          count[o]++;
        }
    if (average)
      for (size_t o = 0; o < out.size(); ++o) out[o] /= count[o];
    return out;
  };
  auto add = [](double a, double b) { return a + b; };
  auto mx = [](double a, double b) { return std::max(a, b); };
  auto mn = [](double a, double b) { return std::min(a, b); };
  for (std::vector<int> axes : std::vector<std::vector<int>>{{0}, {1}, {2}, {0, 2}, {1, 2}, {0, 1, 2}})
    for (bool keep : {false, true}) {
      std::vector<int64_t> ax(axes.begin(), axes.end());
      CAPTURE(ax, keep);
      Tensor s = kiln::sum(t, ax, keep), m = kiln::max(t, ax, keep), n = kiln::min(t, ax, keep);
      Tensor avg = kiln::mean(t, ax, keep);
      kiln::sync({s, m, n, avg});
      Shape want_shape;
      for (int d = 0; d < 3; ++d) {
        bool reduced = std::find(axes.begin(), axes.end(), d) != axes.end();
        if (!reduced) want_shape.push_back(t.shape()[d]);
        else if (keep) want_shape.push_back(1);
      }
      CHECK(s.shape() == want_shape);
      CHECK(avg.shape() == want_shape);
      check_close(s, reference(axes, add, 0.0, false));
      check_close(m, reference(axes, mx, -kInf, false));
      check_close(n, reference(axes, mn, kInf, false));
      check_close(avg, reference(axes, add, 0.0, true));
    }
  // Negative axes and the all-axes default.
  check_close(kiln::sum(t, {-1, -3}), reference({0, 2}, add, 0, false));
  check_close(t.sum(), reference({0, 1, 2}, add, 0, false));
  CHECK(t.sum().dim() == 0);
  // Reductions of a transposed view.
  check_close(kiln::max(t.transpose(0, 2), {0}).t(), reference({2}, mx, -kInf, false), 0, 0);
}

TEST_CASE("var and logsumexp", "[forward][reduce]") {
  std::vector<double> x = {1, 2, 4, 7, -1, 0, 3, 3.5};
  Tensor t = f32(x, {2, 4});
  // Sum of squared deviations of the elements x[first + k * stride], k < count.
  auto squares = [&](int first, int stride, int count) {
    double mean = 0, ss = 0;
    for (int k = 0; k < count; ++k) mean += x[first + k * stride] / count;
    for (int k = 0; k < count; ++k) ss += (x[first + k * stride] - mean) * (x[first + k * stride] - mean);
    return ss;
  };
  check_close(kiln::var(t, {1}), {squares(0, 1, 4) / 4, squares(4, 1, 4) / 4});
  check_close(kiln::var(t, {1}, true, true), {squares(0, 1, 4) / 3, squares(4, 1, 4) / 3});
  CHECK(kiln::var(t, {1}, true).shape() == Shape{2, 1});
  check_close(kiln::var(t), {squares(0, 1, 8) / 8});
  check_close(kiln::var(t, {}, false, true), {squares(0, 1, 8) / 7});
  check_close(kiln::var(t, {0}), {1, 1, 0.25, 3.0625});
  CHECK(squares(0, 1, 4) == 21.0);  // the reference itself: deviations -2.5 -1.5 0.5 3.5
  // logsumexp stays finite for large inputs, where exp overflows float32.
  Tensor big = f32({1000, 1000.5, -1000, 0}, {2, 2});
  check_close(kiln::logsumexp(big, {1}), {1000.5 + std::log1p(std::exp(-0.5)), std::log1p(std::exp(-1000.0))});
  double total = 0;
  for (double v : x) total += std::exp(v);
  check_close(kiln::logsumexp(t, {0, 1}, true), {std::log(total)});
  CHECK(kiln::logsumexp(t, {0, 1}, true).shape() == Shape{1, 1});
}

TEST_CASE("integer and bool reductions and argmax", "[forward][reduce][dtype]") {
  Tensor flags = kiln::from_vector<bool>({true, false, true, true, true, false}, {2, 3});
  Tensor count = kiln::sum(flags);
  CHECK(count.dtype() == DType::Int64);
  CHECK(count.item() == 4);
  CHECK(kiln::sum(flags, {1}).to_vector<int64_t>() == std::vector<int64_t>{2, 2});
  Tensor small = kiln::from_vector<int8_t>({100, 100, 100, -5}, {4});
  CHECK(kiln::sum(small).dtype() == DType::Int64);  // no int8 overflow
  CHECK(kiln::sum(small).item() == 295);
  Tensor ints = i32({3, -7, 9, 9, -2, -1}, {2, 3});
  Tensor imax = kiln::max(ints, {1}), imin = kiln::min(ints, {1});
  CHECK(imax.dtype() == DType::Int32);
  CHECK(imax.to_vector<int32_t>() == std::vector<int32_t>{9, 9});
  CHECK(imin.to_vector<int32_t>() == std::vector<int32_t>{-7, -2});
  CHECK(kiln::max(i64({-5, -9}, {2})).item() == -5);  // all negative
  CHECK(kiln::max(kiln::from_vector<uint8_t>({3, 250, 7}, {3})).item() == 250);
  check_close(kiln::mean(ints, {1}), {5.0 / 3, 2.0});
  CHECK(kiln::mean(ints).dtype() == DType::Float32);

  // argmax: int64, the first of tied maxima.
  Tensor f = f32({1, 5, 5, 2, 9, 0, 9, 3, -1, -2, -3, -4}, {3, 4});
  Tensor rows = kiln::argmax(f, 1), cols = kiln::argmax(f, 0, true);
  CHECK(rows.dtype() == DType::Int64);
  CHECK(rows.to_vector<int64_t>() == std::vector<int64_t>{1, 0, 0});
  CHECK(cols.shape() == Shape{1, 4});
  CHECK(cols.to_vector<int64_t>() == std::vector<int64_t>{1, 0, 1, 1});
  CHECK(kiln::argmax(f, -1, true).shape() == Shape{3, 1});
  CHECK(kiln::argmax(ints, 1).to_vector<int64_t>() == std::vector<int64_t>{2, 0});
  CHECK(kiln::argmax(f.t(), 1).to_vector<int64_t>() == std::vector<int64_t>{1, 0, 1, 1});
}

TEST_CASE("reductions and scatters big enough to run in parallel", "[forward][reduce][index]") {
  // 300 x 400 = 120000 elements: above the renderer's OpenMP threshold.
  const int64_t rows = 300, cols = 400;
  std::vector<double> x(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < x.size(); ++i) x[i] = as_float(std::sin(0.37 * static_cast<double>(i)));
  Tensor t = f32(x, {rows, cols});
  Tensor total = kiln::sum(t), row_sums = kiln::sum(t, {1}), col_max = kiln::max(t, {0});
  Tensor half_sum = kiln::sum(kiln::cast(t, DType::Float16) * 0.25, {1});
  kiln::sync({total, row_sums, col_max, half_sum});
  std::vector<double> want_rows(rows, 0.0), want_cols(cols, -kInf), want_half(rows, 0.0);
  double want_total = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      double v = x[r * cols + c];
      want_total += v;
      want_rows[r] += v;
      want_cols[c] = std::max(want_cols[c], v);
      want_half[r] += kiln::half_to_float(kiln::float_to_half(static_cast<float>(v))) * 0.25;
    }
  check_close(total, {want_total}, 1e-4, 1e-3);
  check_close(row_sums, want_rows, 1e-4, 1e-4);
  check_close(col_max, want_cols, 0, 0);
  CHECK(half_sum.dtype() == DType::Float16);
  check_close(half_sum, want_half, 2e-3, 2e-2);  // one float16 rounding of the result
  // Many source rows scattered into few output rows (an embedding gradient): colliding writes.
  std::vector<int64_t> index(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < index.size(); ++i) index[i] = static_cast<int64_t>((i / cols) % 3);
  Tensor s = kiln::scatter_add({3, cols}, 0, i64(index, {rows, cols}), t);
  std::vector<double> want_s(3 * cols, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) want_s[(r % 3) * cols + c] += x[r * cols + c];
  check_close(s, want_s, 1e-4, 1e-4);
}

TEST_CASE("NaN and infinities in reductions", "[forward][reduce]") {
  // A NaN anywhere makes max/min NaN, on every reduction path: a whole small tensor (one simd
  // loop), a large one (threads), and along an axis.
  for (int64_t n : {3, 17, 100000}) {
    CAPTURE(n);
    std::vector<double> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<double>(i % 7);
    x[n / 2] = kNaN;
    Tensor t = f32(x), d = kiln::from_vector<double>(x, {n});
    check_close(kiln::max(t), {kNaN}, 0, 0);
    check_close(kiln::min(t), {kNaN}, 0, 0);
    check_close(kiln::max(d), {kNaN}, 0, 0);
    CHECK(kiln::argmax(t, 0).item() == static_cast<double>(n / 2));  // the NaN's position
  }
  Tensor rows = f32({1, kNaN, 3, 4, 5, 6}, {2, 3});
  check_close(kiln::max(rows, {1}), {kNaN, 6}, 0, 0);
  check_close(kiln::min(rows, {0}), {1, kNaN, 3}, 0, 0);
  CHECK(kiln::argmax(rows, 1).to_vector<int64_t>() == std::vector<int64_t>{1, 2});
  // Infinities are ordinary values; logsumexp of all -inf is -inf, not NaN.
  check_close(kiln::max(f32({-kInf, -kInf})), {-kInf}, 0, 0);
  check_close(kiln::logsumexp(f32({-kInf, -kInf, 0, -kInf}, {2, 2}), {1}), {-kInf, 0}, 0, 1e-6);
  check_close(kiln::logsumexp(f32({kInf, 1}), {0}), {kInf}, 0, 0);
  check_close(kiln::softmax(f32({-kInf, 0, -kInf, 1})), {0, 0.2689414, 0, 0.7310586});
}

TEST_CASE("min of bool and small integer types", "[forward][reduce][dtype]") {
  // min is -max(-a): negation must not wrap for these types.
  Tensor u8 = kiln::from_vector<uint8_t>({5, 0, 7, 255}, {4});
  CHECK(kiln::min(u8).item() == 0);
  CHECK(kiln::min(u8).dtype() == DType::UInt8);
  Tensor s8 = kiln::from_vector<int8_t>({5, -128, 127, -1}, {2, 2});
  CHECK(kiln::min(s8).item() == -128);
  CHECK(kiln::min(s8, {1}).to_vector<int8_t>() == std::vector<int8_t>{-128, -1});
  Tensor b = kiln::from_vector<bool>({true, false, true, true}, {2, 2});
  CHECK(kiln::min(b).item() == 0);
  CHECK(kiln::min(b, {1}).to_vector<bool>() == std::vector<bool>{false, true});
  CHECK(kiln::max(b, {1}).to_vector<bool>() == std::vector<bool>{true, true});
  CHECK(kiln::min(i32({-2147483647 - 1, 0}, {2})).item() == -2147483648.0);
}

TEST_CASE("mean of float16 and bfloat16 does not overflow", "[forward][reduce][dtype]") {
  // 1000 x 100 sums to 1e5, past float16's 65504; the mean (100) is representable.
  Tensor h = kiln::full({1000}, 100.0, DType::Float16);
  CHECK(kiln::mean(h).dtype() == DType::Float16);
  check_close(kiln::mean(h), {100}, 1e-3);
  check_close(kiln::mean(kiln::full({2, 1000}, 3.0, DType::BFloat16), {1}), {3, 3}, 1e-2);
  CHECK(std::isinf(kiln::sum(h).item()));  // the sum itself is float16 and does overflow
}

// Issue 18's one result: a float sum adds in one fixed order (16 lanes folded by halves, fixed
// blocks), so it does not depend on whether its producer is fused or stored, on the vector width
// GCC picks for the fused code (exp does not vectorize like a plain load), or on the thread count.
TEST_CASE("float sums give the same bits fused or stored, on one thread or several", "[forward][reduce]") {
  using kiln::FlagsGuard;
  using kiln::flags;
  for (DType t : {DType::Float32, DType::Float64})
    for (int64_t n : {int64_t{37}, int64_t{1000}, int64_t{300001}}) {
      INFO(kiln::dtype_name(t) << ", " << n << " elements");
      const Tensor x = kiln::cast(kiln::randn({n}) * 0.5, t).realize();
      auto bits = [](const Tensor& s) { return kiln::cast(s, DType::Float64).to_vector<double>(); };
      const std::vector<double> fused = bits(kiln::sum(kiln::exp(x)));
      Tensor held = kiln::exp(x).realize();  // the producer stored, the sum reads memory
      CHECK(bits(kiln::sum(held)) == fused);
      for (int threads : {1, 2, 3}) {
        FlagsGuard guard;
        flags().num_threads = threads;
        flags().plan_cache = false;
        CHECK(bits(kiln::sum(kiln::exp(x))) == fused);
      }
      // Rows: the lanes of each row's sum, with and without a fused producer.
      const Tensor m = kiln::reshape(x.slice(0, 0, n / 37 * 37), {n / 37, 37});
      Tensor stored = kiln::exp(m).realize();
      CHECK(bits(kiln::sum(stored, {1})) == bits(kiln::sum(kiln::exp(m), {1})));
    }
}
