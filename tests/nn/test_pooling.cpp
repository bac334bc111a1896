// max_pool2d / avg_pool2d and their modules against plain nested-loop references written after
// PyTorch's CPU kernels (output sizes, divisors, which maximum wins), gradients in float64, and
// the errors.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <kiln/kiln.h>

#include "core/node.h"
#include "ops/primitive.h"
#include "tests/support/compare.h"
#include "tests/support/gradcheck.h"

using namespace kiln;
using kiln::testing::check_close;
using kiln::testing::gradcheck;
using Inputs = std::vector<Tensor>;
using Pair = std::array<int64_t, 2>;

namespace {

// One pooling call: input (N, C, H, W) and PyTorch's arguments.
struct PoolCase {
  Shape shape;
  Pair kernel, stride{0, 0}, padding{0, 0}, dilation{1, 1};
  bool ceil_mode = false;
  bool count_include_pad = true;
};

std::string describe(const PoolCase& p) {
  return fmt::format("input {} kernel ({}, {}) stride ({}, {}) padding ({}, {}) dilation ({}, {}) ceil {} "
                     "count_include_pad {}",
                     shape_str(p.shape), p.kernel[0], p.kernel[1], p.stride[0], p.stride[1], p.padding[0],
                     p.padding[1], p.dilation[0], p.dilation[1], p.ceil_mode, p.count_include_pad);
}

int64_t reference_size(int64_t L, int64_t k, int64_t s, int64_t p, int64_t d, bool ceil_mode) {
  int64_t span = L + 2 * p - d * (k - 1) - 1;
  int64_t out = (span + (ceil_mode ? s - 1 : 0)) / s + 1;  // span >= 0 in every case below
  if (ceil_mode && (out - 1) * s >= L + p) --out;
  return out;
}

// The reference: y (N, C, OH, OW) and, for max, the flat H * W position each output took (the
// first maximum in row-major order; padding never wins), for avg the divisor of each output.
struct Reference {
  Shape shape;
  std::vector<double> y;
  std::vector<int64_t> argmax;   // max: position in the H * W plane
  std::vector<double> divisor;   // avg
};

Reference reference_pool(const std::vector<double>& x, const PoolCase& p, bool is_max) {
  int64_t N = p.shape[0], C = p.shape[1], H = p.shape[2], W = p.shape[3];
  Pair s = p.stride == Pair{0, 0} ? p.kernel : p.stride;
  int64_t OH = reference_size(H, p.kernel[0], s[0], p.padding[0], p.dilation[0], p.ceil_mode);
  int64_t OW = reference_size(W, p.kernel[1], s[1], p.padding[1], p.dilation[1], p.ceil_mode);
  Reference r;
  r.shape = {N, C, OH, OW};
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          const double* plane = x.data() + (n * C + c) * H * W;
          int64_t h0 = oh * s[0] - p.padding[0], w0 = ow * s[1] - p.padding[1];
          if (is_max) {
            int64_t h1 = std::min(h0 + (p.kernel[0] - 1) * p.dilation[0] + 1, H);
            int64_t w1 = std::min(w0 + (p.kernel[1] - 1) * p.dilation[1] + 1, W);
            while (h0 < 0) h0 += p.dilation[0];
            while (w0 < 0) w0 += p.dilation[1];
            double best = -std::numeric_limits<double>::infinity();
            int64_t at = h0 * W + w0;
            for (int64_t h = h0; h < h1; h += p.dilation[0])
              for (int64_t w = w0; w < w1; w += p.dilation[1])
                if (plane[h * W + w] > best) best = plane[h * W + w], at = h * W + w;
            r.y.push_back(best);
            r.argmax.push_back(at);
          } else {
            int64_t h1 = std::min(h0 + p.kernel[0], H + p.padding[0]);
            int64_t w1 = std::min(w0 + p.kernel[1], W + p.padding[1]);
            int64_t pool_size = (h1 - h0) * (w1 - w0);
            h0 = std::max<int64_t>(h0, 0), w0 = std::max<int64_t>(w0, 0);
            h1 = std::min(h1, H), w1 = std::min(w1, W);
            double total = 0;
            for (int64_t h = h0; h < h1; ++h)
              for (int64_t w = w0; w < w1; ++w) total += plane[h * W + w];
            double divisor = p.count_include_pad ? pool_size : (h1 - h0) * (w1 - w0);
            r.y.push_back(total / divisor);
            r.divisor.push_back(divisor);
          }
        }
  return r;
}

// d(sum(y * dy))/dx from the reference's argmax / divisors.
std::vector<double> reference_grad(const Reference& r, const PoolCase& p, bool is_max, const std::vector<double>& dy) {
  int64_t N = p.shape[0], C = p.shape[1], H = p.shape[2], W = p.shape[3], OH = r.shape[2], OW = r.shape[3];
  Pair s = p.stride == Pair{0, 0} ? p.kernel : p.stride;
  std::vector<double> dx(static_cast<size_t>(N * C * H * W), 0.0);
  for (int64_t plane = 0; plane < N * C; ++plane)
    for (int64_t oh = 0; oh < OH; ++oh)
      for (int64_t ow = 0; ow < OW; ++ow) {
        size_t o = static_cast<size_t>((plane * OH + oh) * OW + ow);
        if (is_max) {
          dx[static_cast<size_t>(plane * H * W + r.argmax[o])] += dy[o];
          continue;
        }
        int64_t h0 = oh * s[0] - p.padding[0], w0 = ow * s[1] - p.padding[1];
        for (int64_t h = std::max<int64_t>(h0, 0); h < std::min(h0 + p.kernel[0], H); ++h)
          for (int64_t w = std::max<int64_t>(w0, 0); w < std::min(w0 + p.kernel[1], W); ++w)
            dx[static_cast<size_t>(plane * H * W + h * W + w)] += dy[o] / r.divisor[o];
      }
  return dx;
}

std::vector<double> random_values(size_t n, uint64_t seed, bool small_integers = false) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-3, 3);
  std::vector<double> v(n);
  for (auto& e : v) e = small_integers ? std::floor(u(rng)) : u(rng);  // integers: many ties
  return v;
}

Tensor run_pool(const Tensor& x, const PoolCase& p, bool is_max) {
  return is_max ? max_pool2d(x, p.kernel, p.stride, p.padding, p.dilation, p.ceil_mode)
                : avg_pool2d(x, p.kernel, p.stride, p.padding, p.ceil_mode, p.count_include_pad);
}

// Tiled, strided, overlapping, padded, dilated, ceil-mode and odd-sized cases.
const std::vector<PoolCase> kMaxCases = {
    {{2, 3, 6, 8}, {2, 2}},                                 // tiles the input
    {{1, 2, 7, 9}, {2, 2}},                                 // odd sizes: the last row / column is dropped
    {{1, 2, 7, 9}, {2, 2}, {0, 0}, {0, 0}, {1, 1}, true},  // ceil mode keeps them
    {{2, 2, 7, 8}, {3, 3}, {2, 2}, {1, 1}},                 // overlapping, padded
    {{1, 2, 8, 8}, {3, 3}, {2, 2}, {1, 1}, {1, 1}, true},  // ceil mode with padding
    {{1, 1, 9, 10}, {2, 3}, {1, 2}, {1, 1}, {2, 1}},        // stride 1, rectangular, dilated rows
    {{1, 2, 6, 7}, {3, 2}, {3, 1}, {1, 0}, {1, 2}, true},   // stride > padding, dilated columns
    {{2, 1, 5, 5}, {5, 5}, {1, 1}, {2, 2}},                 // kernel as large as the input
};

const std::vector<PoolCase> kAvgCases = {
    {{2, 3, 6, 8}, {2, 2}},
    {{1, 2, 7, 9}, {2, 2}},
    {{1, 2, 7, 9}, {2, 2}, {0, 0}, {0, 0}, {1, 1}, true},
    {{2, 2, 7, 8}, {3, 3}, {2, 2}, {1, 1}},
    {{2, 2, 7, 8}, {3, 3}, {2, 2}, {1, 1}, {1, 1}, false, false},  // count_include_pad false
    {{1, 2, 8, 8}, {3, 3}, {2, 2}, {1, 1}, {1, 1}, true},          // ceil: clipped divisors
    {{1, 2, 8, 8}, {3, 3}, {2, 2}, {1, 1}, {1, 1}, true, false},
    {{1, 1, 9, 10}, {2, 3}, {1, 2}, {1, 1}},
    {{1, 2, 5, 6}, {4, 4}, {3, 3}, {2, 1}, {1, 1}, true},
};

}  // namespace

TEST_CASE("pooling output sizes follow PyTorch's formula and ceil-mode rule", "[pooling]") {
  Tensor x = zeros({1, 1, 5, 8});
  CHECK(max_pool2d(x, {2, 2}).shape() == Shape{1, 1, 2, 4});
  CHECK(max_pool2d(x, {2, 2}, {2, 2}, {0, 0}, {1, 1}, true).shape() == Shape{1, 1, 3, 4});
  CHECK(max_pool2d(x, {3, 3}, {2, 2}, {1, 1}).shape() == Shape{1, 1, 3, 4});
  CHECK(avg_pool2d(zeros({1, 8, 6}), {3, 3}, {2, 2}, {1, 1}, true).shape() == Shape{1, 5, 4});
  // W = 5, kernel 2, stride 2, padding 1, ceil: a 4th window would start at 3 * 2 - 1 = 5, in the
  // right padding alone, so it is dropped.
  CHECK(avg_pool2d(zeros({1, 1, 5}), {1, 2}, {1, 2}, {0, 1}, true).shape() == Shape{1, 1, 3});
  CHECK(max_pool2d(zeros({1, 1, 5}), {1, 2}, {1, 2}, {0, 1}, {1, 1}, true).shape() == Shape{1, 1, 3});
  CHECK(max_pool2d(zeros({2, 3, 10, 10}), {3, 3}, {1, 1}, {0, 0}, {2, 2}).shape() == Shape{2, 3, 6, 6});
  // (C, H, W) inputs keep their rank.
  CHECK(max_pool2d(zeros({3, 4, 4}), {2, 2}).shape() == Shape{3, 2, 2});
}

TEST_CASE("max_pool2d matches a nested-loop reference", "[pooling]") {
  uint64_t seed = 100;
  for (const PoolCase& p : kMaxCases) {
    INFO(describe(p));
    std::vector<double> xs = random_values(static_cast<size_t>(numel(p.shape)), ++seed);
    Reference r = reference_pool(xs, p, true);
    for (DType dtype : {DType::Float32, DType::Float64}) {
      Tensor y = run_pool(from_doubles(xs, p.shape, dtype), p, true);
      REQUIRE(y.shape() == r.shape);
      check_close(y, dtype == DType::Float32 ? kiln::testing::map_values(r.y, kiln::testing::as_float) : r.y, 0, 0);
    }
  }
}

TEST_CASE("avg_pool2d matches a nested-loop reference", "[pooling]") {
  uint64_t seed = 200;
  for (const PoolCase& p : kAvgCases) {
    INFO(describe(p));
    std::vector<double> xs = random_values(static_cast<size_t>(numel(p.shape)), ++seed);
    Reference r = reference_pool(xs, p, false);
    Tensor y = run_pool(from_doubles(xs, p.shape, DType::Float64), p, false);
    REQUIRE(y.shape() == r.shape);
    check_close(y, r.y, 1e-12, 1e-12);
    check_close(run_pool(from_doubles(xs, p.shape, DType::Float32), p, false), r.y, 1e-5, 1e-6);
  }
  // Half types accumulate in float32.
  PoolCase p{{1, 1, 6, 6}, {3, 3}, {1, 1}, {1, 1}};
  std::vector<double> xs = random_values(36, 7);
  Tensor y = avg_pool2d(from_doubles(xs, p.shape, DType::Float16), p.kernel, p.stride, p.padding);
  CHECK(y.dtype() == DType::Float16);
  auto as_half = [](double v) { return double(half_to_float(float_to_half(float(v)))); };
  check_close(y, reference_pool(kiln::testing::map_values(xs, as_half), p, false).y, 2e-3, 2e-3);
}

TEST_CASE("max pooling pads with -inf, propagates NaN and pools integers", "[pooling]") {
  // All negative: a zero from the padding must never win.
  Tensor x = from_vector<float>({-5, -4, -3, -2, -1, -6, -7, -8, -9}, {1, 3, 3});
  check_close(max_pool2d(x, {3, 3}, {1, 1}, {1, 1}), {-1, -1, -1, -1, -1, -1, -1, -1, -1});
  check_close(max_pool2d(x, {2, 2}, {2, 2}, {1, 1}), {-5, -3, -2, -1});
  // A window of -inf stays -inf.
  check_close(max_pool2d(full({1, 2, 2}, -INFINITY), {2, 2}, {1, 1}, {1, 1}),
              std::vector<double>(9, -kiln::testing::kInf));
  Tensor with_nan = from_vector<float>({1, NAN, 3, 4, 5, 6, 7, 8}, {1, 2, 4});
  auto y = max_pool2d(with_nan, {2, 2}).to_vector<float>();
  CHECK(std::isnan(y[0]));
  CHECK(y[1] == 8);
  Tensor ints = from_vector<int32_t>({-5, -4, -3, -2, -1, -6, -7, -8, -9}, {1, 3, 3});
  Tensor yi = max_pool2d(ints, {2, 2}, {2, 2}, {1, 1});
  CHECK(yi.dtype() == DType::Int32);
  CHECK(yi.to_vector<int32_t>() == std::vector<int32_t>{-5, -3, -2, -1});
  CHECK(max_pool2d(from_vector<uint8_t>({0, 3, 2, 1}, {1, 2, 2}), {2, 2}, {1, 1}, {1, 1}).to_vector<uint8_t>() ==
        std::vector<uint8_t>{0, 3, 3, 2, 3, 3, 2, 2, 1});
}

TEST_CASE("max_pool2d sends the gradient to the first maximum, as PyTorch", "[pooling]") {
  // Small integers: windows are full of ties, overlapping windows share their winners.
  uint64_t seed = 300;
  for (const PoolCase& p : kMaxCases) {
    INFO(describe(p));
    std::vector<double> xs = random_values(static_cast<size_t>(numel(p.shape)), ++seed, true);
    Reference r = reference_pool(xs, p, true);
    std::vector<double> dy = random_values(r.y.size(), ++seed);
    Tensor x = from_doubles(xs, p.shape, DType::Float64).requires_grad_();
    Tensor y = run_pool(x, p, true);
    check_close(y, r.y, 0, 0);
    Tensor dx = grad(y, {x}, from_doubles(dy, r.shape, DType::Float64))[0];
    check_close(dx, reference_grad(r, p, true, dy), 1e-12, 1e-12);
  }
  // A window of equal values: all of its gradient goes to its top-left element.
  Tensor x = zeros({1, 1, 2, 2}).requires_grad_();
  Tensor dx = grad(max_pool2d(x, {2, 2}).sum(), {x})[0];
  check_close(dx, {1, 0, 0, 0});
}

TEST_CASE("avg_pool2d gradients match the reference", "[pooling]") {
  uint64_t seed = 400;
  for (const PoolCase& p : kAvgCases) {
    INFO(describe(p));
    std::vector<double> xs = random_values(static_cast<size_t>(numel(p.shape)), ++seed);
    Reference r = reference_pool(xs, p, false);
    std::vector<double> dy = random_values(r.y.size(), ++seed);
    Tensor x = from_doubles(xs, p.shape, DType::Float64).requires_grad_();
    Tensor dx = grad(run_pool(x, p, false), {x}, from_doubles(dy, r.shape, DType::Float64))[0];
    check_close(dx, reference_grad(r, p, false, dy), 1e-12, 1e-12);
  }
}

TEST_CASE("gradients of max_pool2d and avg_pool2d", "[pooling][gradcheck]") {
  // Distinct values keep max pooling away from ties, where it is not differentiable.
  Tensor x = kiln::testing::distinct({1, 1, 5, 6}, 0.05, 500);
  CHECK_GRADIENTS([](const Inputs& v) { return max_pool2d(v[0], {2, 2}); },
                  {kiln::testing::distinct({1, 2, 4, 4}, 0.05, 501)});
  CHECK_GRADIENTS([](const Inputs& v) { return max_pool2d(v[0], {3, 3}, {2, 2}, {1, 1}, {1, 1}, true); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return max_pool2d(v[0], {2, 2}, {1, 1}, {1, 0}, {2, 2}); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return avg_pool2d(v[0], {2, 2}); },
                  {kiln::testing::uniform({1, 2, 4, 4}, -1, 1, 502)});
  CHECK_GRADIENTS([](const Inputs& v) { return avg_pool2d(v[0], {3, 3}, {2, 2}, {1, 1}, true, false); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return avg_pool2d(v[0], {2, 3}, {1, 2}, {1, 1}); }, {x});
  // (C, H, W) input, pooled twice.
  CHECK_GRADIENTS([](const Inputs& v) { return avg_pool2d(max_pool2d(v[0], {2, 2}, {1, 1}), {2, 2}, {1, 1}); },
                  {kiln::testing::distinct({2, 4, 4}, 0.05, 503)});
}

TEST_CASE("pooling errors name the op and the problem", "[pooling]") {
  Tensor x = zeros({1, 1, 4, 4});
  auto fails_with = [](const std::function<void()>& f, const std::string& text) {
    try {
      f();
      FAIL("no error");
    } catch (const Error& e) {
      INFO(e.what());
      CHECK_THAT(e.what(), Catch::Contains(text));
    }
  };
  fails_with([&] { max_pool2d(zeros({4, 4}), {2, 2}); }, "max_pool2d");
  fails_with([&] { max_pool2d(zeros({1, 1, 1, 4, 4}), {2, 2}); }, "(N, C, H, W)");
  fails_with([&] { max_pool2d(zeros({1, 0, 4, 4}), {2, 2}); }, "non-zero");
  fails_with([&] { max_pool2d(x, {0, 2}); }, "kernel must be positive");
  fails_with([&] { max_pool2d(x, {2, 2}, {-1, 1}); }, "stride must be positive");
  fails_with([&] { max_pool2d(x, {2, 2}, {2, 2}, {0, 0}, {0, 1}); }, "dilation must be positive");
  fails_with([&] { max_pool2d(x, {2, 2}, {2, 2}, {2, 0}); }, "half the kernel");
  fails_with([&] { avg_pool2d(x, {3, 3}, {1, 1}, {-1, 0}); }, "padding");
  fails_with([&] { max_pool2d(x, {5, 5}); }, "too small");
  fails_with([&] { max_pool2d(x, {2, 2}, {1, 1}, {0, 0}, {4, 1}); }, "too small");
  fails_with([&] { max_pool2d(zeros({1, 1, 3, 3}), {2, 2}, {1, 1}, {1, 1}, {4, 4}); }, "only padding");
  fails_with([&] { avg_pool2d(zeros({1, 1, 4, 4}, DType::Int32), {2, 2}); }, "float");
  fails_with([&] { max_pool2d(zeros({1, 1, 4, 4}, DType::Bool), {2, 2}); }, "bool");
}

TEST_CASE("MaxPool2d and AvgPool2d modules", "[pooling][nn]") {
  manual_seed(3);
  Tensor x = randn({2, 3, 6, 6});
  nn::MaxPool2d pool(2);
  CHECK(pool.parameters().empty());
  CHECK(pool.options().kernel_size() == Pair{2, 2});
  CHECK_THAT(pool.to_string(), Catch::Contains("MaxPool2d(kernel_size=(2, 2), stride=(2, 2)"));
  CHECK(pool.forward(x).to_vector<float>() == max_pool2d(x, {2, 2}).to_vector<float>());

  nn::MaxPool2d overlapping(nn::MaxPool2dOptions(3).stride(2).padding(1).ceil_mode(true));
  CHECK(overlapping.options().stride() == Pair{2, 2});
  CHECK(overlapping.forward(x).to_vector<float>() ==
        max_pool2d(x, {3, 3}, {2, 2}, {1, 1}, {1, 1}, true).to_vector<float>());
  nn::MaxPool2d rectangular(nn::MaxPool2dOptions({2, 3}).stride({1, 2}).dilation({2, 1}));
  CHECK(rectangular.forward(x).shape() == Shape{2, 3, 4, 2});

  nn::AvgPool2d avg(nn::AvgPool2dOptions(3).stride(2).padding(1).count_include_pad(false));
  CHECK_THAT(avg.to_string(), Catch::Contains("count_include_pad=false"));
  CHECK(avg.forward(x).to_vector<float>() ==
        avg_pool2d(x, {3, 3}, {2, 2}, {1, 1}, false, false).to_vector<float>());
  CHECK(nn::AvgPool2d(2).forward(x).shape() == Shape{2, 3, 3, 3});

  // In a Sequential with the other layers; eval mode changes nothing.
  nn::Sequential net(nn::MaxPool2d(2), nn::Flatten(), nn::Linear(27, 4));
  CHECK(net.forward(x).shape() == Shape{2, 4});
  pool.eval();
  CHECK(pool.forward(x).to_vector<float>() == max_pool2d(x, {2, 2}).to_vector<float>());
  CHECK_THROWS_AS(nn::MaxPool2d(2).forward(randn({6, 6})), Error);
}

TEST_CASE("tiled max pooling keeps one byte per output for its backward", "[pooling][planner]") {
  // The scheduler stores the int8 window offset, not the int32 position computed from it.
  Tensor x = randn({2, 3, 8, 8}).realize().requires_grad_();
  Tensor loss = max_pool2d(x, {2, 2}).sum();
  kiln::jit::SavedForBackward saved = kiln::jit::saved_for_backward(loss, {x});
  CHECK(saved.activations == 2 * 3 * 4 * 4);
  // Overlapping windows take the general path: int32 positions.
  Tensor overlapping = max_pool2d(x, {2, 2}, {1, 1}).sum();
  CHECK(kiln::jit::saved_for_backward(overlapping, {x}).activations >= 2 * 3 * 7 * 7 * 4);
}

namespace {

// Whether the pending graph of t records op (the host kernel's node, or not).
bool records(const Tensor& t, Op op) {
  std::vector<const Node*> stack{t.node().get()};
  for (size_t seen = 0; !stack.empty() && seen < 10000; ++seen) {
    const Node* n = stack.back();
    stack.pop_back();
    if (n->op == op) return true;
    for (const NodePtr& in : n->inputs) stack.push_back(in.get());
  }
  return false;
}

}  // namespace

TEST_CASE("the host window arg-max of tiled max pooling agrees with the select chain", "[pooling]") {
  // float32, float64 and bfloat16 inputs take prim::max_pool_offsets, and their gradient
  // prim::max_pool_scatter (AVX-512 for float32 and bfloat16 2 x 2 windows, plain C++ otherwise);
  // float16 takes the JIT's select chain and scatter-add. Values exact in float16 (small
  // integers: ties everywhere; signed zeros, infinities, NaNs) must give the same outputs and
  // send the gradient to the same elements. Widths cover the vector path's partial steps.
  struct Case {
    Shape shape;
    Pair kernel;
  };
  const std::vector<Case> cases = {
      {{2, 3, 4, 2}, {2, 2}},   {{1, 2, 6, 14}, {2, 2}}, {{1, 2, 2, 16}, {2, 2}}, {{2, 1, 4, 18}, {2, 2}},
      {{1, 3, 4, 28}, {2, 2}},  {{1, 1, 2, 32}, {2, 2}}, {{1, 2, 4, 34}, {2, 2}}, {{1, 1, 2, 66}, {2, 2}},
      {{1, 2, 6, 9}, {3, 3}},   {{2, 1, 4, 9}, {2, 3}},  {{1, 2, 3, 8}, {1, 2}},  {{1, 1, 4, 130}, {2, 2}},
      {{1, 1, 6, 140}, {3, 2}},
  };
  std::mt19937_64 rng(17);
  const double specials[] = {0.0, -0.0, INFINITY, -INFINITY, NAN};
  for (const Case& c : cases) {
    INFO("input " << shape_str(c.shape) << " kernel " << c.kernel[0] << " x " << c.kernel[1]);
    std::vector<double> xs(static_cast<size_t>(numel(c.shape)));
    for (double& v : xs) {
      const uint64_t r = rng() % 100;
      v = r < 20 ? specials[r % 5] : std::floor(static_cast<double>(r % 9)) - 4.0;  // 4% NaN
    }
    Shape out_shape = {c.shape[0], c.shape[1], c.shape[2] / c.kernel[0], c.shape[3] / c.kernel[1]};
    std::vector<double> dy(static_cast<size_t>(numel(out_shape)));
    // -0.0 among them: a scatter-add into zeros stores +0.0 there, and so must the host kernel.
    for (double& v : dy) v = rng() % 8 == 0 ? -0.0 : static_cast<double>(rng() % 7) + 1.0;
    auto pool = [&](DType t, std::vector<double>& y, std::vector<double>& dx) {
      Tensor x = from_doubles(xs, c.shape, t).requires_grad_();
      Tensor out = max_pool2d(x, c.kernel);
      CHECK(records(out, Op::MaxPoolOffsets) == (t != DType::Float16));
      const Tensor gx = grad(out, {x}, from_doubles(dy, out_shape, t))[0];
      CHECK(records(gx, Op::MaxPoolScatter) == (t != DType::Float16));
      y = cast(out, DType::Float64).to_vector<double>();
      dx = cast(gx, DType::Float64).to_vector<double>();

    };
    std::vector<double> y16, dx16;
    pool(DType::Float16, y16, dx16);
    for (DType t : {DType::Float32, DType::Float64, DType::BFloat16}) {
      INFO(dtype_name(t));
      std::vector<double> y, dx;
      pool(t, y, dx);
      REQUIRE(y.size() == y16.size());
      for (size_t i = 0; i < y.size(); ++i) {
        INFO("output " << i);
        CHECK(std::isnan(y[i]) == std::isnan(y16[i]));
        if (!std::isnan(y[i])) CHECK(y[i] == y16[i]);
        CHECK(std::signbit(y[i]) == std::signbit(y16[i]));  // which zero won
      }
      CHECK(dx == dx16);
      for (size_t i = 0; i < dx.size(); ++i) CHECK(std::signbit(dx[i]) == std::signbit(dx16[i]));
    }
  }
}

TEST_CASE("prim::max_pool_offsets: the first maximum's offset, int8 or int32, and its errors", "[pooling]") {
  // [1, 3; 3, 2] picks (0, 1); all equal: (0, 0); [0, NaN; 1, NaN] the first NaN, (0, 1), also
  // where an earlier element equals the maximum of the others, as in [5, NaN; 5, 3].
  Tensor x = from_vector<float>({1, 3, 5, 5, 0, NAN, 5, NAN, 3, 2, 5, 5, 1, NAN, 5, 3}, {1, 1, 2, 8});
  for (DType t : {DType::Float32, DType::Float64, DType::BFloat16}) {
    Tensor off = prim::max_pool_offsets(cast(x, t), 2, 2, DType::Int8);
    CHECK(off.dtype() == DType::Int8);
    CHECK(off.to_vector<int8_t>() == std::vector<int8_t>{1, 0, 1, 1});
    // The gather reads the window's element at each offset; one outside its window is an error.
    const Tensor pooled = prim::max_pool_gather(cast(x, t), off, 2, 2);
    const std::vector<double> y = cast(pooled, DType::Float64).to_vector<double>();
    CHECK(y[0] == 3);
    CHECK(y[1] == 5);
    CHECK((std::isnan(y[2]) && std::isnan(y[3])));
    for (int8_t bad : {int8_t{2}, int8_t{-1}, int8_t{10}}) {
      Tensor wrong = from_vector<int8_t>({1, 0, bad, 1}, {1, 1, 1, 4});
      CHECK_THROWS_WITH(prim::max_pool_gather(cast(x, t), wrong, 2, 2).realize(),
                        Catch::Contains("max_pool_gather") && Catch::Contains("outside its (2, 2) window"));
    }
  }
  // Offsets past 127 need int32: (1, 1) of a 200-wide window pair is 201.
  std::vector<float> wide(400, 0.0f);
  wide[201] = 1;
  Tensor off32 = prim::max_pool_offsets(from_vector<float>(wide, {1, 1, 2, 200}), 2, 2, DType::Int32);
  CHECK(off32.to_vector<int32_t>()[0] == 201);
  CHECK_THROWS_WITH(prim::max_pool_offsets(from_vector<float>(wide, {1, 1, 2, 200}), 2, 2, DType::Int8),
                    Catch::Contains("max_pool_offsets") && Catch::Contains("int32"));
  CHECK_THROWS_WITH(prim::max_pool_offsets(randn({1, 1, 3, 4}), 2, 2, DType::Int8),
                    Catch::Contains("tiled by (2, 2)"));
}

TEST_CASE("max_pool2d of a relu pools first, with the same values and gradients", "[pooling]") {
  // relu(max_pool2d(z)) replaces max_pool2d(relu(z)); the reference spells relu as a where, which
  // the rewrite does not recognize. Small integers and signed zeros: ties and zero maxima.
  const std::vector<PoolCase> cases = {
      {{2, 3, 8, 8}, {2, 2}},                  // tiled: the host arg-max kernel
      {{2, 2, 7, 8}, {3, 3}, {2, 2}, {1, 1}},  // overlapping, padded: the general path
  };
  uint64_t seed = 500;
  for (const PoolCase& p : cases)
    for (DType t : {DType::Float32, DType::Float64}) {
      INFO(describe(p) << " " << dtype_name(t));
      std::vector<double> zs = random_values(static_cast<size_t>(numel(p.shape)), ++seed, true);
      for (size_t i = 0; i < zs.size(); i += 7) zs[i] = -0.0;
      Tensor z = from_doubles(zs, p.shape, t).requires_grad_();
      Tensor y = run_pool(relu(z), p, true);
      CHECK(y.node()->op == Op::Max);  // the relu comes last
      Tensor y_ref = run_pool(where(le(z, zeros_like(z)), zeros_like(z), z), p, true);
      const std::vector<double> a = cast(y, DType::Float64).to_vector<double>();
      const std::vector<double> b = cast(y_ref, DType::Float64).to_vector<double>();
      REQUIRE(a.size() == b.size());
      for (size_t i = 0; i < a.size(); ++i) CHECK((a[i] == b[i] && std::signbit(a[i]) == std::signbit(b[i])));
      std::vector<double> dy = random_values(a.size(), ++seed);
      const Tensor g = from_doubles(dy, y.shape(), t);
      CHECK(grad(y, {z}, g)[0].to_vector<double>() == grad(y_ref, {z}, g)[0].to_vector<double>());
    }
  // NaN is a maximum either way.
  Tensor z = from_vector<float>({-1, NAN, 2, 3, 4, -5, -6, -7}, {1, 2, 4});
  auto y = max_pool2d(relu(z), {2, 2}).to_vector<float>();
  CHECK(std::isnan(y[0]));
  CHECK(y[1] == 3);
  // The backward keeps the pooled values and the byte offsets, not the full-size relu output.
  Tensor x = randn({2, 3, 8, 8}).realize().requires_grad_();
  const int64_t saved = kiln::jit::saved_for_backward(max_pool2d(relu(x), {2, 2}).sum(), {x}).activations;
  CHECK(saved <= 2 * 3 * 4 * 4 * 5);
}

TEST_CASE("the relu rewrite stops at gradient boundaries and at relu against -0.0", "[pooling]") {
  Tensor z = from_vector<float>({-1, 2, -3, 0, 5, -6, 7, -8, -0.5f, -2, 1, 3, -4, 0, 2, 6}, {1, 1, 4, 4})
                 .requires_grad_();
  // A detached relu: no gradient may reach z through the pooling.
  CHECK_FALSE(max_pool2d(relu(z).detach(), {2, 2}).requires_grad());
  {
    NoGradGuard no_grad;
    Tensor h = relu(z);
    CHECK_FALSE(max_pool2d(h, {2, 2}).requires_grad());
  }
  // A relu made a leaf: its gradient goes to the leaf, not past it to z.
  Tensor h = relu(z).requires_grad_();
  Tensor y = max_pool2d(h, {2, 2});
  CHECK(grad(y.sum(), {h})[0].to_vector<float>() ==
        std::vector<float>{0, 0, 0, 0, 1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1});
  // max(z, -0.0) keeps -0.0 where z <= 0 (relu gives +0.0), so it is pooled as it is.
  Tensor neg = from_vector<float>({-1, -2, -3, -4}, {1, 1, 2, 2});
  const float m = max_pool2d(maximum(neg, full({1, 1, 2, 2}, -0.0)), {2, 2}).to_vector<float>()[0];
  CHECK((m == 0 && std::signbit(m)));
}
