// Transformer pieces: masked_fill, tril/triu, split/chunk, multinomial; scaled dot-product
// attention against a float64 loop reference and by gradcheck (causal, masks); ModuleList
// registration; MultiheadAttention fused and separate projections agree; GPT shapes, tied
// weights, errors, a training step that replays without compiling, and generation.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <cmath>
#include <limits>
#include <vector>

#include "backends/cuda/cuda_runtime.h"
#include "tests/support/files.h"
#include "tests/support/gradcheck.h"

using namespace kiln;
using kiln::testing::gradcheck;
using kiln::testing::uniform;
using Inputs = std::vector<Tensor>;

TEST_CASE("masked_fill, tril and triu", "[transformer][elementwise]") {
  Tensor x = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor mask = from_vector<bool>({true, false, true}, {3});
  CHECK(masked_fill(x, mask, -1).to_vector<float>() == std::vector<float>{-1, 2, -1, -1, 5, -1});
  CHECK(tril(x).to_vector<float>() == std::vector<float>{1, 0, 0, 4, 5, 0});
  CHECK(triu(x, 1).to_vector<float>() == std::vector<float>{0, 2, 3, 0, 0, 6});
  CHECK(tril(x, -1).to_vector<float>() == std::vector<float>{0, 0, 0, 4, 0, 0});
  CHECK_THROWS_WITH(masked_fill(x, from_vector<float>({1, 0, 1}, {3}), 0), Catch::Contains("bool"));
  CHECK_THROWS_WITH(masked_fill(x, from_vector<bool>({true, false}, {2, 1, 1}), 0), Catch::Contains("broadcast"));
  CHECK_THROWS_WITH(tril(from_vector<float>({1, 2}, {2})), Catch::Contains("2 dims"));
  auto f = [&](const Inputs& in) { return tril(masked_fill(in[0], from_vector<bool>({false, true, false}, {3}), 0.5), 0); };
  auto result = gradcheck(f, {uniform({3, 3}, -1, 1, 3)});
  INFO(result.report);
  CHECK(result.ok);
}

TEST_CASE("split and chunk are views whose gradients add back", "[transformer][view]") {
  Tensor x = from_vector<float>({0, 1, 2, 3, 4, 5, 6}, {7});
  std::vector<Tensor> pieces = split(x, 3);
  REQUIRE(pieces.size() == 3);
  CHECK(pieces[2].to_vector<float>() == std::vector<float>{6});
  CHECK(chunk(x, 3).size() == 3);  // pieces of 3, 3, 1
  CHECK(chunk(x, 2)[1].to_vector<float>() == std::vector<float>{4, 5, 6});
  CHECK_THROWS_WITH(split(x, 0), Catch::Contains("positive"));
  auto f = [](const Inputs& in) {
    std::vector<Tensor> p = chunk(in[0], 3, 1);  // (2, 2), (2, 2), (2, 1)
    return concat({p[2] * 3.0, p[0] * p[1]}, 1);
  };
  auto result = gradcheck(f, {uniform({2, 5}, -1, 1, 4)});
  INFO(result.report);
  CHECK(result.ok);
}

TEST_CASE("multinomial draws by weight, reproducibly, and refuses bad weights", "[transformer][random]") {
  manual_seed(5);
  Tensor one_hot = from_vector<float>({0, 0, 1, 0, 1, 0, 0, 0}, {2, 4});
  CHECK(multinomial(one_hot, 3).to_vector<int64_t>() == std::vector<int64_t>{2, 2, 2, 0, 0, 0});
  Tensor weights = from_vector<double>({1, 3}, {2});
  manual_seed(6);
  std::vector<int64_t> a = multinomial(weights, 4000).to_vector<int64_t>();
  manual_seed(6);
  CHECK(multinomial(weights, 4000).to_vector<int64_t>() == a);
  double ones = 0;
  for (int64_t v : a) ones += static_cast<double>(v);
  CHECK(ones / 4000 == Approx(0.75).margin(0.03));
  CHECK_THROWS_WITH(multinomial(from_vector<float>({0, 0}, {2})), Catch::Contains("sums to 0"));
  CHECK_THROWS_WITH(multinomial(from_vector<float>({1, -1}, {2})), Catch::Contains("non-negative"));
}

namespace {
// softmax(q kᵀ / √d) v by loops in double, with an optional causal mask.
std::vector<double> reference_attention(const std::vector<double>& q, const std::vector<double>& k,
                                        const std::vector<double>& v, int64_t t, int64_t d, bool causal) {
  std::vector<double> out(static_cast<size_t>(t * d), 0.0);
  for (int64_t i = 0; i < t; ++i) {
    std::vector<double> s(static_cast<size_t>(t), -std::numeric_limits<double>::infinity());
    double m = -std::numeric_limits<double>::infinity(), z = 0;
    for (int64_t j = 0; j < t; ++j) {
      if (causal && j > i) continue;
      double dot = 0;
      for (int64_t c = 0; c < d; ++c) dot += q[i * d + c] * k[j * d + c];
      s[j] = dot / std::sqrt(static_cast<double>(d));
      m = std::max(m, s[j]);
    }
    for (int64_t j = 0; j < t; ++j) z += std::exp(s[j] - m);
    for (int64_t j = 0; j < t; ++j)
      for (int64_t c = 0; c < d; ++c) out[i * d + c] += std::exp(s[j] - m) / z * v[j * d + c];
  }
  return out;
}
}  // namespace

TEST_CASE("scaled_dot_product_attention matches a loop reference and passes gradcheck, causal or not",
          "[transformer][gradcheck]") {
  const int64_t t = 4, d = 3;
  Tensor q = uniform({1, t, d}, -1, 1, 11), k = uniform({1, t, d}, -1, 1, 12), v = uniform({1, t, d}, -1, 1, 13);
  // The fused kernel (the default) and the composite alike.
  for (auto [causal, fused] : {std::pair{false, true}, {true, true}, {false, false}, {true, false}}) {
    FlagsGuard guard;
    flags().fused_attention = fused;
    std::vector<double> want = reference_attention(q.to_doubles(), k.to_doubles(), v.to_doubles(), t, d, causal);
    std::vector<double> got = nn::scaled_dot_product_attention(q, k, v, {}, 0.0, causal).to_doubles();
    for (size_t i = 0; i < want.size(); ++i) CHECK(got[i] == Approx(want[i]).margin(1e-12));
    auto f = [causal](const Inputs& in) { return nn::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, causal); };
    auto result = gradcheck(f, {q, k, v});
    INFO(result.report);
    CHECK(result.ok);
  }
  // A bool mask saying "may attend" equals the causal flag; a float mask is added to the scores.
  Tensor lower = from_vector<bool>({1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1}, {t, t});
  std::vector<double> bool_masked = nn::scaled_dot_product_attention(q, k, v, lower).to_doubles();
  Tensor additive = where(lower, scalar(0.0, DType::Float64), scalar(-1e300, DType::Float64));
  std::vector<double> masked = nn::scaled_dot_product_attention(q, k, v, additive).to_doubles();
  std::vector<double> causal = nn::scaled_dot_product_attention(q, k, v, {}, 0.0, true).to_doubles();
  for (size_t i = 0; i < masked.size(); ++i) {
    CHECK(masked[i] == Approx(causal[i]).margin(1e-12));
    CHECK(bool_masked[i] == Approx(causal[i]).margin(1e-12));
  }
  CHECK_THROWS_WITH(nn::scaled_dot_product_attention(q, k, uniform({1, t + 1, d}, -1, 1, 1)), Catch::Contains("(..., Tk, dv)"));
}

TEST_CASE("attention with dropout: a fixed seed gives one mask, its gradients pass gradcheck", "[transformer][gradcheck]") {
  const int64_t t = 5, d = 3;
  Tensor q = uniform({1, t, d}, -1, 1, 21), k = uniform({1, t, d}, -1, 1, 22), v = uniform({1, t, d}, -1, 1, 23);
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    auto f = [causal](const Inputs& in) {
      manual_seed(99);  // the same dropout mask at every evaluation
      return nn::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.4, causal);
    };
    auto result = gradcheck(f, {q, k, v});
    INFO(result.report);
    CHECK(result.ok);
    // Dropout did something (the output is not the plain attention's), and the same seed draws
    // the same mask again.
    const std::vector<double> plain = reference_attention(q.to_doubles(), k.to_doubles(), v.to_doubles(), t, d, causal);
    const std::vector<double> dropped = f({q, k, v}).to_doubles();
    double apart = 0;
    for (size_t i = 0; i < plain.size(); ++i) apart = std::max(apart, std::abs(dropped[i] - plain[i]));
    CHECK(apart > 1e-3);
    manual_seed(99);
    CHECK(nn::scaled_dot_product_attention(q, k, v, {}, 0.4, causal).to_doubles() == dropped);  // reproducible
  }
}

TEST_CASE("ModuleList registers what is pushed, as children 0, 1, ...", "[transformer][module]") {
  struct Net : nn::Module {
    Net() : Module("Net") {
      for (int i = 0; i < 3; ++i) layers.push_back(nn::Linear(4, 4));
    }
    nn::ModuleList layers = register_module("layers", nn::ModuleList());
    Tensor forward(const Tensor& x) override {
      Tensor h = x;
      for (nn::AnyModule& layer : layers) h = layer.forward(h);
      return h;
    }
  };
  Net net;
  std::vector<std::string> names;
  for (const auto& [name, p] : net.named_parameters()) names.push_back(name);
  CHECK(names == std::vector<std::string>{"layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias",
                                          "layers.2.weight", "layers.2.bias"});
  CHECK(net.layers.size() == 3);
  CHECK(net.forward(ones({2, 4})).shape() == Shape{2, 4});
  CHECK_THROWS_AS(net.layers.forward(ones({2, 4})), Error);  // no forward of its own
}

TEST_CASE("MultiheadAttention: fused and separate projections agree; bad shapes are Errors", "[transformer]") {
  manual_seed(2);
  nn::MultiheadAttention fused(nn::MultiheadAttentionOptions(8, 2).causal(true));
  nn::MultiheadAttention separate(nn::MultiheadAttentionOptions(8, 2).causal(true).fused_qkv(false));
  // The same weights: the fused projection's row blocks are q, k and v.
  NoGradGuard no_grad;
  nn::Linear* parts[] = {&separate.q_proj, &separate.k_proj, &separate.v_proj};
  for (int i = 0; i < 3; ++i) {
    parts[i]->weight.assign(slice(fused.qkv.weight, 0, 8 * i, 8 * (i + 1)).realize());
    parts[i]->bias.assign(slice(fused.qkv.bias, 0, 8 * i, 8 * (i + 1)).realize());
  }
  separate.out_proj.weight.assign(fused.out_proj.weight);
  separate.out_proj.bias.assign(fused.out_proj.bias);
  Tensor x = randn({2, 5, 8});
  std::vector<float> a = fused.forward(x).to_vector<float>(), b = separate.forward(x).to_vector<float>();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK(a[i] == Approx(b[i]).margin(1e-5));
  // The three-argument form with self-attention (it may project q, k and v as three products,
  // which oneDNN need not sum in the one product's order: close, not always bit for bit).
  const std::vector<float> three = fused.forward(x, x, x).to_vector<float>();
  REQUIRE(three.size() == a.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK(three[i] == Approx(a[i]).margin(1e-6));
  CHECK_THROWS_WITH(nn::MultiheadAttention(10, 3), Catch::Contains("multiple of heads"));
  CHECK_THROWS_WITH(fused.forward(randn({2, 5, 7})), Catch::Contains("(B, T, 8)"));
}

TEST_CASE("GPT: shapes, tied weights, GPT-2 initialization, errors", "[transformer]") {
  manual_seed(3);
  nn::GPT gpt(nn::GPTConfig().vocab(11).ctx(8).layers(2).heads(2).dim(16));
  Tensor tokens = from_vector<int64_t>({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, {2, 5});
  CHECK(gpt.forward(tokens).shape() == Shape{2, 5, 11});
  int64_t count = 0;
  for (const auto& [name, p] : gpt.named_parameters()) {
    CHECK(name.find("head") == std::string::npos);  // tied: the head is the token table
    count += p.numel();
  }
  // embeddings, 2 blocks of (2 LayerNorms, qkv, out_proj, fc, proj), the final LayerNorm
  const int64_t block = 2 * 32 + (16 * 48 + 48) + (16 * 16 + 16) + (16 * 64 + 64) + (64 * 16 + 16);
  CHECK(count == 11 * 16 + 8 * 16 + 2 * block + 32);
  std::vector<double> w = gpt.tokens.weight.to_doubles();
  double sq = 0;
  for (double x : w) sq += x * x;
  CHECK(std::sqrt(sq / static_cast<double>(w.size())) == Approx(0.02).margin(0.006));
  CHECK_THROWS_WITH(gpt.forward(zeros({1, 9}, DType::Int64)), Catch::Contains("context of 8"));
  CHECK_THROWS_WITH(gpt.forward(zeros({1, 4})), Catch::Contains("integer"));
  CHECK_THROWS_WITH(nn::GPT(nn::GPTConfig().dim(30).heads(4)), Catch::Contains("multiple of heads"));
  nn::GPT untied(nn::GPTConfig().vocab(11).ctx(8).layers(1).heads(2).dim(16).tie_weights(false));
  CHECK(untied.forward(tokens).shape() == Shape{2, 5, 11});
}

TEST_CASE("a GPT training step replays from the plan cache and lowers the loss", "[transformer][train]") {
  manual_seed(4);
  nn::GPT gpt(nn::GPTConfig().vocab(8).ctx(8).layers(2).heads(2).dim(16));
  optim::AdamW opt(gpt.parameters(), optim::AdamWOptions(3e-3));
  // A repeating sequence: each token predicts the next.
  std::vector<int64_t> seq;
  for (int i = 0; i < 4 * 9; ++i) seq.push_back(i % 5);
  Tensor data = from_vector<int64_t>(seq, {4, 9});
  Tensor x = slice(data, 1, 0, 8).realize(), y = slice(data, 1, 1, 9).realize();
  auto step = [&] {
    Tensor loss = nn::cross_entropy(gpt.forward(x).reshape({-1, 8}), y.reshape({-1}));
    opt.step(loss);
    return loss.item();
  };
  const double first = step();
  step();
  const auto compiled = jit::stats().kernels_compiled;
  double last = 0;
  for (int i = 0; i < 30; ++i) last = step();
  CHECK(jit::stats().kernels_compiled == compiled);
  CHECK(last < first * 0.5);
  // Generation continues the pattern it learned (top-k 1: the likeliest token each time).
  Tensor out = gpt.generate(from_vector<int64_t>({0, 1, 2}, {1, 3}), 4, nn::GenerateOptions().top_k(1));
  CHECK(out.shape() == Shape{1, 7});
  CHECK(out.to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 3, 4, 0, 1});
  CHECK_THROWS_WITH(gpt.generate(out, 1, nn::GenerateOptions().temperature(0)), Catch::Contains("temperature"));
}

namespace {
// Batches of a repeating 5-token pattern, offset by the step.
std::pair<Tensor, Tensor> pattern_batch(int step, Device device) {
  std::vector<int64_t> seq;
  for (int i = 0; i < 4 * 9; ++i) seq.push_back((i + step) % 5);
  Tensor data = from_vector<int64_t>(seq, {4, 9}).to(device);
  return {slice(data, 1, 0, 8).realize(), slice(data, 1, 1, 9).realize()};
}

// One AdamW step on the pattern, on the model's device.
double gpt_step(nn::GPT& gpt, optim::Optimizer& opt, int step) {
  auto [x, y] = pattern_batch(step, gpt.tokens.weight.device());
  Tensor loss = nn::cross_entropy(gpt.forward(x).reshape({-1, 8}), y.reshape({-1}));
  opt.step(loss);
  return loss.item();
}

nn::GPTConfig tiny() { return nn::GPTConfig().vocab(8).ctx(8).layers(2).heads(2).dim(16); }
}  // namespace

TEST_CASE("a GPT saved mid-run and loaded continues training bit-identically", "[transformer][serialize]") {
  const std::string weights = kiln::testing::temp_path("gpt", "w.safetensors"),
                    state = kiln::testing::temp_path("gpt", "o.safetensors");
  manual_seed(9);
  nn::GPT a(tiny());
  optim::AdamW opt_a(a.parameters(), optim::AdamWOptions(3e-3));
  for (int s = 0; s < 3; ++s) gpt_step(a, opt_a, s);
  nn::save(a, weights);
  optim::save(opt_a, state);
  for (int s = 3; s < 5; ++s) gpt_step(a, opt_a, s);

  manual_seed(77);  // another initialization: everything must come from the files
  nn::GPT b(tiny());
  optim::AdamW opt_b(b.parameters(), optim::AdamWOptions(3e-3));
  nn::load(b, weights);
  optim::load(opt_b, state);
  for (int s = 3; s < 5; ++s) gpt_step(b, opt_b, s);
  const auto pa = a.named_parameters(), pb = b.named_parameters();
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    INFO(pa[i].first);
    CHECK(pa[i].second.to_vector<float>() == pb[i].second.to_vector<float>());
  }
  std::filesystem::remove(weights);
  std::filesystem::remove(state);
}

TEST_CASE("a GPT trains on a CUDA device as on the host", "[transformer][device]") {
  if (!cuda::available()) {
    WARN("SKIPPED: no CUDA device (KILN_CUDA_EMULATOR=1 emulates one)");
    return;
  }
  const Device gpu = Device::cuda(0);
  manual_seed(5);
  nn::GPT host(tiny());
  manual_seed(5);
  nn::GPT device(tiny());
  device.to(gpu);
  optim::AdamW opt_host(host.parameters(), optim::AdamWOptions(3e-3));
  optim::AdamW opt_device(device.parameters(), optim::AdamWOptions(3e-3));
  for (int s = 0; s < 3; ++s) {
    const double h = gpt_step(host, opt_host, s), d = gpt_step(device, opt_device, s);
    CHECK(d == Approx(h).epsilon(1e-4));
  }
  Tensor out = device.generate(from_vector<int64_t>({0, 1}, {1, 2}).to(gpu), 3, nn::GenerateOptions().top_k(1));
  CHECK(out.device() == gpu);
  CHECK(out.shape() == Shape{1, 5});
}

// Attention saves values with -inf (masked scores) and softmax's max: compression must keep the
// first exact and leave values the backward compares with each other alone.
TEST_CASE("a GPT trains with compressed activations as without", "[transformer][compress]") {
  auto run = [](bool compress) {
    manual_seed(12);
    nn::GPT gpt(tiny());
    optim::AdamW opt(gpt.parameters(), optim::AdamWOptions(3e-3));
    CompressActivationsGuard guard(compress);
    std::vector<double> losses;
    for (int s = 0; s < 8; ++s) losses.push_back(gpt_step(gpt, opt, s));
    return losses;
  };
  const std::vector<double> wide = run(false), narrow = run(true);
  for (size_t i = 0; i < wide.size(); ++i) {
    INFO("step " << i);
    CHECK(std::isfinite(narrow[i]));
    CHECK(narrow[i] == Approx(wide[i]).epsilon(0.02));
  }
}
