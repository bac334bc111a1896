// Fused attention (kiln::fused_attention, the flash-attention kernels): values and gradients
// against the composite attention (KILN_FUSED_ATTENTION=0) over one tile and several, causal or
// not, Tq != Tk, strided operands; gradcheck in float64; what the backward keeps grows with T, not
// T²; and the errors it gives.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backends/cuda/cuda_runtime.h"
#include "jit/stats.h"
#include "tests/support/gradcheck.h"

using namespace kiln;
using kiln::testing::gradcheck;
using kiln::testing::uniform;
using Inputs = std::vector<Tensor>;

namespace {

struct Case {
  int64_t B, H, Tq, Tk, D, Dv;
  bool causal;
};

// sdpa over q (B, H, Tq, D) etc. made as views of (B, T, H, d) tensors, as a transformer makes
// them; returns the output and the three input gradients of sum(out * w).
std::vector<std::vector<float>> run(const Case& c, bool fused) {
  FlagsGuard guard;
  flags().fused_attention = fused;
  auto make = [&](int64_t T, int64_t d, uint64_t seed) {
    Tensor x = uniform({c.B, T, c.H, d}, -2, 2, seed).cast(DType::Float32).detach();
    x.requires_grad_(true);
    return x;
  };
  Tensor q = make(c.Tq, c.D, 1), k = make(c.Tk, c.D, 2), v = make(c.Tk, c.Dv, 3);
  auto heads = [](const Tensor& t) { return permute(t, {0, 2, 1, 3}); };
  Tensor out = nn::scaled_dot_product_attention(heads(q), heads(k), heads(v), {}, 0.0, c.causal);
  Tensor w = uniform({c.B, c.H, c.Tq, c.Dv}, -1, 1, 4).cast(DType::Float32);
  (out * w).sum().backward();
  return {out.to_vector<float>(), q.grad().to_vector<float>(), k.grad().to_vector<float>(),
          v.grad().to_vector<float>()};
}

void check_close(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(double(got[i]) - want[i]);
    worst = std::max(worst, err);
    if (!(err <= 2e-5 + 2e-5 * std::abs(double(want[i])))) ++bad;
  }
  INFO(what << ": worst absolute difference " << worst);
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("fused attention equals the composite in values and gradients", "[attention][grad]") {
  const Case cases[] = {
      {2, 3, 5, 5, 4, 4, false},   {2, 3, 5, 5, 4, 4, true},     // one small tile
      {1, 2, 7, 11, 3, 5, false},  {1, 2, 7, 11, 3, 5, true},    // Tq < Tk: the last query sees every key
      {1, 1, 150, 150, 8, 8, true}, {1, 2, 130, 70, 16, 8, false},  // several tiles of queries and keys
      {2, 2, 64, 64, 32, 32, true},                              // the GPT sample's heads
  };
  for (const Case& c : cases) {
    INFO("B " << c.B << " H " << c.H << " Tq " << c.Tq << " Tk " << c.Tk << " D " << c.D << " Dv " << c.Dv
              << (c.causal ? " causal" : ""));
    const auto fused = run(c, true), composite = run(c, false);
    check_close(fused[0], composite[0], "output");
    check_close(fused[1], composite[1], "dq");
    check_close(fused[2], composite[2], "dk");
    check_close(fused[3], composite[3], "dv");
  }
}

TEST_CASE("fused attention passes gradcheck in float64", "[attention][grad]") {
  for (bool causal : {false, true}) {
    auto f = [causal](const Inputs& in) { return fused_attention(in[0], in[1], in[2], causal, 0.7); };
    auto small = gradcheck(f, {uniform({2, 2, 4, 3}, -1, 1, 1), uniform({2, 2, 6, 3}, -1, 1, 2),
                               uniform({2, 2, 6, 2}, -1, 1, 3)});
    INFO(small.report);
    CHECK(small.ok);
    // Two tiles of queries and of keys.
    auto tiles = gradcheck(f, {uniform({1, 1, 70, 2}, -1, 1, 4), uniform({1, 1, 70, 2}, -1, 1, 5),
                               uniform({1, 1, 70, 1}, -1, 1, 6)});
    INFO(tiles.report);
    CHECK(tiles.ok);
  }
}

TEST_CASE("fused attention keeps O(T) bytes for the backward, the composite O(T^2)", "[attention][memory]") {
  auto saved = [](int64_t T, bool fused) {
    FlagsGuard guard;
    flags().fused_attention = fused;
    flags().lazy = true;  // the planner counts what a pending step would keep
    Tensor x = uniform({1, T, 64}, -1, 1, 7).cast(DType::Float32);
    Tensor w = uniform({64, 3 * 64}, -0.2, 0.2, 8).cast(DType::Float32).detach();
    w.requires_grad_(true);
    std::vector<Tensor> qkv = chunk(matmul(x, w), 3, 2);
    auto heads = [T](const Tensor& t) { return permute(t.reshape({1, T, 4, 16}), {0, 2, 1, 3}); };
    Tensor y = nn::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), {}, 0.0, true);
    return jit::saved_for_backward(y.sum(), {w}).activations;
  };
  const int64_t fused_256 = saved(256, true), fused_1024 = saved(1024, true);
  const int64_t composite_256 = saved(256, false), composite_1024 = saved(1024, false);
  INFO("fused " << fused_256 << " -> " << fused_1024 << " bytes; composite " << composite_256 << " -> "
                << composite_1024);
  CHECK(fused_1024 <= 4 * fused_256 + 1024);           // linear in T
  CHECK(composite_1024 >= 12 * composite_256);         // quadratic in T
  CHECK(fused_1024 * 8 < composite_1024);
}

TEST_CASE("fused attention: dtypes and shapes", "[attention][errors]") {
  Tensor q = uniform({1, 1, 3, 2}, -1, 1, 1).cast(DType::Float32);
  // bfloat16 operands compute in float32.
  Tensor y = fused_attention(q.cast(DType::BFloat16), q.cast(DType::BFloat16), q.cast(DType::BFloat16), true, 1.0);
  CHECK(y.dtype() == DType::Float32);
  CHECK(y.shape() == Shape({1, 1, 3, 2}));
  CHECK_THROWS_WITH(fused_attention(q, uniform({1, 1, 3, 3}, -1, 1, 1), q, false, 1.0), Catch::Contains("(B, H, Tk, D)"));
  CHECK_THROWS_WITH(fused_attention(q.reshape({3, 2}), q, q, false, 1.0), Catch::Contains("(B, H, Tq, D)"));
  CHECK_THROWS_WITH(fused_attention(q.cast(DType::Int32), q, q, false, 1.0), Catch::Contains("floating"));
}

TEST_CASE("fused attention on a CUDA device equals the host's", "[attention][device]") {
  if (!cuda::available()) {
    WARN("SKIPPED: no CUDA device (KILN_CUDA_EMULATOR=1 emulates one)");
    return;
  }
  for (bool causal : {false, true}) {
    auto run_on = [&](Device device) {
      Tensor q = uniform({2, 2, 9, 5}, -2, 2, 1).cast(DType::Float32).to(device).detach().requires_grad_();
      Tensor k = uniform({2, 2, 12, 5}, -2, 2, 2).cast(DType::Float32).to(device).detach().requires_grad_();
      Tensor v = uniform({2, 2, 12, 3}, -2, 2, 3).cast(DType::Float32).to(device).detach().requires_grad_();
      Tensor w = uniform({2, 2, 9, 3}, -1, 1, 4).cast(DType::Float32).to(device);
      Tensor out = fused_attention(q, k, v, causal, 0.4);
      (out * w).sum().backward();
      return std::vector<std::vector<float>>{out.to_vector<float>(), q.grad().to_vector<float>(),
                                             k.grad().to_vector<float>(), v.grad().to_vector<float>()};
    };
    const auto host = run_on(Device::cpu()), device = run_on(Device::cuda(0));
    for (size_t i = 0; i < host.size(); ++i) check_close(device[i], host[i], "cuda vs host");
  }
}

TEST_CASE("fused attention reads bfloat16 q, k, v as they are, computing in float32", "[attention][autocast]") {
  auto run = [](DType t) {
    auto make = [&](Shape shape, uint64_t seed) {
      // Values that bfloat16 holds exactly, so both runs see the same numbers.
      Tensor x = uniform(shape, -2, 2, seed).cast(DType::BFloat16).cast(t).detach();
      x.requires_grad_(true);
      return x;
    };
    Tensor q = make({2, 2, 9, 8}, 1), k = make({2, 2, 12, 8}, 2), v = make({2, 2, 12, 8}, 3);
    Tensor out = fused_attention(q, k, v, true, 0.35);
    CHECK(out.dtype() == DType::Float32);
    (out * uniform({2, 2, 9, 8}, -1, 1, 4).cast(DType::Float32)).sum().backward();
    CHECK(q.grad().dtype() == t);
    return std::vector<std::vector<float>>{out.to_vector<float>(), q.grad().cast(DType::Float32).to_vector<float>(),
                                           k.grad().cast(DType::Float32).to_vector<float>(),
                                           v.grad().cast(DType::Float32).to_vector<float>()};
  };
  const auto low = run(DType::BFloat16), wide = run(DType::Float32);
  CHECK(low[0] == wide[0]);  // the same float32 arithmetic on the same values
  for (size_t i = 1; i < low.size(); ++i) {  // gradients: the float32 ones rounded to bfloat16
    REQUIRE(low[i].size() == wide[i].size());
    for (size_t j = 0; j < low[i].size(); ++j) CHECK(low[i][j] == Approx(wide[i][j]).epsilon(1.0 / 128).margin(1e-6));
  }

  // Under autocast the projections are bfloat16 and the backward keeps them, not float32 copies.
  auto saved = [](bool autocast) {
    FlagsGuard guard;
    flags().lazy = true;
    AutocastGuard amp(autocast ? DType::BFloat16 : DType::Float32);
    nn::MultiheadAttention attn(nn::MultiheadAttentionOptions(64, 4).causal(true));
    Tensor x = uniform({2, 128, 64}, -1, 1, 9).cast(DType::Float32);
    return jit::saved_for_backward(attn.forward(x).cast(DType::Float32).sum(), attn.parameters()).activations;
  };
  const int64_t amp = saved(true), full = saved(false);
  INFO("saved: bfloat16 autocast " << amp << " bytes, float32 " << full);
  CHECK(amp * 4 <= full * 3);  // float32 copies of q, k, v would make it 1.25x
}
