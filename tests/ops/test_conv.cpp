// conv2d: forward against a plain loop, float64 gradient checks of the unfold + matmul path, and
// the oneDNN passes (forward, backward data, backward weight, and the gradients of those) against
// the float64 path, over strides, padding, dilation, groups and rectangular kernels.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "core/autograd.h"
#include "core/error.h"
#include "backends/cpu/compiler.h"
#include "jit/disk_cache.h"
#include "jit/stats.h"
#include "backends/cpu/conv_onednn.h"
#include "ops/ops.h"
#include "ops/primitive.h"
#include "tests/support/gradcheck.h"

using namespace kiln;
using testing::analytic_gradients;
using testing::gradcheck;
using testing::uniform;

namespace {

struct Case {
  const char* name;
  Shape x, w;  // x (N, C, H, W), w (OC, C / groups, KH, KW)
  std::array<int64_t, 2> stride{1, 1}, padding{0, 0}, dilation{1, 1};
  int64_t groups = 1;
};

const std::vector<Case> kCases = {
    {"3x3 pad 1", {2, 3, 5, 5}, {4, 3, 3, 3}, {1, 1}, {1, 1}},
    {"stride 2, odd input", {1, 2, 7, 6}, {3, 2, 3, 3}, {2, 2}, {1, 1}},
    {"rectangular kernel, mixed stride", {2, 2, 6, 7}, {2, 2, 2, 3}, {1, 2}, {0, 1}},
    {"dilation 2", {1, 2, 7, 7}, {2, 2, 3, 3}, {1, 1}, {2, 2}, {2, 2}},
    {"groups 2", {2, 4, 5, 5}, {6, 2, 3, 3}, {1, 1}, {1, 1}, {1, 1}, 2},
    {"depthwise", {1, 3, 4, 4}, {3, 1, 3, 3}, {1, 1}, {1, 1}, {1, 1}, 3},
    {"1x1", {2, 3, 3, 4}, {5, 3, 1, 1}},
};

// y[n, o, i, j] = b[o] + sum_{c, a, b} w[o, c, a, b] * x[n, g*Cg + c, i*s - p + a*d, j*s - p + b*d].
std::vector<double> reference(const Case& c, const std::vector<double>& x, const std::vector<double>& w,
                              const std::vector<double>& bias, Shape& y_shape) {
  const int64_t N = c.x[0], C = c.x[1], H = c.x[2], W = c.x[3], OC = c.w[0], KH = c.w[2], KW = c.w[3];
  const int64_t Cg = C / c.groups, OCg = OC / c.groups;
  const int64_t OH = (H + 2 * c.padding[0] - c.dilation[0] * (KH - 1) - 1) / c.stride[0] + 1;
  const int64_t OW = (W + 2 * c.padding[1] - c.dilation[1] * (KW - 1) - 1) / c.stride[1] + 1;
  y_shape = {N, OC, OH, OW};
  std::vector<double> y(static_cast<size_t>(N * OC * OH * OW));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o)
      for (int64_t i = 0; i < OH; ++i)
        for (int64_t j = 0; j < OW; ++j) {
          double acc = bias.empty() ? 0.0 : bias[o];
          for (int64_t ci = 0; ci < Cg; ++ci)
            for (int64_t a = 0; a < KH; ++a)
              for (int64_t b = 0; b < KW; ++b) {
                int64_t h = i * c.stride[0] - c.padding[0] + a * c.dilation[0];
                int64_t v = j * c.stride[1] - c.padding[1] + b * c.dilation[1];
                if (h < 0 || h >= H || v < 0 || v >= W) continue;
                int64_t cin = o / OCg * Cg + ci;
                acc += w[((o * Cg + ci) * KH + a) * KW + b] * x[((n * C + cin) * H + h) * W + v];
              }
          y[((n * OC + o) * OH + i) * OW + j] = acc;
        }
  return y;
}

Tensor run_conv(const Case& c, const Tensor& x, const Tensor& w, const Tensor& b = {}) {
  return conv2d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
}

}  // namespace

TEST_CASE("conv2d forward matches a plain loop in float64 and float32", "[conv]") {
  for (const Case& c : kCases) {
    SECTION(c.name) {
      Tensor x = uniform(c.x, -1, 1, 1), w = uniform(c.w, -1, 1, 2), b = uniform({c.w[0]}, -1, 1, 3);
      Shape y_shape;
      auto expected = reference(c, x.to_vector<double>(), w.to_vector<double>(), b.to_vector<double>(), y_shape);
      for (DType t : {DType::Float64, DType::Float32}) {
        INFO(dtype_name(t));
        Tensor y = run_conv(c, x.cast(t), w.cast(t), b.cast(t));
        REQUIRE(y.shape() == y_shape);
        auto got = y.cast(DType::Float64).to_vector<double>();
        double tol = t == DType::Float64 ? 1e-12 : 1e-5;
        for (size_t i = 0; i < got.size(); ++i) REQUIRE(std::abs(got[i] - expected[i]) <= tol);
      }
    }
  }
}

TEST_CASE("conv2d of an unbatched (C, H, W) input", "[conv]") {
  Tensor x = uniform({2, 4, 4}, -1, 1, 4), w = uniform({3, 2, 3, 3}, -1, 1, 5);
  Tensor y = conv2d(x, w, {}, {1, 1}, {1, 1});
  REQUIRE(y.shape() == Shape{3, 4, 4});
  auto batched = conv2d(unsqueeze(x, 0), w, {}, {1, 1}, {1, 1}).to_vector<double>();
  CHECK(y.to_vector<double>() == batched);
}

TEST_CASE("conv2d gradients match finite differences in float64", "[conv][gradcheck]") {
  // Small shapes: a check runs the graph twice per input element.
  const std::vector<Case> cases = {
      {"stride 2, pad 1", {1, 2, 4, 4}, {2, 2, 3, 3}, {2, 2}, {1, 1}},
      {"dilation, groups", {1, 4, 5, 4}, {2, 2, 2, 2}, {1, 1}, {0, 1}, {2, 1}, 2},
  };
  for (const Case& c : cases) {
    SECTION(c.name) {
      auto f = [&](const std::vector<Tensor>& in) { return run_conv(c, in[0], in[1], in[2]); };
      auto result = gradcheck(f, {uniform(c.x, -1, 1, 6), uniform(c.w, -1, 1, 7), uniform({c.w[0]}, -1, 1, 8)});
      INFO(result.report);
      CHECK(result.ok);
    }
  }
}

TEST_CASE("oneDNN conv2d backward passes match the float64 gradients", "[conv]") {
  for (const Case& c : kCases) {
    SECTION(c.name) {
      auto f = [&](const std::vector<Tensor>& in) { return tanh(run_conv(c, in[0], in[1], in[2])); };
      std::vector<Tensor> at = {uniform(c.x, -1, 1, 9), uniform(c.w, -1, 1, 10), uniform({c.w[0]}, -1, 1, 11)};
      auto exact = analytic_gradients(f, at, DType::Float64);
      auto fast = analytic_gradients(f, at, DType::Float32);
      for (size_t i = 0; i < exact.size(); ++i) {
        INFO("input " << i);
        REQUIRE(fast[i].size() == exact[i].size());
        for (size_t j = 0; j < exact[i].size(); ++j) REQUIRE(std::abs(fast[i][j] - exact[i][j]) <= 1e-4);
      }
    }
  }
}

TEST_CASE("grad rules of the oneDNN backward passes match finite differences", "[conv]") {
  // Both passes are linear in each operand, so a central difference with a large step is exact up
  // to float32 rounding: that checks the rules of Conv2dBackwardData / Conv2dBackwardWeight
  // (second-order gradients) on the oneDNN path itself.
  const std::vector<int64_t> conv{2, 1, 1, 0, 1, 2, 1};  // stride, padding, dilation, groups
  const Shape x_shape{2, 2, 5, 6}, w_shape{3, 2, 3, 2};
  const Shape y_shape = prim::conv2d_output_shape(x_shape, w_shape, conv);
  testing::GradcheckOptions options;
  options.eps = 0.25;
  options.atol = options.rtol = 2e-4;
  auto f32 = [](const Tensor& t) { return t.cast(DType::Float32); };
  auto data = [&](const std::vector<Tensor>& in) {
    return prim::conv2d_backward_data(f32(in[0]), f32(in[1]), x_shape, conv).cast(DType::Float64);
  };
  auto weight = [&](const std::vector<Tensor>& in) {
    return prim::conv2d_backward_weight(f32(in[0]), f32(in[1]), w_shape, conv).cast(DType::Float64);
  };
  auto r1 = gradcheck(data, {uniform(y_shape, -1, 1, 12), uniform(w_shape, -1, 1, 13)}, options);
  INFO(r1.report);
  CHECK(r1.ok);
  auto r2 = gradcheck(weight, {uniform(x_shape, -1, 1, 14), uniform(y_shape, -1, 1, 15)}, options);
  INFO(r2.report);
  CHECK(r2.ok);
}

TEST_CASE("conv2d rejects mismatched shapes with a clear error", "[conv][errors]") {
  Tensor x = zeros({1, 3, 5, 5}), w = zeros({4, 3, 3, 3});
  CHECK_THROWS_WITH(conv2d(zeros({3, 5}), w), Catch::Contains("conv2d") && Catch::Contains("(N, C, H, W)"));
  CHECK_THROWS_WITH(conv2d(zeros({1, 2, 5, 5}), w), Catch::Contains("groups = 1"));
  CHECK_THROWS_WITH(conv2d(x, zeros({4, 3, 3, 3}), {}, {1, 1}, {0, 0}, {1, 1}, 3), Catch::Contains("groups = 3"));
  CHECK_THROWS_WITH(conv2d(x, zeros({4, 3, 7, 7})), Catch::Contains("does not fit"));
  CHECK_THROWS_WITH(conv2d(x, w, {}, {0, 1}), Catch::Contains("stride"));
  CHECK_THROWS_WITH(conv2d(x, w, zeros({3})), Catch::Contains("bias"));
  CHECK_THROWS_WITH(conv2d(x.cast(DType::Int32), w.cast(DType::Int32)), Catch::Contains("float"));
  CHECK_THROWS_WITH(conv2d(x, w.cast(DType::Float64)), Catch::Contains("float64"));
}

TEST_CASE("a conv training step replays from the plan cache", "[conv][train]") {
  Tensor x = uniform({4, 1, 8, 8}, -1, 1, 14).cast(DType::Float32).realize();
  Tensor w = (uniform({4, 1, 3, 3}, -0.3, 0.3, 15).cast(DType::Float32)).realize();
  Tensor b = zeros({4}).realize();
  w.requires_grad_(true);
  b.requires_grad_(true);
  Tensor target = uniform({4, 4, 4, 4}, -1, 1, 16).cast(DType::Float32).realize();
  std::vector<double> losses;
  int64_t compiles_after_first = 0;
  for (int step = 0; step < 6; ++step) {
    if (step == 1) compiles_after_first = jit::stats().plans_built;
    Tensor y = max_pool2d(relu(conv2d(x, w, b, {1, 1}, {1, 1})), {2, 2});
    Tensor loss = mse_loss(y, target);
    auto g = grad(loss, {w, b});
    w.assign((w - g[0] * 0.5).detach());
    b.assign((b - g[1] * 0.5).detach());
    sync({loss, w, b});  // forward, backward and update: one plan
    losses.push_back(loss.item());
  }
  CHECK(jit::stats().plans_built == compiles_after_first);
  CHECK(losses.back() < losses.front());
}

TEST_CASE("conv2d of an empty batch gives an empty output and zero weight gradients", "[conv]") {
  Tensor w = (uniform({3, 2, 3, 3}, -1, 1, 17).cast(DType::Float32)).realize();
  w.requires_grad_(true);
  Tensor y = conv2d(zeros({0, 2, 5, 5}), w, {}, {1, 1}, {1, 1});
  CHECK(y.shape() == Shape{0, 3, 5, 5});
  auto g = grad(y.sum(), {w});
  auto values = g[0].to_vector<float>();
  REQUIRE(values.size() == 54);
  for (float v : values) CHECK(v == 0.0f);
}
