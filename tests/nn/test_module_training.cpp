// Training steps of nn::Module models: a step (forward, backward, SGD momentum update) replays
// from the plan cache with nothing compiled after the first, both with opt.step(loss) and with
// zero_grad / backward / step; BatchNorm1d's running statistics, recorded as lazy assigns, are
// realized with each step (opt.sync_with_step) and hold the expected values.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <cmath>

using namespace kiln;

namespace {

constexpr int64_t kIn = 16, kHidden = 32, kClasses = 4, kBatch = 24;
constexpr int kSteps = 5;

// 16 -> 32 (-> BatchNorm1d) -> 32 -> 4 with ReLU.
struct Mlp : nn::Module {
  explicit Mlp(bool batch_norm) : Module("Mlp"), use_norm(batch_norm) {}
  bool use_norm;
  nn::Linear fc1 = register_module("fc1", nn::Linear(kIn, kHidden));
  nn::BatchNorm1d norm = register_module("norm", nn::BatchNorm1d(kHidden));
  nn::Linear fc2 = register_module("fc2", nn::Linear(kHidden, kHidden));
  nn::Linear fc3 = register_module("fc3", nn::Linear(kHidden, kClasses));
  Tensor forward(const Tensor& x) {  // (B, 16) -> logits (B, 4)
    Tensor h = fc1.forward(x);
    if (use_norm) h = norm.forward(h);
    return fc3.forward(relu(fc2.forward(relu(h))));
  }
};

struct Batch {
  Tensor x, y;
};

// kSteps + 1 realized batches of the same shape and different values.
std::vector<Batch> make_batches() {
  std::vector<Batch> batches;
  for (int s = 0; s <= kSteps; ++s) {
    std::vector<int64_t> labels(kBatch);
    for (int64_t i = 0; i < kBatch; ++i) labels[i] = (i * 3 + s) % kClasses;
    batches.push_back({(randn({kBatch, kIn}) + 0.5).realize(), from_vector<int64_t>(labels, {kBatch})});
  }
  return batches;
}

enum class Style { StepLoss, Backward };

// One step; the number of correct predictions is realized with it. Neither the logits nor a
// value with gradient history outlives the step: a pending value that autograd could still go
// through, reading the old parameters, would keep them from being updated in place.
void train_step(Mlp& model, optim::Optimizer& opt, const Batch& batch, Style style) {
  Tensor loss, correct;
  {
    Tensor logits = model.forward(batch.x);
    loss = nn::cross_entropy(logits, batch.y);
    correct = eq(argmax(logits.detach(), 1), batch.y).sum();
  }
  if (style == Style::StepLoss) {
    opt.step(loss, {correct});
  } else {
    opt.zero_grad();
    loss.backward();
    opt.step({loss, correct});
  }
  REQUIRE(loss.is_realized());
  REQUIRE(correct.is_realized());
  REQUIRE(std::isfinite(loss.item()));
  REQUIRE(correct.item() >= 0);
}

std::vector<const void*> storage_of(const std::vector<Tensor>& tensors) {
  std::vector<const void*> out;
  for (const Tensor& t : tensors) out.push_back(t.data());
  return out;
}

// Steps 2.. of a training run: nothing compiled or planned, one plan-cache hit each, buffers
// realized after every step, and (when `in_place`) parameters updated in their own storage.
void check_replay(Mlp& model, optim::Optimizer& opt, const std::vector<Batch>& batches, Style style,
                  bool in_place = true) {
  train_step(model, opt, batches[0], style);
  const jit::JitStats before = jit::stats();
  std::vector<const void*> params_before = storage_of(model.parameters());
  for (int s = 1; s <= kSteps; ++s) {
    train_step(model, opt, batches[s], style);
    for (const auto& [name, buffer] : model.named_buffers()) {
      INFO("buffer " << name << " after step " << s);
      CHECK(buffer.is_realized());
    }
  }
  if (!flags().lazy) return;  // eager mode (KILN_LAZY=0) runs op by op: no plans to replay
  CHECK(jit::stats().kernels_compiled == before.kernels_compiled);
  CHECK(jit::stats().modules_compiled == before.modules_compiled);
  CHECK(jit::stats().plans_built == before.plans_built);
  CHECK(jit::stats().plan_cache_hits - before.plan_cache_hits >= kSteps);
  if (in_place) CHECK(storage_of(model.parameters()) == params_before);
}

}  // namespace

TEST_CASE("a module training step replays from the plan cache", "[nn][train]") {
  for (Style style : {Style::StepLoss, Style::Backward}) {
    INFO((style == Style::StepLoss ? "opt.step(loss)" : "zero_grad, backward, step"));
    manual_seed(31);
    std::vector<Batch> batches = make_batches();
    Mlp model(/*batch_norm=*/false);
    optim::SGD opt(model.parameters(), optim::SGDOptions(0.05).momentum(0.9));
    opt.sync_with_step(model.buffers());  // unused BatchNorm: its buffers have nothing pending
    check_replay(model, opt, batches, style);
  }
}

TEST_CASE("BatchNorm1d running statistics update with each step, which still replays", "[nn][train]") {
  for (Style style : {Style::StepLoss, Style::Backward}) {
    INFO((style == Style::StepLoss ? "opt.step(loss)" : "zero_grad, backward, step"));
    manual_seed(32);
    std::vector<Batch> batches = make_batches();
    Mlp model(/*batch_norm=*/true);
    optim::SGD opt(model.parameters(), optim::SGDOptions(0.05).momentum(0.9));
    opt.sync_with_step(model.buffers());
    // Known limitation of the scheduler: with step(loss) the update of norm.weight is placed
    // before the last kernel that reads the old weight, so it gets a new buffer each step.
    check_replay(model, opt, batches, style, /*in_place=*/style == Style::Backward);
  }

  // The values: running = (1 - 0.1) * running + 0.1 * batch statistic, the variance unbiased,
  // with the batch statistics of fc1's output read before each step.
  manual_seed(33);
  std::vector<Batch> batches = make_batches();
  Mlp model(/*batch_norm=*/true);
  optim::SGD opt(model.parameters(), optim::SGDOptions(0.05).momentum(0.9));
  opt.sync_with_step(model.buffers());
  std::vector<double> mean(kHidden, 0.0), var(kHidden, 1.0);
  for (int s = 0; s < kSteps; ++s) {
    std::vector<float> h;
    {
      NoGradGuard no_grad;
      h = model.fc1.forward(batches[s].x).to_vector<float>();  // (B, 32)
    }
    for (int64_t c = 0; c < kHidden; ++c) {
      double sum = 0, squares = 0;
      for (int64_t n = 0; n < kBatch; ++n) sum += h[n * kHidden + c];
      double m = sum / kBatch;
      for (int64_t n = 0; n < kBatch; ++n) squares += (h[n * kHidden + c] - m) * (h[n * kHidden + c] - m);
      mean[c] = 0.9 * mean[c] + 0.1 * m;
      var[c] = 0.9 * var[c] + 0.1 * squares / (kBatch - 1);
    }
    train_step(model, opt, batches[s], Style::StepLoss);
  }
  std::vector<float> running_mean = model.norm.running_mean.to_vector<float>();
  std::vector<float> running_var = model.norm.running_var.to_vector<float>();
  for (int64_t c = 0; c < kHidden; ++c) {
    INFO("channel " << c);
    CHECK(running_mean[c] == Approx(mean[c]).epsilon(1e-5).margin(1e-6));
    CHECK(running_var[c] == Approx(var[c]).epsilon(1e-5).margin(1e-6));
  }
  CHECK(model.norm.num_batches_tracked.item() == kSteps);
}
