// Dynamic int8 quantization: per-channel weights within half a step, the int8 Linear within
// 35 dB of the float one, zeros and NaN handled, no gradient, quantize_dynamic on a model.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include "ops/library.h"
#include "ops/primitive.h"

#include <cmath>
#include <filesystem>
#include <unistd.h>

using namespace kiln;

namespace {

// Signal-to-quantization-noise ratio of `got` against `want`, in dB.
double sqnr_db(const Tensor& want, const Tensor& got) {
  std::vector<double> w = want.to_doubles(), g = got.to_doubles();
  double signal = 0, noise = 0;
  for (size_t i = 0; i < w.size(); ++i) signal += w[i] * w[i], noise += (w[i] - g[i]) * (w[i] - g[i]);
  return 10 * std::log10(signal / std::max(noise, 1e-300));
}

// Kernels of the last plan that are oneDNN's int8 matmul (with `tag` in the summary).
int int8_kernels(const std::string& tag = "") {
  int n = 0;
  for (const std::string& k : memory::last_plan()->kernels)
    n += k.find("QuantizedMatmul int8") != std::string::npos && k.find(tag) != std::string::npos;
  return n;
}

struct Mlp : nn::Module {
  Mlp() : Module("Mlp") {}
  nn::Linear fc1 = register_module("fc1", nn::Linear(64, 128));
  nn::Linear fc2 = register_module("fc2", nn::Linear(128, 10));
  Tensor forward(const Tensor& x) override { return fc2.forward(relu(fc1.forward(x))); }
};

}  // namespace

TEST_CASE("per-channel int8 weights are within half a step of the float weight", "[quantize]") {
  manual_seed(1);
  Tensor w = randn({24, 40}) * 0.3;
  w = concat({w, zeros({1, 40})}, 0).realize();  // an all-zero row: scale floor, no division by zero
  nn::QuantizedWeight q = nn::quantize_per_channel(w);
  REQUIRE(q.values.dtype() == DType::Int8);
  REQUIRE(q.values.shape() == Shape{40, 25});
  std::vector<double> want = w.to_doubles(), got = nn::dequantize(q).to_doubles(), scales = q.scales.to_doubles();
  for (size_t i = 0; i < want.size(); ++i) {
    const double step = scales[i / 40];
    CHECK(std::abs(got[i] - want[i]) <= step / 2 * (1 + 1e-6));
  }
  for (int64_t i = 24 * 40; i < 25 * 40; ++i) CHECK(got[static_cast<size_t>(i)] == 0.0);
  for (int8_t v : q.values.to_vector<int8_t>()) CHECK((v >= -127 && v <= 127));
}

TEST_CASE("an int8 Linear is within 35 dB of the float one, and its kernel is oneDNN's int8 matmul", "[quantize]") {
  manual_seed(2);
  nn::Linear fc(256, 96);
  NoGradGuard no_grad;
  for (bool after_relu : {false, true}) {
    Tensor x = randn({32, 256});
    if (after_relu) x = relu(x);
    x.realize();
    Tensor want = fc.forward(x).realize();
    Tensor got = nn::quantized_linear(x, nn::quantize_per_channel(fc.weight), fc.bias).realize();
    INFO("after ReLU: " << after_relu);
    CHECK(sqnr_db(want, got) >= 35.0);
    CHECK((int8_kernels() > 0) == x.device().is_cpu());  // on a device (KILN_USE_CUDA=1): the dequantized float matmul
  }
  // Inputs of any rank and of float64 come back in their own shape and dtype.
  Tensor x3 = randn({2, 3, 256}, DType::Float64);
  Tensor y3 = nn::quantized_linear(x3, nn::quantize_per_channel(fc.weight), fc.bias);
  CHECK(y3.shape() == Shape{2, 3, 96});
  CHECK(y3.dtype() == DType::Float64);
}

TEST_CASE("a packed int8 weight gives the plain weight's products at every batch; Linear packs its own",
          "[quantize]") {
  manual_seed(4);
  const Device host = Device::cpu();
  const Tensor values = nn::quantize_per_channel((randn({96, 64}) * 0.2).to(host)).values.realize();  // (64, 96)
  const Tensor packed = prim::pack_quantized_weight(values);
  if (packed.defined()) {  // else this CPU's int8 matmul reads the plain layout: nothing to pack
    for (int64_t M : {1, 7, 33}) {
      const Tensor a = cast(clamp(floor(randn({M, 64}) * 40.0), -127, 127), DType::Int8).to(host).realize();
      CHECK(prim::quantized_matmul_packed(a, packed, 96).to_vector<float>() ==
            prim::quantized_matmul(a, values).to_vector<float>());
    }
    const Tensor a = zeros({2, 64}, DType::Int8).to(host);
    CHECK_THROWS_WITH(prim::quantized_matmul_packed(a, packed, 300), Catch::Contains("pack_quantized_weight"));
  }
  CHECK_THROWS_WITH(prim::pack_quantized_weight(values.cast(DType::Float32)), Catch::Contains("int8 (K, N)"));
  // nn::Linear after quantize_dynamic reads the packed copy, and keeps it across calls.
  Mlp net;
  net.to(host);
  nn::quantize_dynamic(net);
  NoGradGuard no_grad;
  Tensor x = randn({4, 64}).to(host);
  std::vector<float> first = net.forward(x).to_vector<float>();
  CHECK(int8_kernels(packed.defined() ? "packed" : "") == 2);
  CHECK(net.forward(x).to_vector<float>() == first);
}

TEST_CASE("an int8 Linear maps zero input to its bias and NaN input to NaN", "[quantize]") {
  manual_seed(3);
  nn::Linear fc(16, 8);
  NoGradGuard no_grad;
  nn::QuantizedWeight q = nn::quantize_per_channel(fc.weight);
  std::vector<float> y = nn::quantized_linear(zeros({4, 16}), q, fc.bias).to_vector<float>();
  std::vector<float> b = fc.bias.to_vector<float>();
  for (size_t i = 0; i < y.size(); ++i) CHECK(y[i] == b[i % 8]);  // no division by a zero range
  Tensor x = randn({4, 16});
  std::vector<float> poisoned = x.to_vector<float>();
  poisoned[5] = std::nanf("");
  for (float v : nn::quantized_linear(from_vector<float>(poisoned, {4, 16}), q, fc.bias).to_vector<float>())
    CHECK(std::isnan(v));
}

TEST_CASE("a gradient through an int8 Linear is an Error that says why", "[quantize]") {
  nn::Linear fc(8, 4);
  Tensor x = randn({2, 8}).requires_grad_();
  const nn::QuantizedWeight q = nn::quantize_per_channel(fc.weight);
  CHECK_THROWS_WITH(nn::quantized_linear(x, q), Catch::Contains("no gradient") && Catch::Contains("NoGradGuard"));
}

TEST_CASE("quantize_dynamic turns every Linear of a model int8 and keeps its outputs", "[quantize]") {
  manual_seed(4);
  Mlp model;
  Tensor x = randn({16, 64}).realize();
  NoGradGuard no_grad;
  Tensor want = model.forward(x).realize();
  CHECK(nn::quantize_dynamic(model) == 2);
  Tensor got = model.forward(x).realize();
  CHECK(sqnr_db(want, got) >= 30.0);  // two layers' noise
  CHECK(int8_kernels() == (x.device().is_cpu() ? 2 : 0));
  // The int8 weights are part of the model's state: saved, and loaded back into a quantized model;
  // a float model has no place for them.
  const std::string path = (std::filesystem::temp_directory_path() / fmt::format("kiln_q_{}.safetensors", ::getpid())).string();
  nn::save(model, path);
  nn::Metadata metadata;
  nn::load_tensors(path, &metadata);
  CHECK(metadata["fc1.weight_int8"].find("per output channel") != std::string::npos);
  manual_seed(99);
  Mlp other;
  nn::quantize_dynamic(other);
  nn::load(other, path);
  CHECK(other.forward(x).to_vector<float>() == got.to_vector<float>());
  Mlp plain;
  CHECK_THROWS_WITH(nn::load(plain, path), Catch::Contains("weight_int8"));
  std::filesystem::remove(path);
  CHECK_THROWS_WITH(nn::quantize_dynamic(model, nn::QuantizeOptions().bits(3)), Catch::Contains("bits must be 8 or 4, got 3"));
  CHECK_THROWS_WITH(nn::quantize_dynamic(model, nn::QuantizeOptions().bits(4)), Catch::Contains("already quantized to 8 bits"));
  nn::Sequential no_linear{nn::ReLU()};
  CHECK(nn::quantize_dynamic(no_linear) == 0);
}

TEST_CASE("KILN_QUANTIZE runs every Linear int8 without gradients, requantizing after an update", "[quantize]") {
  manual_seed(5);
  Mlp model;
  optim::SGD opt(model.parameters(), optim::SGDOptions(0.1));
  Tensor x = randn({8, 64}).realize();
  FlagsGuard guard;
  flags().quantize = true;
  auto plans_run = [] { return jit::stats().plans_built + jit::stats().plan_cache_hits; };
  Tensor want;
  {
    NoGradGuard no_grad;
    Tensor got = model.forward(x).realize();
    CHECK(int8_kernels() == (x.device().is_cpu() ? 2 : 0));
    FlagsGuard off;
    flags().quantize = false;
    want = model.forward(x).realize();
    CHECK(sqnr_db(want, got) >= 30.0);
  }
  {
    NoGradGuard no_grad;
    const int64_t before = plans_run();
    model.forward(x).realize();
    CHECK(plans_run() - before == 1);  // the int8 weights are cached: only the forward runs
  }
  // With gradients the layers stay float: training is unchanged.
  Tensor loss = model.forward(x).sum();
  loss.realize();
  CHECK(int8_kernels() == 0);
  opt.step(model.forward(x).pow(2.0).mean());
  {
    NoGradGuard no_grad;
    const int64_t before = plans_run();
    Tensor got = model.forward(x).realize();
    CHECK(plans_run() - before == 3);  // both weights quantized again, then the forward
    FlagsGuard off;
    flags().quantize = false;
    CHECK(sqnr_db(model.forward(x), got) >= 30.0);
  }
}

TEST_CASE("int4 weights: two per byte, within half a group's step, 20 dB from the float layer", "[quantize]") {
  manual_seed(6);
  for (int64_t group : {32, 64}) {
    Tensor w = (randn({12, 80}) * 0.2).realize();  // 80 inputs: the last group is padded with zeros
    nn::Int4Weight q = nn::quantize_int4(w, group);
    const int64_t padded = (80 + group - 1) / group * group;
    REQUIRE(q.values.dtype() == DType::UInt8);
    REQUIRE(q.values.shape() == Shape{padded / 2, 12});
    REQUIRE(q.scales.shape() == Shape{padded / group, 12});
    std::vector<double> want = w.t().to_doubles(), got = nn::dequantize(q).to_doubles(), scales = q.scales.to_doubles();
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      const size_t k = i / 12, n = i % 12;
      CHECK(std::abs(got[i] - want[i]) <= scales[(k / static_cast<size_t>(group)) * 12 + n] / 2 * (1 + 1e-6));
    }
    NoGradGuard no_grad;
    Tensor x = randn({16, 80}), bias = randn({12});
    CHECK(sqnr_db(linear(x, w, bias), nn::int4_linear(x, q, bias)) >= 20.0);
  }
  CHECK_THROWS_WITH(nn::quantize_int4(randn({4, 64}), 16), Catch::Contains("32 or 64, got 16"));
}

TEST_CASE("quantize_dynamic(bits 4) and KILN_QUANTIZE_BITS=4 run every Linear on int4 weights", "[quantize]") {
  manual_seed(7);
  Mlp model;
  Tensor x = randn({8, 64}).realize();
  NoGradGuard no_grad;
  Tensor want = model.forward(x).realize();
  {
    FlagsGuard guard;
    flags().quantize = true;
    flags().quantize_bits = 4;
    CHECK(sqnr_db(want, model.forward(x)) >= 15.0);  // two layers of 4-bit noise
  }
  CHECK(nn::quantize_dynamic(model, nn::QuantizeOptions().bits(4).group_size(64)) == 2);
  int64_t packed = 0;
  for (const auto& [name, b] : model.named_buffers())
    if (name.ends_with("weight_int4")) packed += b.numel();
  CHECK(packed == (64 * 128 + 128 * 10) / 2);  // half a byte per weight
  CHECK(sqnr_db(want, model.forward(x)) >= 15.0);
  CHECK_THROWS_WITH(nn::quantize_dynamic(model, nn::QuantizeOptions().bits(8)), Catch::Contains("already quantized to 4 bits"));
}

TEST_CASE("the int8 matmul sums the extreme products exactly at the weight limit of this CPU", "[quantize]") {
  // Without VNNI, oneDNN adds pairs of u8 x s8 products in int16: weights up to 127 would saturate
  // there, so quantize_per_channel stops at int8_weight_limit (63 on such a CPU).
  const Device host = Device::cpu();
  const int limit = int8_weight_limit(host);
  CHECK((limit == 127 || limit == 63));
  const int64_t M = 4, K = 64, N = 8;
  std::vector<int8_t> a(static_cast<size_t>(M * K)), b(static_cast<size_t>(K * N));
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<int8_t>(i % 3 == 0 ? -127 : 127);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<int8_t>(i % 5 == 0 ? -limit : limit);
  std::vector<float> want(static_cast<size_t>(M * N), 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      int64_t sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += int64_t{a[m * K + k]} * b[k * N + n];
      want[m * N + n] = static_cast<float>(sum);
    }
  const Tensor ta = from_vector<int8_t>(a, {M, K}).to(host), tb = from_vector<int8_t>(b, {K, N}).to(host);
  CHECK(prim::quantized_matmul(ta, tb).to_vector<float>() == want);
  // And the weights quantize_per_channel makes stay within the limit.
  manual_seed(5);
  for (int8_t v : nn::quantize_per_channel(randn({16, 32}).to(host)).values.to_vector<int8_t>())
    CHECK((v >= -limit && v <= limit));
}
