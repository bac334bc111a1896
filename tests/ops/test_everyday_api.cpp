// The everyday API a PyTorch user reaches for first: functional embedding and batch_norm,
// cross_entropy over (N, C, d1, ...) with ignore_index, class weights and label smoothing, pad
// modes and crops, var/std with any correction, amax/amin, where with a non-bool condition, and
// the dtype options of the layers. Each forward is checked against a float64 loop written here
// from PyTorch's documented formula, and each op's gradient by finite differences.
#include <catch2/catch.hpp>

#include <cmath>
#include <optional>
#include <vector>

#include "core/error.h"
#include "nn/layers.h"
#include "nn/transformer.h"
#include "ops/ops.h"
#include "tests/support/compare.h"
#include "tests/support/gradcheck.h"

using kiln::DType;
using kiln::Shape;
using kiln::Tensor;
using kiln::testing::check_close;
using kiln::testing::distinct;
using kiln::testing::f32;
using kiln::testing::i64;
using kiln::testing::uniform;
using Catch::Contains;
using Inputs = std::vector<Tensor>;
namespace nn = kiln::nn;

namespace {

// PyTorch's cross entropy in float64 loops: logits (N, C, D) with labels (N, D), flattened as
// position p = n * D + d; class weights w (empty: all 1); ignore: a label that counts for nothing.
struct CrossEntropyReference {
  std::vector<double> per_position;  // Reduction::None
  double sum = 0, mean = 0;
};
CrossEntropyReference cross_entropy_reference(const std::vector<double>& logits, const std::vector<int64_t>& labels,
                                              int64_t N, int64_t C, int64_t D, const std::vector<double>& w,
                                              std::optional<int64_t> ignore, double smoothing) {
  CrossEntropyReference r;
  double weight_total = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d) {
      const int64_t y = labels[static_cast<size_t>(n * D + d)];
      if (ignore && y == *ignore) {
        r.per_position.push_back(0);
        continue;
      }
      auto logit = [&](int64_t c) { return logits[static_cast<size_t>((n * C + c) * D + d)]; };
      double m = logit(0), z = 0;
      for (int64_t c = 1; c < C; ++c) m = std::max(m, logit(c));
      for (int64_t c = 0; c < C; ++c) z += std::exp(logit(c) - m);
      auto log_p = [&](int64_t c) { return logit(c) - m - std::log(z); };
      auto weight = [&](int64_t c) { return w.empty() ? 1.0 : w[static_cast<size_t>(c)]; };
      double smooth = 0;
      for (int64_t c = 0; c < C; ++c) smooth += weight(c) * -log_p(c);
      const double loss = (1 - smoothing) * weight(y) * -log_p(y) + smoothing / static_cast<double>(C) * smooth;
      r.per_position.push_back(loss);
      r.sum += loss;
      weight_total += weight(y);
    }
  r.mean = r.sum / weight_total;
  return r;
}

std::vector<double> values(const Tensor& t) { return t.to_doubles(); }

}  // namespace

TEST_CASE("embedding picks rows of the table for indices of any shape", "[forward][index]") {
  Tensor table = f32({0, 1, 10, 11, 20, 21}, {3, 2});
  Tensor picked = kiln::embedding(i64({2, 0, 1, 2}, {2, 2}), table);
  CHECK(picked.shape() == Shape{2, 2, 2});
  check_close(picked, {20, 21, 0, 1, 10, 11, 20, 21});
  check_close(kiln::embedding(kiln::testing::i32({1}, {1}), table), {10, 11});
  CHECK_THROWS_WITH(kiln::embedding(f32({0, 1}), table), Contains("embedding") && Contains("integers"));
  CHECK_THROWS_WITH(kiln::embedding(i64({0}, {1}), f32({1, 2})), Contains("embedding") && Contains("(V, D)"));
  // nn::Embedding is the functional form with its own table.
  nn::Embedding layer(3, 2);
  Tensor idx = i64({1, 1, 0}, {3});
  CHECK(values(layer.forward(idx)) == values(kiln::embedding(idx, layer.weight)));
}

TEST_CASE("gradient of embedding sums the repeated rows", "[gradcheck][index]") {
  Tensor idx = i64({2, 0, 2, 1, 2, 0}, {2, 3});
  CHECK_GRADIENTS([idx](const Inputs& v) { return kiln::embedding(idx, v[0] * v[0]); }, {uniform({3, 2}, -1, 1, 700)});
}

TEST_CASE("batch_norm normalizes with the batch and updates running statistics", "[forward][composite]") {
  // x (N=2, C=2, L=2): channel 0 holds 1, 2, 5, 6; channel 1 holds 0, 0, 4, 8.
  Tensor x = f32({1, 2, 0, 0, 5, 6, 4, 8}, {2, 2, 2});
  Tensor running_mean = kiln::zeros({2}).realize(), running_var = kiln::ones({2}).realize();
  Tensor weight = f32({2, 1}), bias = f32({0, -1});
  Tensor y = kiln::batch_norm(x, running_mean, running_var, weight, bias, true, 0.5, 0.0);
  const double m0 = 3.5, v0 = (6.25 + 2.25 + 2.25 + 6.25) / 4, m1 = 3, v1 = (9 + 9 + 1 + 25) / 4.0;
  auto norm = [](double v, double m, double var, double w, double b) { return (v - m) / std::sqrt(var) * w + b; };
  check_close(y, {norm(1, m0, v0, 2, 0), norm(2, m0, v0, 2, 0), norm(0, m1, v1, 1, -1), norm(0, m1, v1, 1, -1),
                  norm(5, m0, v0, 2, 0), norm(6, m0, v0, 2, 0), norm(4, m1, v1, 1, -1), norm(8, m1, v1, 1, -1)});
  // running = 0.5 * running + 0.5 * batch (the variance unbiased: 4 values, / 3).
  check_close(running_mean, {0.5 * m0, 0.5 * m1});
  check_close(running_var, {0.5 + 0.5 * v0 * 4 / 3, 0.5 + 0.5 * v1 * 4 / 3});
  // Evaluation reads the running statistics and changes nothing.
  Tensor e = kiln::batch_norm(x, running_mean, running_var, {}, {}, false, 0.5, 1e-5);
  const std::vector<double> rm = values(running_mean), rv = values(running_var);
  check_close(e.slice(1, 0, 1).reshape({4}), {(1 - rm[0]) / std::sqrt(rv[0] + 1e-5), (2 - rm[0]) / std::sqrt(rv[0] + 1e-5),
                                              (5 - rm[0]) / std::sqrt(rv[0] + 1e-5), (6 - rm[0]) / std::sqrt(rv[0] + 1e-5)});
  check_close(running_mean, rm);
  // Mistakes name the op and the shapes.
  CHECK_THROWS_WITH(kiln::batch_norm(x, {}, {}), Contains("batch_norm") && Contains("running"));
  CHECK_THROWS_WITH(kiln::batch_norm(x, kiln::zeros({3}), kiln::ones({3}), {}, {}, true),
                    Contains("batch_norm") && Contains("[3]") && Contains("[2, 2, 2]"));
  CHECK_THROWS_WITH(kiln::batch_norm(kiln::zeros({1, 2}), {}, {}, {}, {}, true), Contains("more than one value"));
  // A float64 batch keeps float32 running statistics float32 (a deliberate cast inside).
  Tensor x64 = x.to(DType::Float64);
  kiln::batch_norm(x64, running_mean, running_var, {}, {}, true).realize();
  CHECK(running_mean.dtype() == DType::Float32);
}

TEST_CASE("gradients of batch_norm in training and evaluation", "[gradcheck][composite]") {
  Tensor x = uniform({3, 2, 2}, -2, 2, 710), w = uniform({2}, 0.5, 1.5, 711), b = uniform({2}, -1, 1, 712);
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::batch_norm(v[0], {}, {}, v[1], v[2], true); }, {x, w, b});
  Tensor rm = uniform({2}, -1, 1, 713), rv = uniform({2}, 0.5, 2, 714);
  CHECK_GRADIENTS([rm, rv](const Inputs& v) { return kiln::batch_norm(v[0], rm, rv, v[1], v[2], false); }, {x, w, b});
}

TEST_CASE("cross_entropy with extra dims, ignore_index, class weights and smoothing", "[forward][composite]") {
  const int64_t N = 2, C = 3, D = 4;
  Tensor logits = uniform({N, C, D}, -2, 2, 720);
  const std::vector<int64_t> labels = {0, 2, -100, 1, 1, -100, 2, 0};
  const std::vector<double> w = {0.5, 2.0, 1.25};
  Tensor y = i64(labels, {N, D}), weight = kiln::from_vector<double>(w, {C});
  for (double s : {0.0, 0.2}) {
    for (bool weighted : {false, true}) {
      CAPTURE(s, weighted);
      auto options = kiln::CrossEntropyOptions().label_smoothing(s).ignore_index(-100);
      if (weighted) options.weight(weight);
      const CrossEntropyReference want =
          cross_entropy_reference(values(logits), labels, N, C, D, weighted ? w : std::vector<double>{}, -100, s);
      check_close(kiln::cross_entropy(logits, y, options), {want.mean}, 1e-12, 1e-12);
      check_close(kiln::cross_entropy(logits, y, options.reduction(kiln::Reduction::Sum)), {want.sum}, 1e-12, 1e-12);
      Tensor per = kiln::cross_entropy(logits, y, options.reduction(kiln::Reduction::None));
      CHECK(per.shape() == Shape{N, D});
      check_close(per, want.per_position, 1e-12, 1e-12);
    }
  }
  // (N, C) with weights only, and ignore only: the same formula.
  Tensor flat = uniform({4, C}, -2, 2, 721);
  const std::vector<int64_t> flat_labels = {2, 0, 1, 0};
  const CrossEntropyReference weighted = cross_entropy_reference(values(flat), flat_labels, 4, C, 1, w, {}, 0.1);
  check_close(kiln::cross_entropy(flat, i64(flat_labels, {4}), kiln::CrossEntropyOptions().weight(weight).label_smoothing(0.1)),
              {weighted.mean}, 1e-12, 1e-12);
  const CrossEntropyReference ignored = cross_entropy_reference(values(flat), flat_labels, 4, C, 1, {}, 0, 0);
  check_close(kiln::cross_entropy(flat, i64(flat_labels, {4}), kiln::CrossEntropyOptions().ignore_index(0)),
              {ignored.mean}, 1e-12, 1e-12);
  // float64 class weights leave a float32 loss float32.
  CHECK(kiln::cross_entropy(flat.to(DType::Float32), i64(flat_labels, {4}), kiln::CrossEntropyOptions().weight(weight))
            .dtype() == DType::Float32);
  // Every position ignored: 0 / 0, as in PyTorch.
  CHECK(std::isnan(kiln::cross_entropy(flat, i64({0, 0, 0, 0}, {4}), kiln::CrossEntropyOptions().ignore_index(0)).item()));
  // The plain (N, C) form is unchanged by an ignore_index no label equals.
  check_close(kiln::cross_entropy(flat, i64(flat_labels, {4}), kiln::CrossEntropyOptions().ignore_index(-100)),
              {kiln::cross_entropy(flat, i64(flat_labels, {4})).item()}, 1e-12, 1e-12);
  CHECK_THROWS_WITH(kiln::cross_entropy(logits, i64({0, 1}, {2})),
                    Contains("cross_entropy") && Contains("[2, 3, 4]") && Contains("[2]"));
  CHECK_THROWS_WITH(kiln::cross_entropy(flat, i64(flat_labels, {4}), kiln::CrossEntropyOptions().weight(f32({1, 2}))),
                    Contains("cross_entropy") && Contains("class weights"));
}

TEST_CASE("gradients of cross_entropy with extra dims, ignore_index, weights and smoothing", "[gradcheck][composite]") {
  Tensor y = i64({0, 2, 1, 1, 1, 0}, {2, 3});
  Tensor weight = kiln::from_vector<double>({0.5, 2.0, 1.25}, {3});
  for (double s : {0.0, 0.3}) {
    CAPTURE(s);
    auto options = kiln::CrossEntropyOptions().label_smoothing(s).ignore_index(1).weight(weight);
    CHECK_GRADIENTS([y, options](const Inputs& v) { return kiln::cross_entropy(v[0], y, options); },
                    {uniform({2, 3, 3}, -2, 2, 730)});
    CHECK_GRADIENTS(
        [y, options](const Inputs& v) {
          return kiln::cross_entropy(v[0], y, kiln::CrossEntropyOptions(options).reduction(kiln::Reduction::None));
        },
        {uniform({2, 3, 3}, -2, 2, 731)});
  }
}

TEST_CASE("pad with a fill value, reflect and replicate modes, and crops", "[forward][movement]") {
  Tensor a = f32({1, 2, 3, 4, 5, 6}, {2, 3});
  check_close(kiln::pad(a, {{0, 0}, {1, 1}}, 7.0), {7, 1, 2, 3, 7, 7, 4, 5, 6, 7});
  check_close(kiln::pad(a, {{1, 0}}, -1.0), {-1, -1, -1, 1, 2, 3, 4, 5, 6});
  check_close(kiln::pad(a, {{0, 0}, {2, 2}}, kiln::PadMode::Reflect), {3, 2, 1, 2, 3, 2, 1, 6, 5, 4, 5, 6, 5, 4});
  check_close(kiln::pad(a, {{0, 0}, {2, 1}}, kiln::PadMode::Replicate), {1, 1, 1, 2, 3, 3, 4, 4, 4, 5, 6, 6});
  check_close(kiln::pad(a, {{1, 1}, {1, 0}}, kiln::PadMode::Replicate),
              {1, 1, 2, 3, 1, 1, 2, 3, 4, 4, 5, 6, 4, 4, 5, 6});
  // Negative pads crop, in every mode, and mix with growth on the other side.
  check_close(kiln::pad(a, {{0, 0}, {-1, 0}}), {2, 3, 5, 6});
  check_close(kiln::pad(a, {{-1, 1}, {0, -2}}, 9.0), {4, 9});
  check_close(kiln::pad(a, {{0, 0}, {-1, 1}}, kiln::PadMode::Reflect), {2, 3, 2, 5, 6, 5});
  check_close(kiln::pad(a, {{0, 0}, {1, -2}}, kiln::PadMode::Replicate), {1, 1, 4, 4});
  // Against a float64 loop on a transposed view.
  Tensor x = uniform({4, 3}, -1, 1, 740);
  const std::vector<double> xt = values(x.t());  // (3, 4)
  std::vector<double> want;
  for (int64_t i = -2; i < 3 + 1; ++i)
    for (int64_t j = -3; j < 4 + 2; ++j) {
      const int64_t r = i < 0 ? -i : i > 2 ? 4 - i : i, c = j < 0 ? -j : j > 3 ? 6 - j : j;
      want.push_back(xt[static_cast<size_t>(r * 4 + c)]);
    }
  check_close(kiln::pad(x.t(), {{2, 1}, {3, 2}}, kiln::PadMode::Reflect), want, 0, 0);
  CHECK_THROWS_WITH(kiln::pad(a, {{0, 0}, {3, 0}}, kiln::PadMode::Reflect),
                    Contains("pad") && Contains("reflect") && Contains("[2, 3]"));
  CHECK_THROWS_WITH(kiln::pad(a, {{-3, 0}}), Contains("pad") && Contains("crops more"));
  CHECK_THROWS_WITH(kiln::pad(a, {{1, 0}}, kiln::PadMode::Replicate, 2.0), Contains("PadMode::Constant"));
}

TEST_CASE("gradients of pad modes and crops", "[gradcheck][movement]") {
  Tensor x = uniform({3, 4}, -1, 1, 750);
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::pad(v[0] * v[0], {{1, 1}, {2, 3}}, kiln::PadMode::Reflect); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::pad(v[0], {{2, 0}, {1, 2}}, kiln::PadMode::Replicate); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::pad(v[0].t(), {{-1, 2}, {1, -1}}, 0.5); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::pad(v[0], {{0, 0}, {-1, 2}}, kiln::PadMode::Reflect); }, {x});
}

TEST_CASE("var and std with any correction", "[forward][reduce]") {
  Tensor x = f32({1, 2, 4, 7, 0, 0, 3, 5}, {2, 4});
  // Row sums of squared deviations: mean 3.5 -> 6.25 + 2.25 + 0.25 + 12.25 = 21; mean 2 -> 4 + 4 + 1 + 9 = 18.
  for (int64_t correction : {0, 1, 2, 3}) {
    CAPTURE(correction);
    const double n = 4.0 - static_cast<double>(correction);
    auto options = kiln::VarianceOptions().correction(correction);
    check_close(kiln::var(x, {1}, options), {21 / n, 18 / n});
    check_close(kiln::std(x, {1}, options), {std::sqrt(21 / n), std::sqrt(18 / n)});
  }
  CHECK(kiln::var(x, {1}, kiln::VarianceOptions().keepdim(true)).shape() == Shape{2, 1});
  // All 8 (mean 2.75): 21 + 18 within the rows, 4 * 0.75^2 * 2 between them.
  check_close(kiln::var(x, {}, kiln::VarianceOptions()), {43.5 / 7});
  // n - correction <= 0: inf, or NaN for a zero sum, as PyTorch.
  check_close(kiln::var(x, {1}, kiln::VarianceOptions().correction(4)), {kiln::testing::kInf, kiln::testing::kInf});
  CHECK(std::isnan(kiln::var(f32({2}), {0}, kiln::VarianceOptions()).item()));
  // The bool spellings keep their old meaning (biased by default) and their old clamp.
  check_close(kiln::var(x, {1}), {21 / 4.0, 18 / 4.0});
  check_close(kiln::std(x, {1}, false, true), {std::sqrt(7.0), std::sqrt(6.0)});
  check_close(kiln::var(f32({2}), {0}, false, true), {0});
  CHECK_THROWS_WITH(kiln::var(x, {1}, kiln::VarianceOptions().correction(-1)), Contains("var") && Contains("correction"));
}

TEST_CASE("gradients of var and std with a correction", "[gradcheck][reduce]") {
  Tensor x = uniform({3, 4}, -2, 2, 760);
  for (int64_t correction : {0, 1, 2}) {
    CAPTURE(correction);
    auto options = kiln::VarianceOptions().correction(correction);
    CHECK_GRADIENTS([options](const Inputs& v) { return kiln::var(v[0], {1}, options); }, {x});
    CHECK_GRADIENTS(
        [options](const Inputs& v) { return kiln::std(v[0], {0}, kiln::VarianceOptions(options).keepdim(true)); }, {x});
  }
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::std(v[0]); }, {x});
}

TEST_CASE("amax and amin are max and min", "[forward][reduce]") {
  Tensor x = f32({3, -1, 4, 1, -5, 9}, {2, 3});
  check_close(kiln::amax(x, {1}), {4, 9});
  check_close(kiln::amin(x, {0}, true), {1, -5, 4});
  check_close(kiln::amax(x), {9});
  check_close(kiln::amin(i64({3, -7, 2}, {3})), {-7});
}

TEST_CASE("gradients of amax and amin", "[gradcheck][reduce]") {
  Tensor x = distinct({2, 3}, 0.1, 770);
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::amax(v[0], {1}); }, {x});
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::amin(v[0] * v[0], {0}, true); }, {x});
  // Ties share the gradient evenly.
  CHECK_GRADIENTS([](const Inputs& v) { return kiln::amax(v[0]); }, {kiln::from_vector<double>({1, 3, 3, 0}, {4})});
}

TEST_CASE("where takes a non-bool condition as nonzero = true", "[forward][elementwise]") {
  Tensor a = f32({1, 2, 3, 4}), b = f32({-1, -2, -3, -4});
  check_close(kiln::where(i64({0, 5, -1, 0}, {4}), a, b), {-1, 2, 3, -4});
  check_close(kiln::where(f32({0.0, -0.0, kiln::testing::kNaN, 0.25}), a, b), {-1, -2, 3, 4});
  Tensor cond = kiln::from_vector<double>({0, 1, 0, -2}, {4});
  CHECK_GRADIENTS([cond](const Inputs& v) { return kiln::where(cond, v[0] * v[0], v[0]); }, {uniform({4}, -1, 1, 780)});
}

TEST_CASE("layers that hold parameters take a dtype", "[nn][dtype]") {
  nn::LayerNorm ln(nn::LayerNormOptions({3}).dtype(DType::Float64));
  nn::Embedding emb(nn::EmbeddingOptions(5, 3).dtype(DType::Float64));
  nn::BatchNorm1d bn(nn::BatchNormOptions(3).dtype(DType::Float64));
  for (const Tensor& t : {ln.weight, ln.bias, emb.weight, bn.weight, bn.bias, bn.running_mean, bn.running_var})
    CHECK(t.dtype() == DType::Float64);
  Tensor x = uniform({4, 3}, -2, 2, 790);
  CHECK(ln.forward(x).dtype() == DType::Float64);
  CHECK(emb.forward(i64({4, 0}, {2})).dtype() == DType::Float64);
  Tensor y = bn.forward(x);  // training: the float64 running statistics are updated as float64
  CHECK(y.dtype() == DType::Float64);
  kiln::sync({y, bn.running_mean, bn.running_var});
  CHECK(bn.running_mean.dtype() == DType::Float64);
  // The running mean after one step: momentum 0.1 times the batch mean, in float64 exactly.
  const std::vector<double> xs = values(x);
  for (int c = 0; c < 3; ++c) {
    double m = 0;
    for (int n = 0; n < 4; ++n) m += xs[static_cast<size_t>(n * 3 + c)];
    CHECK(values(bn.running_mean)[static_cast<size_t>(c)] == Approx(0.1 * m / 4).epsilon(1e-14));
  }
  CHECK(nn::BatchNorm2d(nn::BatchNormOptions(2).dtype(DType::BFloat16)).weight.dtype() == DType::BFloat16);
  // The transformer layers pass theirs down to every parameter.
  nn::MultiheadAttention attention(nn::MultiheadAttentionOptions(4, 2).fused_qkv(false).dtype(DType::Float64));
  nn::GPT gpt(nn::GPTConfig().vocab(7).ctx(4).layers(1).heads(2).dim(4).tie_weights(false).dtype(DType::Float64));
  for (nn::Module* m : std::vector<nn::Module*>{&attention, &gpt})
    for (const auto& [name, p] : m->named_parameters()) {
      CAPTURE(name);
      CHECK(p.dtype() == DType::Float64);
    }
  CHECK(gpt.forward(i64({1, 2, 3, 4, 5, 6}, {2, 3})).dtype() == DType::Float64);
  CHECK(nn::Embedding(2, 2).weight.dtype() == DType::Float32);
  CHECK_THROWS_WITH(nn::Embedding(nn::EmbeddingOptions(2, 2).dtype(DType::Int64)), Contains("Embedding"));
}
