// Weight gradients made tile by tile inside their optimizer update (jit/tile_matmul.h): the same
// parameters, bit for bit, as the plan that makes each gradient whole (KILN_TILED_UPDATES=0), for
// every optimizer; no whole weight-gradient buffer in the arena; left alone when anything else
// reads the gradient (p.grad() of the PyTorch-style step, the clipping norm).
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "jit/executor.h"
#include "ops/library.h"
#include "tests/support/mlp.h"

using namespace kiln;

namespace {

// 300 -> 400 -> 200 -> 10: the first two weight gradients (469 and 313 KiB) take two tiles each.
const std::vector<int64_t> kWidths = {300, 400, 200, 10};
constexpr int64_t kBatch = 32;

using MakeOptimizer = std::function<std::unique_ptr<optim::Optimizer>(std::vector<Tensor>)>;

struct Run {
  std::vector<std::vector<float>> params;
  memory::PlanLayout layout;  // the training step's plan
};

Tensor forward(const std::vector<Tensor>& params, const Tensor& x) {
  Tensor h = x;
  for (size_t i = 0; i + 1 < params.size(); i += 2) {
    h = matmul(h, params[i]) + params[i + 1];
    if (i + 2 < params.size()) h = relu(h);
  }
  return h;
}

// Jittor style: opt.step(loss) takes the gradients itself; PyTorch style: backward() fills
// p.grad(), which the user may read after the step, then (optionally) clipping.
enum class Style { StepLoss, Backward, BackwardClip };

Run train(bool tiled, const MakeOptimizer& make, Style style = Style::StepLoss, int steps = 3, bool lazy = true,
          const std::vector<int64_t>& widths = kWidths, bool bf16 = false) {
  FlagsGuard guard;
  flags().tiled_updates = tiled;
  flags().lazy = lazy;
  flags().use_cuda = false;  // tiles are the CPU backend's (the suite runs again with KILN_USE_CUDA=1)
  manual_seed(11);
  std::vector<Tensor> params = kiln::testing::make_mlp(widths);
  std::unique_ptr<optim::Optimizer> opt = make(params);
  for (int s = 0; s < steps; ++s) {
    Tensor x = randn({kBatch, widths.front()});
    std::vector<int64_t> labels(kBatch);
    for (int64_t i = 0; i < kBatch; ++i) labels[i] = (i * 7 + s) % widths.back();
    Tensor logits;
    {
      AutocastGuard amp = bf16 ? AutocastGuard(DType::BFloat16) : AutocastGuard(false);  // off unless asked
      logits = forward(params, x);
    }
    Tensor loss = nn::cross_entropy(logits, from_vector<int64_t>(labels, {kBatch}));
    if (style == Style::StepLoss) {
      opt->step(loss);
      continue;
    }
    opt->zero_grad();
    loss.backward();
    if (style == Style::BackwardClip) opt->clip_grad_norm(0.5);
    opt->step({loss});
  }
  Run run;
  run.layout = jit::last_plan_memory();
  for (const Tensor& p : params) run.params.push_back(p.to_vector<float>());
  return run;
}

int tiled_kernels(const memory::PlanLayout& layout) {
  int n = 0;
  for (const std::string& summary : layout.kernels) n += summary.find("tiles of") != std::string::npos;
  return n;
}

bool holds_buffer_of(const memory::PlanLayout& layout, int64_t bytes) {
  for (const auto& b : layout.buffers)
    if (b.bytes == bytes) return true;
  return false;
}

}  // namespace

TEST_CASE("tiled updates: every optimizer leaves the parameters bit-identical to whole gradients",
          "[tile_matmul][optim]") {
  struct Case {
    std::string name;
    MakeOptimizer make;
    int tiled = 2;  // Nesterov's parameter update reads the gradient too: where it joins its momentum's
                    // kernel (the first layer, whose weight only the forward reads) that kernel is
                    // the gradient's one reader and tiles it; the second layer's update must wait
                    // for the backward's read of the old weight, so its gradient is read twice, whole
  };
  const std::vector<Case> optimizers = {
      {"SGD", [](std::vector<Tensor> p) { return std::make_unique<optim::SGD>(p, optim::SGDOptions(0.1)); }},
      {"SGD momentum, weight decay",
       [](std::vector<Tensor> p) {
         return std::make_unique<optim::SGD>(p, optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-3));
       }},
      {"SGD nesterov",
       [](std::vector<Tensor> p) {
         return std::make_unique<optim::SGD>(p, optim::SGDOptions(0.05).momentum(0.9).nesterov(true));
       },
       1},
      {"Adam, weight decay",
       [](std::vector<Tensor> p) {
         return std::make_unique<optim::Adam>(p, optim::AdamOptions(1e-3).weight_decay(1e-2));
       }},
      {"AdamW", [](std::vector<Tensor> p) { return std::make_unique<optim::AdamW>(p, optim::AdamWOptions(1e-3)); }},
  };
  for (const auto& [name, make, expected] : optimizers) {
    INFO(name);
    const Run tiled = train(true, make), whole = train(false, make);
    CHECK(tiled_kernels(tiled.layout) == expected);
    CHECK(tiled_kernels(whole.layout) == 0);
    // The first layer's gradient (300 x 400 float32) exists whole only without tiles.
    CHECK(holds_buffer_of(whole.layout, 300 * 400 * 4));
    if (expected > 0) {
      CHECK_FALSE(holds_buffer_of(tiled.layout, 300 * 400 * 4));
      CHECK(holds_buffer_of(tiled.layout, 160 * 400 * 4));  // the first layer's scratch tile, in the arena
      CHECK(tiled.layout.arena_bytes < whole.layout.arena_bytes);
    }
    REQUIRE(tiled.params.size() == whole.params.size());
    for (size_t i = 0; i < tiled.params.size(); ++i) {
      INFO("parameter " << i);
      REQUIRE(tiled.params[i].size() == whole.params[i].size());
      CHECK(std::memcmp(tiled.params[i].data(), whole.params[i].data(), tiled.params[i].size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("tiled updates: bfloat16 weight gradients take tiles of twice the bytes, with the same bits as whole",
          "[tile_matmul][optim][amp]") {
  // Under bf16 autocast the first weight gradient (600 x 640, 750 KiB in bfloat16) is made in two
  // even tiles of 304 rows (a float32 tile's 256 KiB would make four calls, each packing all of B);
  // the second (640 x 10) is made whole.
  // A CPU without bfloat16 matmuls (AVX2 only) multiplies widened float32 copies: float32 tiles.
  if (!library_matmul(Device::cpu(), DType::BFloat16)) return;
  const std::vector<int64_t> widths = {600, 640, 10};
  const MakeOptimizer make = [](std::vector<Tensor> p) {
    return std::make_unique<optim::SGD>(p, optim::SGDOptions(0.1).momentum(0.9));
  };
  const Run tiled = train(true, make, Style::StepLoss, 3, true, widths, true);
  const Run whole = train(false, make, Style::StepLoss, 3, true, widths, true);
  CHECK(tiled_kernels(tiled.layout) == 1);
  CHECK(std::any_of(tiled.layout.kernels.begin(), tiled.layout.kernels.end(), [](const std::string& k) {
    return k.find("(2 tiles of 304 rows)") != std::string::npos;
  }));
  CHECK(holds_buffer_of(whole.layout, 600 * 640 * 2));
  CHECK_FALSE(holds_buffer_of(tiled.layout, 600 * 640 * 2));
  CHECK(holds_buffer_of(tiled.layout, 304 * 640 * 2));
  REQUIRE(tiled.params.size() == whole.params.size());
  for (size_t i = 0; i < tiled.params.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(tiled.params[i].size() == whole.params[i].size());
    CHECK(std::memcmp(tiled.params[i].data(), whole.params[i].data(), tiled.params[i].size() * sizeof(float)) == 0);
  }
}

TEST_CASE("updates join their momentum's kernel: the parameters of op-by-op updates, one pass fewer",
          "[tile_matmul][optim]") {
  struct Case {
    std::string name;
    MakeOptimizer make;
    std::string first_layer;  // what the first layer's tiled kernel stores besides its output
    int second_layer = 0;     // kernels with further outputs besides the joined updates, tiled (Adam's
                              // m and v of the second layer, whose update waits)
  };
  const std::vector<Case> optimizers = {
      {"SGD momentum, weight decay",
       [](std::vector<Tensor> p) {
         return std::make_unique<optim::SGD>(p, optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-3));
       },
       "+1 more"},  // the momentum, and the weight
      {"SGD nesterov",
       [](std::vector<Tensor> p) {
         return std::make_unique<optim::SGD>(p, optim::SGDOptions(0.05).momentum(0.9).nesterov(true));
       },
       "+1 more"},
      {"Adam, weight decay",
       [](std::vector<Tensor> p) {
         return std::make_unique<optim::Adam>(p, optim::AdamOptions(1e-3).weight_decay(1e-2));
       },
       "+2 more", 1},  // m, and v and the weight
      {"AdamW", [](std::vector<Tensor> p) { return std::make_unique<optim::AdamW>(p, optim::AdamWOptions(1e-3)); },
       "+2 more", 1},
  };
  for (const auto& [name, make, first_layer, second_layer] : optimizers) {
    INFO(name);
    // Eager mode runs every op as its own kernel: no update joins anything.
    const Run eager = train(false, make, Style::StepLoss, 3, false);
    for (bool tiled : {true, false}) {
      INFO("tiled " << tiled);
      const Run joined = train(tiled, make);
      // The first layer's weight and every bias are read only by the forward, so their updates
      // join the kernel of their momentum (Adam: of v) as one more output; the other two weights
      // are read by the backward after their momentum is made, and wait for it.
      int more = 0, tiled_with_update = 0;
      for (const std::string& summary : joined.layout.kernels) {
        more += summary.find(" more") != std::string::npos;
        tiled_with_update += summary.find("tiles of") != std::string::npos && summary.find(first_layer) != std::string::npos;
      }
      CHECK(more == 4 + (tiled ? second_layer : 0));
      CHECK(tiled_with_update == (tiled ? 1 : 0));
      REQUIRE(joined.params.size() == eager.params.size());
      for (size_t i = 0; i < joined.params.size(); ++i) {
        INFO("parameter " << i);
        CHECK(std::memcmp(joined.params[i].data(), eager.params[i].data(), eager.params[i].size() * sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE("tiled updates: a gradient the user or the clipping norm also reads is made whole",
          "[tile_matmul][optim]") {
  const MakeOptimizer sgd = [](std::vector<Tensor> p) {
    return std::make_unique<optim::SGD>(p, optim::SGDOptions(0.1).momentum(0.9));
  };
  for (Style style : {Style::Backward, Style::BackwardClip}) {
    const Run run = train(true, sgd, style, 2);
    CHECK(tiled_kernels(run.layout) == 0);
  }
}

TEST_CASE("tiled updates: Adam's moments, merged into one kernel, are still updated in place", "[tile_matmul][optim]") {
  FlagsGuard guard;
  flags().use_cuda = false;
  manual_seed(12);
  std::vector<Tensor> params = kiln::testing::make_mlp(kWidths);
  optim::Adam opt(params, optim::AdamOptions(1e-3));
  const std::vector<int64_t> labels(kBatch, 3);
  auto step = [&] {
    opt.step(nn::cross_entropy(forward(params, randn({kBatch, kWidths.front()})),
                               from_vector<int64_t>(labels, {kBatch})));
  };
  step();
  step();  // the state exists now; this step's plan is the one replayed
  std::vector<const void*> before;
  for (const auto& [name, t] : opt.state()) before.push_back(t.data());
  for (const Tensor& p : params) before.push_back(p.data());
  step();
  CHECK(tiled_kernels(jit::last_plan_memory()) == 2);
  std::vector<const void*> after;
  for (const auto& [name, t] : opt.state()) after.push_back(t.data());
  for (const Tensor& p : params) after.push_back(p.data());
  CHECK(after == before);
}

TEST_CASE("tiled updates: poisoned dead buffers do not change the tiled step", "[tile_matmul][planner]") {
  const MakeOptimizer adam = [](std::vector<Tensor> p) {
    return std::make_unique<optim::Adam>(p, optim::AdamOptions(1e-3));
  };
  const Run plain = train(true, adam);
  Run poisoned;
  {
    FlagsGuard guard;
    flags().debug_memory = true;
    flags().plan_cache = false;
    poisoned = train(true, adam);
  }
  CHECK(tiled_kernels(poisoned.layout) == 2);
  CHECK(plain.params == poisoned.params);
}

TEST_CASE("updates join: only an update reading the value it follows element for element", "[tile_matmul][optim]") {
  std::vector<float> a(24), b(24);
  for (int i = 0; i < 24; ++i) a[i] = 0.25f * static_cast<float>(i), b[i] = 1.0f - 0.125f * static_cast<float>(i);
  // v = v/2 + 1, then p -= v/4, with v read at p's element or (transposed) at another one.
  auto run = [&](bool lazy, bool transposed) {
    FlagsGuard guard;
    flags().lazy = lazy;
    flags().use_cuda = false;
    Tensor v = from_vector<float>(a, {4, 6}), p = from_vector<float>(b, {4, 6});
    v.assign(v * 0.5 + 1.0);
    p.assign(p - (transposed ? v.reshape({6, 4}).transpose(0, 1).reshape({4, 6}) : v) * 0.25);
    sync({v, p});
    std::pair<std::vector<float>, size_t> out{p.to_vector<float>(), lazy ? jit::last_plan_memory().kernels.size() : 0};
    return out;
  };
  for (bool transposed : {false, true}) {
    INFO("transposed " << transposed);
    const auto [joined, kernels] = run(true, transposed);
    CHECK(kernels == (transposed ? 2u : 1u));
    CHECK(joined == run(false, transposed).first);
  }
}

TEST_CASE("updates join: not across a kernel that can fail, so the update stays in place", "[tile_matmul][optim]") {
  FlagsGuard guard;
  flags().use_cuda = false;
  std::vector<float> a(24, 0.5f), b(24, 2.0f), c(24, 1.0f);
  Tensor v = from_vector<float>(a, {4, 6}), p = from_vector<float>(b, {4, 6}), q = from_vector<float>(c, {4, 6});
  const void* p_before = p.data();
  // In this order the recording puts q's update (with its gather, which checks its indexes and can
  // fail) between v's update and p's: p's update joining v's kernel would come before the gather,
  // where it could not overwrite p in place.
  v.assign(v * 0.5 + 1.0);
  q.assign(q + index_select(from_vector<float>(std::vector<float>(48, 0.25f), {8, 6}), 0,
                            from_vector<int64_t>({1, 3, 5, 7}, {4})));
  p.assign(p - v * 0.25);
  sync({p, q, v});
  CHECK(p.data() == p_before);
  CHECK(p.to_vector<float>() == std::vector<float>(24, 2.0f - 1.25f * 0.25f));
}

namespace {

struct Product {
  std::vector<float> values;
  memory::PlanLayout layout;
  std::vector<std::vector<float>> inputs;  // the two operands' values, for a float64 reference
};

// c = δᵀ · (exp(x / 2) − 1): a weight gradient's shape, δ (2048, 64), x (2048, 513); its B operand
// (4 MiB) is made by elementwise work that nothing else reads. (An odd width: the whole operand's
// blocks start at addresses the scratch's do not, and the sums must not care.)
Product product_of_made_operand(bool tiled, bool poison = false) {
  FlagsGuard guard;
  flags().tiled_updates = tiled;
  flags().use_cuda = false;
  flags().debug_memory = poison;
  flags().plan_cache = !poison;
  manual_seed(5);
  const Tensor delta = randn({2048, 64}), x = randn({2048, 513});
  sync({delta, x});
  Tensor c = matmul(delta.t(), (x * 0.5).exp() - 1.0);
  Product p{c.to_vector<float>(), jit::last_plan_memory(), {delta.to_vector<float>(), x.to_vector<float>()}};
  return p;
}

// c = tanh(a · w) · 3, a (2048, 128), w (128, 513): a 4 MiB product of a row-major A read by one
// elementwise kernel, element for element (a data gradient δ·W through an activation's backward).
Product product_read_by_one_kernel(bool tiled) {
  FlagsGuard guard;
  flags().tiled_updates = tiled;
  flags().use_cuda = false;
  manual_seed(6);
  const Tensor a = randn({2048, 128}), w = randn({128, 513}) * 0.1;
  sync({a, w});
  Tensor c = matmul(a, w).tanh() * 3.0;
  Product p{c.to_vector<float>(), jit::last_plan_memory(), {a.to_vector<float>(), w.to_vector<float>()}};
  return p;
}

bool same_bits(const Product& a, const Product& b) {
  return a.values.size() == b.values.size() &&
         std::memcmp(a.values.data(), b.values.data(), a.values.size() * sizeof(float)) == 0;
}

// The largest |finish(Σ_k term(m, k, n)) − value(m, n)|, relative to 1 + |finish(..)|, in float64,
// over rows m < rows in steps of m_step and columns n < cols in steps of n_step.
double worst_error(const Product& p, int64_t rows, int64_t cols, int64_t depth, int64_t m_step, int64_t n_step,
                   const std::function<double(int64_t, int64_t, int64_t)>& term,
                   const std::function<double(double)>& finish) {
  double worst = 0;
  for (int64_t m = 0; m < rows; m += m_step)
    for (int64_t n = 0; n < cols; n += n_step) {
      double sum = 0;
      for (int64_t k = 0; k < depth; ++k) sum += term(m, k, n);
      const double want = finish(sum);
      worst = std::max(worst, std::abs(want - double(p.values[m * cols + n])) / (1.0 + std::abs(want)));
    }
  return worst;
}

int kernels_with(const memory::PlanLayout& layout, const std::string& text) {
  int n = 0;
  for (const std::string& summary : layout.kernels) n += summary.find(text) != std::string::npos;
  return n;
}

}  // namespace

TEST_CASE("operand tiles: elementwise work that makes a weight gradient's operand runs inside it, block by block",
          "[tile_matmul][planner]") {
  const Product tiled = product_of_made_operand(true), whole = product_of_made_operand(false);
  CHECK(kernels_with(tiled.layout, "5 blocks of 416 rows") == 1);
  CHECK(kernels_with(whole.layout, "blocks of") == 0);
  // The operand (2048 x 513 float32) exists whole only without tiles; with them, one block of it.
  CHECK(holds_buffer_of(whole.layout, 2048 * 513 * 4));
  CHECK_FALSE(holds_buffer_of(tiled.layout, 2048 * 513 * 4));
  CHECK(holds_buffer_of(tiled.layout, 416 * 513 * 4));
  CHECK(tiled.layout.arena_bytes < whole.layout.arena_bytes / 2);
  // The same sums in the same steps (jit::matmul_k_block), so the same bits.
  CHECK(same_bits(tiled, whole));
  // And the right ones: against a float64 sum.
  const std::vector<float>&delta = tiled.inputs[0], &x = tiled.inputs[1];
  CHECK(worst_error(
            tiled, 64, 513, 2048, 3, 7,
            [&](int64_t m, int64_t k, int64_t n) { return double(delta[k * 64 + m]) * std::expm1(0.5 * double(x[k * 513 + n])); },
            [](double sum) { return sum; }) < 1e-4);
  // Each block is written over the last one's scratch: poisoned dead buffers change nothing.
  const Product poisoned = product_of_made_operand(true, true);
  CHECK(poisoned.values == tiled.values);
}

TEST_CASE("product tiles: a large product of a row-major A that one elementwise kernel reads runs inside it",
          "[tile_matmul][planner]") {
  const Product tiled = product_read_by_one_kernel(true), whole = product_read_by_one_kernel(false);
  CHECK(kernels_with(tiled.layout, "5 tiles of 416 rows") == 1);
  CHECK(holds_buffer_of(whole.layout, 2048 * 513 * 4));
  CHECK_FALSE(holds_buffer_of(tiled.layout, 2048 * 513 * 4));
  CHECK(same_bits(tiled, whole));
  const std::vector<float>&a = tiled.inputs[0], &w = tiled.inputs[1];
  CHECK(worst_error(
            tiled, 2048, 513, 128, 13, 5,
            [&](int64_t m, int64_t k, int64_t n) { return double(a[m * 128 + k]) * double(w[k * 513 + n]); },
            [](double sum) { return 3.0 * std::tanh(sum); }) < 1e-4);
}
