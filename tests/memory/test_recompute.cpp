// Recomputation: kiln::checkpoint and the automatic pass under KILN_MEMORY_BUDGET. A 16-layer MLP
// (width 64, batch 32, relu + dropout between layers) trains with and without recomputation: the
// planned arena must shrink, and gradients and updated parameters must be bit-identical (dropout
// included: the recomputed mask reuses the original's Philox counters).
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <cmath>
#include <cstring>
#include <string>

#include "jit/executor.h"
#include "memory/profile.h"
#include "memory/recompute.h"
#include "memory/report.h"

using namespace kiln;

namespace {

constexpr int kLayers = 16;
constexpr int64_t kWidth = 64, kBatch = 32;
constexpr double kDropout = 0.1, kLr = 0.05;

// Exact equality of the bits, so -0.0 vs 0.0 or NaN payloads would count as differences.
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Mlp {
  std::vector<Tensor> w, b;  // w[i]: (W, W); b[i]: (W)
  std::vector<Tensor> params() const {
    std::vector<Tensor> p = w;
    p.insert(p.end(), b.begin(), b.end());
    return p;
  }
};

Mlp make_mlp() {
  Mlp m;
  for (int i = 0; i < kLayers; ++i) {
    m.w.push_back((randn({kWidth, kWidth}) * std::sqrt(2.0 / kWidth)).realize().requires_grad_());
    m.b.push_back((randn({kWidth}) * 0.01).realize().requires_grad_());
  }
  return m;
}

// Layer i: (B, W) -> (B, W); relu + dropout after every layer but the last.
Tensor layer(const Mlp& m, const Tensor& h, int i) {
  Tensor z = matmul(h, m.w[i]) + m.b[i];
  return i + 1 < kLayers ? dropout(relu(z), kDropout) : z;
}

// The logits, with layers grouped in checkpoint segments of `every` layers (0: no checkpoint;
// negative: only the first -every layers form a segment).
Tensor forward(const Mlp& m, const Tensor& x, int every) {
  Tensor h = x;
  const int group = every != 0 ? std::abs(every) : kLayers;
  for (int start = 0; start < kLayers; start += group) {
    auto block = [&m, start, group](const std::vector<Tensor>& in) {
      Tensor t = in[0];
      for (int i = start; i < start + group && i < kLayers; ++i) t = layer(m, t, i);
      return std::vector<Tensor>{t};
    };
    h = every > 0 || (every < 0 && start == 0) ? checkpoint(block, {h})[0] : block({h})[0];
  }
  return h;
}

struct Data {
  Tensor x, labels;
};
Data make_data() {
  std::vector<int64_t> labels(kBatch);
  for (int64_t i = 0; i < kBatch; ++i) labels[i] = (i * 7) % kWidth;
  return {randn({kBatch, kWidth}).realize(), from_vector<int64_t>(labels, {kBatch})};
}

struct StepResult {
  std::vector<std::vector<float>> grads;   // only when asked for
  std::vector<std::vector<float>> params;  // after the update
  std::vector<float> loss;
  memory::PlanLayout plan;
  int64_t step_peak_bytes = 0;  // tensor bytes allocated at the peak of the last step, beyond before it
};

// One SGD step (forward, grad, assign, sync) from a fresh model and seed. With keep_grads the
// gradients are outputs of the plan too (so they can be compared); without, the step is a plain
// training step whose gradients live only inside the plan's arena.
// With decaying_lr, step s learns at kLr / (s + 1): the same graph with another scalar.
StepResult train(int every, bool keep_grads, int steps = 1, uint64_t seed = 11, bool decaying_lr = false) {
  manual_seed(seed);
  Mlp m = make_mlp();
  Data d = make_data();
  StepResult r;
  for (int s = 0; s < steps; ++s) {
    Tensor loss = cross_entropy(forward(m, d.x, every), d.labels);
    std::vector<Tensor> params = m.params();
    std::vector<Tensor> grads = grad(loss, params);
    {
      NoGradGuard no_grad;
      const double lr = decaying_lr ? kLr / (s + 1) : kLr;
      for (size_t i = 0; i < params.size(); ++i) params[i].assign(params[i] - lr * grads[i]);
    }
    std::vector<Tensor> outputs = params;
    outputs.push_back(loss);
    if (keep_grads) outputs.insert(outputs.end(), grads.begin(), grads.end());
    else grads.clear();  // no handle: the gradients stay inside the plan
    int64_t before = memory::allocated_bytes();
    memory::reset_peak_allocated_bytes();
    sync(outputs);
    r.step_peak_bytes = memory::peak_allocated_bytes() - before;
    r.plan = jit::last_plan_memory();
    r.loss.push_back(static_cast<float>(loss.item()));
    if (keep_grads && s + 1 == steps)
      for (const Tensor& g : grads) r.grads.push_back(g.to_vector<float>());
  }
  for (const Tensor& p : m.params()) r.params.push_back(p.to_vector<float>());
  return r;
}

void require_identical(const StepResult& a, const StepResult& b) {
  REQUIRE(a.params.size() == b.params.size());
  CHECK(same_bits(a.loss, b.loss));
  for (size_t i = 0; i < a.params.size(); ++i) {
    INFO("parameter " << i);
    CHECK(same_bits(a.params[i], b.params[i]));
  }
  REQUIRE(a.grads.size() == b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    INFO("gradient " << i);
    CHECK(same_bits(a.grads[i], b.grads[i]));
  }
}

}  // namespace

TEST_CASE("recompute: checkpointed gradients are bit-identical, dropout included", "[recompute]") {
  StepResult plain = train(0, true), checkpointed = train(4, true);
  REQUIRE(plain.grads.size() == 2 * kLayers);
  require_identical(plain, checkpointed);
  // The comparison can fail: the gradients are not trivial, and another dropout seed changes them.
  for (const auto& g : plain.grads) {
    double norm = 0;
    for (float v : g) {
      REQUIRE(std::isfinite(v));
      norm += std::abs(v);
    }
    CHECK(norm > 0);
  }
  StepResult other_seed = train(4, true, 1, 12);
  CHECK_FALSE(same_bits(plain.grads[0], other_seed.grads[0]));
}

TEST_CASE("recompute: checkpoint every 4 layers shrinks the arena by at least 40%", "[recompute]") {
  // What checkpoints save alone: by default the dropout masks are recomputed in both plans.
  FlagsGuard guard;
  flags().recompute = "off";
  StepResult plain = train(0, false), checkpointed = train(4, false);
  int64_t without = plain.plan.arena_bytes, with = checkpointed.plan.arena_bytes;
  INFO("arena without checkpoint " << without << " B, with " << with << " B (lower bound " << plain.plan.lower_bound
                                   << " -> " << checkpointed.plan.lower_bound << ")");
  REQUIRE(without > 0);
  CHECK(with <= without * 60 / 100);
  // And the whole step (arena and new values), so parameters are still updated in place.
  INFO("step peak without " << plain.step_peak_bytes << " B, with " << checkpointed.step_peak_bytes << " B");
  CHECK(checkpointed.step_peak_bytes <= plain.step_peak_bytes * 60 / 100);
  // Recomputation runs more kernels: the inside of each segment again.
  CHECK(checkpointed.plan.kernels.size() > plain.plan.kernels.size());
  require_identical(plain, checkpointed);
}

TEST_CASE("recompute: repeated checkpointed steps replay their plan and stay identical", "[recompute]") {
  StepResult plain = train(0, false, 3);
  int64_t hits = jit::stats().plan_cache_hits;
  StepResult checkpointed = train(4, false, 3);
  if (flags().plan_cache) CHECK(jit::stats().plan_cache_hits - hits >= 2);
  require_identical(plain, checkpointed);
}

TEST_CASE("recompute: a rewired step is rewired once; its replays run that plan on the graph as collected",
          "[recompute]") {
  // Each step's learning rate and dropout seeds differ: the replays must read them from the graph
  // as collected, a recomputed dropout's seed from the node its copy was made of.
  StepResult plain;
  {
    FlagsGuard guard;
    flags().recompute = "off";
    plain = train(0, false, 4, 11, true);
  }
  for (const char* budget : {"", "0.5"}) {
    INFO("KILN_MEMORY_BUDGET=" << budget);
    FlagsGuard guard;
    flags().recompute = "elementwise";
    flags().memory_budget = budget;
    jit::clear_plan_cache();  // (an earlier test in this process may have run the same graph)
    const jit::JitStats before = jit::stats();
    StepResult rewired = train(0, false, 4, 11, true);
    require_identical(plain, rewired);
    CHECK(rewired.plan.recomputed_values > 0);
    if (!flags().plan_cache) continue;
    // The four steps are one graph: rewired and planned once, replayed three times.
    CHECK(jit::stats().graphs_rewired - before.graphs_rewired == 1);
    CHECK(jit::stats().plan_cache_hits - before.plan_cache_hits >= 3);
  }
  // Under the debugging poison too: the replayed plan's dead buffers are the rewired plan's.
  FlagsGuard guard;
  flags().recompute = "elementwise";
  flags().debug_memory = true;
  require_identical(plain, train(0, false, 4, 11, true));
}

TEST_CASE("recompute: the single-tensor checkpoint matches no checkpoint, reductions inside", "[recompute]") {
  auto run = [](bool use_checkpoint) {
    manual_seed(3);
    Tensor w = (randn({16, 16}) * 0.3).realize().requires_grad_();
    Tensor x = randn({8, 16}).realize().requires_grad_();
    // softmax (max and sum reductions), exp and dropout inside the segment
    auto block = [&w](const Tensor& t) { return dropout(softmax(matmul(t, w), -1) * exp(t * 0.1), 0.2); };
    Tensor y = use_checkpoint ? checkpoint(block, x) : block(x);
    Tensor loss = (y * y).sum();
    auto grads = grad(loss, {w, x});
    sync({loss, grads[0], grads[1]});
    return std::vector<std::vector<float>>{grads[0].to_vector<float>(), grads[1].to_vector<float>(),
                                           {static_cast<float>(loss.item())}};
  };
  auto plain = run(false), checkpointed = run(true);
  for (size_t i = 0; i < plain.size(); ++i) CHECK(same_bits(plain[i], checkpointed[i]));
}

TEST_CASE("recompute: nested checkpoints and eager mode give the same gradients", "[recompute]") {
  auto run = [](int mode) {  // 0 plain, 1 nested checkpoints, 2 checkpoint in eager mode
    FlagsGuard guard;
    flags().lazy = mode != 2;
    manual_seed(5);
    Tensor w1 = (randn({16, 16}) * 0.3).realize().requires_grad_();
    Tensor w2 = (randn({16, 16}) * 0.3).realize().requires_grad_();
    Tensor x = randn({8, 16}).realize();
    auto inner = [&w2](const Tensor& t) { return dropout(tanh(matmul(t, w2)), 0.25); };
    auto outer = [&](const Tensor& t) {
      Tensor h = relu(matmul(t, w1));
      return mode == 1 ? checkpoint(inner, h) * 2.0 : inner(h) * 2.0;
    };
    Tensor y = mode == 0 ? outer(x) : checkpoint(outer, x);
    Tensor loss = (y * y).mean();
    auto grads = grad(loss, {w1, w2});
    sync({grads[0], grads[1]});
    return std::vector<std::vector<float>>{grads[0].to_vector<float>(), grads[1].to_vector<float>()};
  };
  auto plain = run(0), nested = run(1), eager = run(2);
  for (size_t i = 0; i < plain.size(); ++i) {
    CHECK(same_bits(plain[i], nested[i]));
    CHECK(same_bits(plain[i], eager[i]));
  }
}

TEST_CASE("recompute: poisoned dead buffers change no recomputed result", "[recompute]") {
  StepResult plain = train(0, true);
  FlagsGuard guard;
  flags().debug_memory = true;  // every buffer is filled with NaN when it dies
  require_identical(plain, train(4, true));
  flags().memory_budget = "0.5";
  require_identical(plain, train(0, true));
  require_identical(plain, train(-4, true));  // a checkpoint and the budget pass together
}

TEST_CASE("recompute: checkpoint under NoGradGuard records nothing extra", "[recompute]") {
  NoGradGuard no_grad;
  Tensor x = randn({4, 4});
  Tensor y = checkpoint([](const Tensor& t) { return t * 2.0; }, x);
  CHECK(y.node()->segment == nullptr);
  CHECK(same_bits(y.to_vector<float>(), (x * 2.0).to_vector<float>()));
}

TEST_CASE("recompute: a memory budget of half the arena fits and changes no result", "[recompute]") {
  StepResult plain = train(0, false);
  StepResult plain_grads = train(0, true);
  const int64_t arena = plain.plan.arena_bytes;
  for (std::string budget : {std::to_string(arena / 2), std::string("0.5")}) {
    FlagsGuard guard;
    flags().memory_budget = budget;
    INFO("KILN_MEMORY_BUDGET=" << budget << ", unconstrained arena " << arena << " B");
    StepResult fitted = train(0, false);
    CHECK(fitted.plan.arena_bytes <= arena / 2);
    CHECK(fitted.plan.kernels.size() > plain.plan.kernels.size());  // it recomputes
    require_identical(plain, fitted);
    StepResult fitted_grads = train(0, true);
    require_identical(plain_grads, fitted_grads);
  }
}

TEST_CASE("recompute: a budget below what checkpoints reach fits by recomputing each value on its own",
          "[recompute]") {
  FlagsGuard host;
  flags().use_cuda = false;  // (on a CUDA device this step's plan meets these budgets with the checkpoints)
  StepResult plain = train(0, false);
  StepResult plain_grads = train(0, true);
  const int64_t arena = plain.plan.arena_bytes;
  // √n checkpointing holds about 2√n of the 15 activations and fits neither; these hold a few,
  // each dropped value recomputed from the nearest kept one for its own backward readers.
  for (const char* budget : {"0.45", "0.43"}) {
    FlagsGuard guard;
    flags().memory_budget = budget;
    INFO("KILN_MEMORY_BUDGET=" << budget << ", unconstrained arena " << arena << " B");
    {
      FlagsGuard strict;
      flags().memory_budget_strict = true;  // a miss is an error
      StepResult fitted = train(0, false);
      CHECK(fitted.plan.arena_bytes <= static_cast<int64_t>(std::stod(budget) * static_cast<double>(arena)));
      // The forward is about a third of the step; the copies' work exceeds it: values are
      // recomputed more than once.
      CHECK(fitted.plan.recomputed_flops > fitted.plan.step_flops / 3);
      require_identical(plain, fitted);
    }
    // With the gradients as outputs too the backward's order holds more (every δ until its weight
    // gradient), so the budget may be missed (a warning), but the values are the same.
    require_identical(plain_grads, train(0, true));
  }
}

TEST_CASE("recompute: a budget the unconstrained plan meets leaves the plan alone", "[recompute]") {
  StepResult plain = train(0, false);
  FlagsGuard guard;
  flags().memory_budget = "1.0";
  StepResult fitted = train(0, false);
  CHECK(fitted.plan.arena_bytes == plain.plan.arena_bytes);
  CHECK(fitted.plan.kernels == plain.plan.kernels);
  require_identical(plain, fitted);
}

TEST_CASE("recompute: a fraction budget leaves a plan without a backward pass alone", "[recompute]") {
  Tensor x = randn({64, 64}).realize();
  Tensor y = exp(matmul(x, x) * 0.01);
  Tensor z = sum(matmul(y, y));
  float expected = static_cast<float>(z.item());
  FlagsGuard guard;
  flags().memory_budget = "0.5";
  Tensor y2 = exp(matmul(x, x) * 0.01);
  CHECK(same_bits({static_cast<float>(sum(matmul(y2, y2)).item())}, {expected}));
  flags().memory_budget = "1KiB";  // a size is a hard cap: this plan's arena is larger
  Tensor y3 = exp(matmul(x, x) * 0.01);
  CHECK_THROWS_WITH(sum(matmul(y3, y3)).item(), Catch::Contains("recomputation cannot help"));
}

namespace {
// train()'s step recorded but not run: its loss, the updated parameters, and both as outputs.
struct PendingStep {
  Tensor loss;
  std::vector<Tensor> params, outputs;
};
PendingStep pending_step() {
  PendingStep s;
  manual_seed(11);
  Mlp m = make_mlp();
  Data d = make_data();
  s.loss = cross_entropy(forward(m, d.x, 0), d.labels);
  s.params = m.params();
  {
    std::vector<Tensor> grads = grad(s.loss, s.params);
    NoGradGuard no_grad;
    for (size_t i = 0; i < s.params.size(); ++i) s.params[i].assign(s.params[i] - kLr * grads[i]);
  }
  s.outputs = s.params;
  s.outputs.push_back(s.loss);
  return s;
}
}  // namespace

TEST_CASE("recompute: an impossible budget runs at the smallest arena found, same results", "[recompute]") {
  StepResult plain = train(0, false);
  auto [loss, params, outputs] = pending_step();
  FlagsGuard guard;
  flags().memory_budget = "1KiB";  // (a warning on stderr names both sizes)
  sync(outputs);
  CHECK(memory::last_plan()->arena_bytes < plain.plan.arena_bytes);  // recomputation still helped
  CHECK(memory::last_plan()->recomputed_values > 0);
  CHECK(same_bits({static_cast<float>(loss.item())}, plain.loss));
  for (size_t i = 0; i < params.size(); ++i) CHECK(same_bits(params[i].to_vector<float>(), plain.params[i]));
}

TEST_CASE("recompute: an impossible budget under KILN_MEMORY_BUDGET_STRICT throws and leaves tensors usable",
          "[recompute]") {
  StepResult plain = train(0, false);
  auto [loss, params, outputs] = pending_step();
  {
    FlagsGuard guard;
    flags().memory_budget = "1KiB";
    flags().memory_budget_strict = true;
    try {
      sync(outputs);
      FAIL("a 1 KiB budget cannot hold this training step");
    } catch (const Error& e) {
      std::string message = e.what();
      INFO(message);
      CHECK(message.find("KILN_MEMORY_BUDGET=1KiB") != std::string::npos);
      CHECK(message.find("at best") != std::string::npos);
      // Below what one kernel reads and writes at once, it says no plan could fit.
      CHECK(message.find("No plan fits 1.0 KiB: one kernel (") != std::string::npos);
    }
  }
  // Nothing ran and nothing was rewired for good: the same tensors realize as without a budget.
  sync(outputs);
  CHECK(same_bits({static_cast<float>(loss.item())}, plain.loss));
  for (size_t i = 0; i < params.size(); ++i) CHECK(same_bits(params[i].to_vector<float>(), plain.params[i]));
}

namespace {
// One AdamW step of a small GPT (pre-LN blocks with residual connections): the loss, and the
// parameters after the update, with the step's plan.
struct GptStep {
  std::vector<float> loss;
  std::vector<std::vector<float>> params;
  memory::PlanLayout plan;
};
GptStep gpt_step() {
  manual_seed(5);
  nn::GPT gpt(nn::GPTConfig().vocab(32).ctx(32).layers(3).heads(2).dim(64));
  optim::AdamW opt(gpt.parameters());
  Tensor tokens = cast(floor(rand({8, 33}) * 32.0), DType::Int64).realize();
  Tensor x = slice(tokens, 1, 0, 32), y = slice(tokens, 1, 1, 33);
  Tensor loss = cross_entropy(reshape(gpt.forward(x), {-1, 32}), reshape(y, {-1}));
  loss.backward();
  opt.step({loss});  // one plan: forward, backward and update
  GptStep s{loss.to_vector<float>(), {}, *memory::last_plan()};
  for (const Tensor& p : gpt.parameters()) s.params.push_back(p.to_vector<float>());
  return s;
}
}  // namespace

TEST_CASE("recompute: a budget fits a transformer step by recomputing between checkpoints, same bits",
          "[recompute]") {
  const GptStep plain = gpt_step();
  int64_t arena = 0;  // a fraction is of the plan without any recomputation
  {
    FlagsGuard guard;
    flags().recompute = "off";
    arena = gpt_step().plan.arena_bytes;
  }
  int64_t flops_half = 0;
  for (const char* budget : {"0.5", "0.3"}) {
    FlagsGuard guard;
    flags().memory_budget = budget;
    flags().offload = "off";  // on a device (KILN_USE_CUDA=1) offload would meet the budget first
    INFO("KILN_MEMORY_BUDGET=" << budget << ", unconstrained arena " << arena << " B");
    const GptStep fitted = gpt_step();
    // Recomputing the values elementwise work gives back cannot get a transformer this low: the
    // residual stream between its sub-blocks is kept and what lies between recomputed.
    CHECK(fitted.plan.arena_bytes <= static_cast<int64_t>(std::stod(budget) * static_cast<double>(arena)));
    CHECK(fitted.plan.recomputed_flops > 0);
    CHECK(fitted.plan.recomputed_flops < fitted.plan.step_flops / 2);
    CHECK(same_bits(fitted.loss, plain.loss));
    for (size_t i = 0; i < plain.params.size(); ++i) CHECK(same_bits(fitted.params[i], plain.params[i]));
    // A looser budget recomputes less.
    if (flops_half == 0) flops_half = fitted.plan.recomputed_flops;
    else CHECK(flops_half < fitted.plan.recomputed_flops);
  }
}

TEST_CASE("recompute: budget sizes and fractions", "[recompute]") {
  CHECK(memory::budget_bytes("", 1000) == 0);
  CHECK(memory::budget_bytes("0.5", 1000) == 500);
  CHECK(memory::budget_bytes("512MiB", 1000) == 512ll << 20);
  CHECK(memory::budget_bytes("4096", 1000) == 4096);
  CHECK_THROWS_AS(memory::budget_bytes("lots", 1000), Error);
}

namespace {
// A pre-norm transformer MLP block (layer norm, linear, GELU, linear, residual) and its loss:
// the gradients of its input and parameters, and what the step keeps for its backward.
struct MlpBlockStep {
  std::vector<std::vector<float>> grads;
  int64_t saved = 0;
  int recomputed = 0;  // values the step's plan recomputes, as memory::report() shows them
  int64_t recomputed_bytes = 0;
  std::string report;
  size_t kernels = 0;  // of the step's plan
  int64_t arena = 0;
  int joined = 0;      // recomputed copies stored by a backward kernel that does other work too
};
MlpBlockStep mlp_block_step(const std::string& recompute) {
  FlagsGuard guard;
  flags().recompute = recompute;
  manual_seed(11);
  Tensor x = randn({4, 6, 16}).realize().requires_grad_();  // (as the previous block's output)
  Tensor g = (randn({16}) * 0.1 + 1.0).realize().requires_grad_();
  Tensor w1 = (randn({16, 64}) * 0.2).realize().requires_grad_();
  Tensor b1 = (randn({64}) * 0.1).realize().requires_grad_();
  Tensor w2 = (randn({64, 16}) * 0.2).realize().requires_grad_();
  auto loss_of = [&] {
    Tensor h = layer_norm(x, {16}, g);
    Tensor y = x + matmul(gelu(matmul(h, w1) + b1), w2);
    return (y * y).mean();
  };
  MlpBlockStep out;
  out.saved = jit::saved_for_backward(loss_of(), {x, g, w1, b1, w2}).activations;
  std::vector<NodePtr> targets;  // of a graph of its own: lowering it rewires it for recomputation
  for (const Tensor& t : grad(loss_of(), {x, g, w1, b1, w2})) targets.push_back(t.node());
  const jit::Program program = jit::lower_for(targets);
  std::vector<Tensor> grads = grad(loss_of(), {x, g, w1, b1, w2});
  out.kernels = program.kernels.size();
  for (const jit::Kernel& k : program.kernels)
    if (k.summary.find("recomputed") != std::string::npos) out.joined += static_cast<int>(k.side_stores.size());
  sync(grads);
  out.recomputed = memory::last_plan()->recomputed_values;
  out.recomputed_bytes = memory::last_plan()->recomputed_bytes;
  out.arena = memory::last_plan()->arena_bytes;
  out.report = memory::report();
  for (const Tensor& t : grads) out.grads.push_back(t.to_vector<float>());
  return out;
}
}  // namespace

TEST_CASE("cheap recomputation: layer norm and GELU outputs are recomputed, gradients bit-identical",
          "[recompute][planner]") {
  MlpBlockStep off = mlp_block_step("off"), cheap = mlp_block_step("cheap"),
               elementwise = mlp_block_step("elementwise");
  // The layer norm's output (4 x 6 x 16 floats) comes back from its input and statistics, and
  // the GELU's output (4 x 6 x 64) from its pre-activation: the GELU's backward evaluates the
  // same erf, so the copy joins its kernel. Nothing else here is worth more under elementwise.
  CHECK(cheap.saved <= off.saved - 4 * 6 * 16 * 4 - 4 * 6 * 64 * 4);
  CHECK(elementwise.saved == cheap.saved);
  // The plans say so in memory::report().
  CHECK(off.recomputed == 0);
  CHECK(cheap.recomputed > 0);
  CHECK(cheap.recomputed_bytes >= 4 * 6 * 16 * 4 + 4 * 6 * 64 * 4);
  CHECK_THAT(cheap.report, Catch::Contains("recomputed for the backward"));
  CHECK_THAT(off.report, !Catch::Contains("recomputed for the backward"));
  for (size_t i = 0; i < off.grads.size(); ++i) {
    CHECK(same_bits(off.grads[i], cheap.grads[i]));
    CHECK(same_bits(off.grads[i], elementwise.grads[i]));
  }
  // Each copy is one more store in a backward kernel that reads the same saved values: no kernel
  // of its own.
  CHECK(cheap.joined >= 2);
  CHECK(cheap.kernels <= off.kernels);
  // And the plan holds fewer bytes at its peak: the copies are made in the backward, not kept.
  CHECK(cheap.arena < off.arena);
  // The recomputed values are read after the originals' buffers died and were reused.
  FlagsGuard guard;
  flags().debug_memory = true;
  MlpBlockStep poisoned = mlp_block_step("cheap");
  for (size_t i = 0; i < off.grads.size(); ++i) CHECK(same_bits(off.grads[i], poisoned.grads[i]));
}

TEST_CASE("cheap recomputation never trades a saved value for larger ones", "[recompute][planner]") {
  // The square's backward reads a + b; recomputing it would keep both products instead.
  Tensor x = randn({32, 32}).realize();
  Tensor w1 = randn({32, 32}).realize().requires_grad_();
  Tensor w2 = randn({32, 32}).realize().requires_grad_();
  auto saved = [&](const std::string& mode) {
    FlagsGuard guard;
    flags().recompute = mode;
    Tensor s = matmul(x, w1) + matmul(x, w2);
    return jit::saved_for_backward((s * s).sum(), {w1, w2}).activations;
  };
  CHECK(saved("cheap") == saved("off"));
  CHECK(saved("elementwise") == saved("off"));
  CHECK(saved("off") == 32 * 32 * 4);
}

TEST_CASE("KILN_RECOMPUTE takes cheap, elementwise or off", "[recompute][flags]") {
  FlagsGuard guard;
  CHECK_THROWS_WITH(flags().set("recompute", "all"), Catch::Contains("recompute") && Catch::Contains("cheap"));
  flags().set("recompute", "elementwise");
  CHECK(flags().recompute == "elementwise");
}

TEST_CASE("cheap recomputation redoes exp where the backward's elementwise kernels would, not for a matmul",
          "[recompute][planner]") {
  Tensor x = randn({64, 32}).realize();
  Tensor w = (randn({32}) * 0.1).realize().requires_grad_();
  Tensor w2 = randn({32, 8}).realize().requires_grad_();
  auto step = [&](const std::string& mode, bool matmul_reads) {
    FlagsGuard guard;
    flags().recompute = mode;
    auto loss_of = [&] {
      // exp's gradient reads y; five ops: the scheduler stores y rather than recompute it twice.
      Tensor y = exp(exp(x * w) * 0.5 + 0.1);
      return matmul_reads ? matmul(y, w2).sum() : (y * y).sum();
    };
    const int64_t saved = jit::saved_for_backward(loss_of(), {w, w2}).activations;
    std::vector<Tensor> g = grad(loss_of(), {w, w2});
    sync(g);
    return std::make_pair(saved, std::vector<std::vector<float>>{g[0].to_vector<float>(), g[1].to_vector<float>()});
  };
  // Only elementwise kernels read y: recomputed inside them, nothing kept.
  auto [off_saved, off_grads] = step("off", false);
  auto [cheap_saved, cheap_grads] = step("cheap", false);
  CHECK(off_saved == 64 * 32 * 4);
  CHECK(cheap_saved == 0);
  CHECK(same_bits(off_grads[0], cheap_grads[0]));
  // w2's gradient (a matmul) reads y from memory: cheap keeps it, elementwise recomputes it.
  CHECK(step("cheap", true).first == 64 * 32 * 4);
  auto [all_saved, all_grads] = step("elementwise", true);
  CHECK(all_saved < 64 * 32 * 4);
  auto [kept_saved, kept_grads] = step("off", true);
  CHECK(same_bits(kept_grads[0], all_grads[0]));
  CHECK(same_bits(kept_grads[1], all_grads[1]));
}

namespace {

// As train_mnist: a batch of bytes normalized inside the step, one hidden layer, SGD.
struct BytesStep {
  std::vector<std::vector<float>> params;
  memory::PlanLayout plan;
};
constexpr int64_t kBytesBatch = 64, kBytesIn = 96, kBytesHidden = 64;
BytesStep bytes_step(int steps = 2) {
  manual_seed(5);
  std::vector<uint8_t> pixels(kBytesBatch * kBytesIn);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>((i * 37 + i / 7) % 256);
  Tensor u = from_vector<uint8_t>(pixels, {kBytesBatch, kBytesIn});
  std::vector<int64_t> labels(kBytesBatch);
  for (int64_t i = 0; i < kBytesBatch; ++i) labels[i] = i % 10;
  Tensor y = from_vector<int64_t>(labels, {kBytesBatch});
  std::vector<Tensor> params = {(randn({kBytesIn, kBytesHidden}) * 0.1).realize().requires_grad_(),
                                zeros({kBytesHidden}).requires_grad_(),
                                (randn({kBytesHidden, 10}) * 0.1).realize().requires_grad_()};
  BytesStep r;
  for (int s = 0; s < steps; ++s) {
    // (No handle on the float batch: a value a handle holds is an output of the plan.)
    Tensor h = relu(matmul((u.cast(DType::Float32) * (1.0 / 255) - 0.286) * (1 / 0.353), params[0]) + params[1]);
    std::vector<Tensor> grads = grad(cross_entropy(matmul(h, params[2]), y), params);
    {
      NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) params[i].assign(params[i] - kLr * grads[i]);
    }
    sync(params);
    r.plan = jit::last_plan_memory();
  }
  for (const Tensor& p : params) r.params.push_back(p.to_vector<float>());
  return r;
}

// Buffers of the float batch's size that live past the first layer's forward.
int held_batches(const memory::PlanLayout& plan) {
  int held = 0;
  for (const memory::PlannedBuffer& b : plan.buffers)
    held += b.bytes == kBytesBatch * kBytesIn * 4 && b.last > b.first + 2;
  return held;
}

}  // namespace

TEST_CASE("recompute: a batch normalized from bytes is made again for its weight gradient, not kept",
          "[recompute]") {
  BytesStep kept;
  {
    FlagsGuard guard;
    flags().recompute = "off";
    kept = bytes_step();
  }
  const BytesStep made_again = bytes_step();
  INFO("arena kept " << kept.plan.arena_bytes << " B, made again " << made_again.plan.arena_bytes << " B");
  CHECK(held_batches(kept.plan) == 1);
  CHECK(held_batches(made_again.plan) == 0);
  CHECK(made_again.plan.recomputed_values >= 1);
  CHECK(made_again.plan.arena_bytes < kept.plan.arena_bytes);
  REQUIRE(kept.params.size() == made_again.params.size());
  for (size_t i = 0; i < kept.params.size(); ++i) CHECK(same_bits(kept.params[i], made_again.params[i]));
  // A budget no plan meets recomputes nothing that saves next to nothing: here no matmul.
  FlagsGuard guard;
  flags().memory_budget = "0.2";
  const BytesStep missed = bytes_step();
  CHECK(missed.plan.recomputed_flops < 2 * kBytesBatch * kBytesIn * kBytesHidden);
  for (size_t i = 0; i < kept.params.size(); ++i) CHECK(same_bits(kept.params[i], missed.params[i]));
}

TEST_CASE("recompute: a budget no choice meets takes a costlier choice only for a real saving", "[recompute]") {
  manual_seed(3);
  Mlp m = make_mlp();
  Data d = make_data();
  std::vector<Tensor> params = m.params();
  Tensor loss = cross_entropy(forward(m, d.x, 0), d.labels);
  std::vector<Tensor> grads = grad(loss, params);
  std::vector<NodePtr> targets = {loss.node()};
  for (const Tensor& g : grads) targets.push_back(g.node());
  const jit::PendingGraph graph = jit::collect_pending(targets);
  const int64_t arena = 1 << 20;
  // Every choice misses a budget of 1 byte. One that saves 0.01% is not worth its work: the
  // graph stays as it is. One that saves a quarter is taken.
  for (const int64_t saving : {int64_t{100}, arena / 4}) {
    int weighed = 0;
    const memory::RecomputeChoice choice = memory::choose_recompute(graph.nodes, 1, arena, "1B", [&] {
      ++weighed;
      return arena - saving;
    });
    CAPTURE(saving);
    CHECK(weighed > 0);
    CHECK_FALSE(choice.missed.empty());
    CHECK(choice.dropped.empty() == (saving == 100));
    CHECK(choice.arena_bytes == (saving == 100 ? arena : arena - saving));
  }
  sync(grads);  // the graph is as it was: it still runs
}
