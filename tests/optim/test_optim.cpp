// Optimizers, schedules and gradient clipping against PyTorch's formulas written out in double;
// plan-cache replay of a whole training step; a small MLP that learns.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <array>
#include <cmath>
#include <functional>
#include <span>
#include <vector>

#include "../support/mlp.h"

using namespace kiln;
using namespace kiln::optim;

namespace {

// One (2, 3) parameter and the loss 0.5 * sum(w * (p - target)^2), whose gradient is
// w * (p - target).
const std::vector<double> kInit = {0.5, -1.25, 2.0, 0.75, -0.3, 1.5};
const std::vector<double> kTarget = {0.1, 0.2, -0.3, 0.4, -0.5, 0.6};
const std::vector<double> kWeight = {1.0, 2.0, 0.5, 3.0, 1.5, 0.25};

Tensor make_param(const std::vector<double>& values = kInit) {
  return from_doubles(values, {2, 3}, DType::Float32).realize().requires_grad_();
}

Tensor quadratic_loss(const Tensor& p) {
  Tensor d = p - from_doubles(kTarget, {2, 3}, DType::Float32);
  return (from_doubles(kWeight, {2, 3}, DType::Float32) * d * d).sum() * 0.5;
}

std::vector<double> quadratic_grad(const std::vector<double>& p) {
  std::vector<double> g(p.size());
  for (size_t i = 0; i < p.size(); ++i) g[i] = kWeight[i] * (p[i] - kTarget[i]);
  return g;
}

// torch.optim.SGD's step for one parameter, in double.
struct ReferenceSGD {
  explicit ReferenceSGD(double lr_, double momentum_ = 0, double dampening_ = 0, double weight_decay_ = 0,
                        bool nesterov_ = false)
      : lr(lr_), momentum(momentum_), dampening(dampening_), weight_decay(weight_decay_), nesterov(nesterov_) {}
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
  std::vector<double> buf;  // empty until the first step, as PyTorch's momentum_buffer
  void step(std::vector<double>& p) {
    std::vector<double> g = quadratic_grad(p);
    bool first = buf.empty();
    if (first) buf.assign(p.size(), 0.0);
    for (size_t i = 0; i < p.size(); ++i) {
      if (weight_decay != 0) g[i] += weight_decay * p[i];
      if (momentum != 0) {
        buf[i] = first ? g[i] : momentum * buf[i] + (1 - dampening) * g[i];
        g[i] = nesterov ? g[i] + momentum * buf[i] : buf[i];
      }
      p[i] -= lr * g[i];
    }
  }
};

// torch.optim.Adam / AdamW's step for one parameter, in double.
struct ReferenceAdam {
  explicit ReferenceAdam(double lr_, double beta1_ = 0.9, double beta2_ = 0.999, double eps_ = 1e-8,
                         double weight_decay_ = 0, bool decoupled_ = false)
      : lr(lr_), beta1(beta1_), beta2(beta2_), eps(eps_), weight_decay(weight_decay_), decoupled(decoupled_) {}
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled;
  std::vector<double> m, v;
  int t = 0;
  void step(std::vector<double>& p) {
    std::vector<double> g = quadratic_grad(p);
    if (m.empty()) m.assign(p.size(), 0.0), v.assign(p.size(), 0.0);
    ++t;
    double bc1 = 1 - std::pow(beta1, t), bc2 = 1 - std::pow(beta2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      if (weight_decay != 0) {
        if (decoupled) p[i] *= 1 - lr * weight_decay;
        else g[i] += weight_decay * p[i];
      }
      m[i] = beta1 * m[i] + (1 - beta1) * g[i];
      v[i] = beta2 * v[i] + (1 - beta2) * g[i] * g[i];
      double denom = std::sqrt(v[i]) / std::sqrt(bc2) + eps;
      p[i] -= lr / bc1 * m[i] / denom;
    }
  }
};

void check_close(const std::vector<float>& got, const std::vector<double>& want, double rel = 2e-6) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(rel).margin(1e-7));
}

enum class Style { Backward, StepLoss };

// Five steps of `opt` on the quadratic loss, each compared with `reference`.
template <class Reference>
void compare_steps(Optimizer& opt, Tensor& p, Reference reference, Style style, int steps = 5) {
  std::vector<double> want = kInit;
  for (int s = 0; s < steps; ++s) {
    Tensor loss = quadratic_loss(p);
    if (style == Style::Backward) {
      opt.zero_grad();
      loss.backward();
      opt.step();
    } else {
      opt.step(loss);
    }
    reference.step(want);
    INFO("step " << s + 1);
    check_close(p.to_vector<float>(), want);
  }
}

}  // namespace

TEST_CASE("optim: SGD matches PyTorch's update rule", "[optim]") {
  struct Case {
    const char* name;
    SGDOptions options;
  };
  std::vector<Case> cases = {
      {"plain", SGDOptions(0.1)},
      {"momentum", SGDOptions(0.1).momentum(0.9)},
      {"momentum + dampening", SGDOptions(0.05).momentum(0.8).dampening(0.3)},
      {"nesterov", SGDOptions(0.1).momentum(0.9).nesterov(true)},
      {"weight decay", SGDOptions(0.1).weight_decay(0.05)},
      {"momentum + weight decay", SGDOptions(0.1).momentum(0.9).weight_decay(0.01)},
  };
  for (const Case& c : cases) {
    for (Style style : {Style::Backward, Style::StepLoss}) {
      INFO(c.name << (style == Style::Backward ? ", backward + step()" : ", step(loss)"));
      Tensor p = make_param();
      SGD opt({p}, c.options);
      ReferenceSGD ref(c.options.lr(), c.options.momentum(), c.options.dampening(), c.options.weight_decay(),
                       c.options.nesterov());
      compare_steps(opt, p, ref, style);
    }
  }
}

TEST_CASE("optim: Adam and AdamW match PyTorch's update rules", "[optim]") {
  for (Style style : {Style::Backward, Style::StepLoss}) {
    INFO((style == Style::Backward ? "backward + step()" : "step(loss)"));
    {
      Tensor p = make_param();
      Adam opt({p}, AdamOptions(0.05));
      compare_steps(opt, p, ReferenceAdam(0.05), style);
    }
    {
      Tensor p = make_param();
      Adam opt({p}, AdamOptions(0.05).betas(0.8, 0.95).eps(1e-6).weight_decay(0.1));
      ReferenceAdam ref(0.05, 0.8, 0.95, 1e-6, 0.1);
      compare_steps(opt, p, ref, style);
    }
    {
      Tensor p = make_param();
      AdamW opt({p}, AdamWOptions(0.05).weight_decay(0.1));
      ReferenceAdam ref(0.05, 0.9, 0.999, 1e-8, 0.1, true);
      compare_steps(opt, p, ref, style);
    }
  }
  AdamW defaults({make_param()});
  CHECK(defaults.group(0).options.weight_decay() == 0.01);
  CHECK(defaults.lr() == 1e-3);
}

TEST_CASE("optim: set_lr takes effect without recompiling", "[optim]") {
  Tensor p = make_param();
  SGD opt({p}, SGDOptions(0.1).momentum(0.9));
  ReferenceSGD ref(0.1, 0.9);
  std::vector<double> want = kInit;
  for (int s = 0; s < 2; ++s) {
    opt.step(quadratic_loss(p));
    ref.step(want);
  }
  int64_t compiled = jit::stats().kernels_compiled;
  int64_t plans = jit::stats().plans_built;
  opt.set_lr(0.02);
  ref.lr = 0.02;
  CHECK(opt.lr() == 0.02);
  opt.step(quadratic_loss(p));
  ref.step(want);
  CHECK(jit::stats().kernels_compiled == compiled);
  CHECK(jit::stats().plans_built == plans);
  check_close(p.to_vector<float>(), want);
}

TEST_CASE("optim: parameter groups keep their own options", "[optim]") {
  Tensor a = make_param(), b = make_param();
  SGD opt({{{a}, SGDOptions(0.1)}, {{b}, SGDOptions(0.01).momentum(0.5)}});
  REQUIRE(opt.group_count() == 2);
  CHECK(opt.group_lr(1) == 0.01);
  ReferenceSGD ref_a(0.1), ref_b(0.01, 0.5);
  std::vector<double> want_a = kInit, want_b = kInit;
  for (int s = 0; s < 3; ++s) {
    opt.step(quadratic_loss(a) + quadratic_loss(b));
    ref_a.step(want_a);
    ref_b.step(want_b);
  }
  check_close(a.to_vector<float>(), want_a);
  check_close(b.to_vector<float>(), want_b);
  opt.set_lr(0.3);
  CHECK(opt.group_lr(0) == 0.3);
  CHECK(opt.group_lr(1) == 0.3);
  opt.set_group_lr(1, 0.2);
  CHECK(opt.group(1).options.lr() == 0.2);
  CHECK(opt.parameters().size() == 2);

  // Parameters without a gradient are left alone.
  Tensor c = make_param();
  opt.add_param_group({c}, SGDOptions(1.0));
  opt.zero_grad();
  quadratic_loss(a).backward();
  std::vector<float> b_before = b.to_vector<float>();
  opt.step();
  CHECK(b.to_vector<float>() == b_before);
  check_close(c.to_vector<float>(), kInit);
}

TEST_CASE("optim: state round trip continues training identically", "[optim]") {
  Tensor p = make_param();
  Adam opt({p}, AdamOptions(0.05));
  for (int s = 0; s < 3; ++s) opt.step(quadratic_loss(p));
  auto state = opt.state();
  CHECK(state.count("0.0.exp_avg") == 1);
  CHECK(state.count("0.0.exp_avg_sq") == 1);
  REQUIRE(state.count("0.0.step") == 1);
  CHECK(state.at("0.0.step").item() == 3);

  std::vector<double> copied_values;
  for (float x : p.to_vector<float>()) copied_values.push_back(x);
  Tensor copy = make_param(copied_values);
  Adam resumed({copy}, AdamOptions(0.05));
  std::map<std::string, Tensor> saved;  // as a checkpoint would: fresh tensors with the values
  for (auto& [key, t] : state) saved[key] = from_doubles(t.to_doubles(), t.shape(), t.dtype());
  resumed.load_state(saved);
  for (int s = 0; s < 2; ++s) {
    opt.step(quadratic_loss(p));
    resumed.step(quadratic_loss(copy));
  }
  CHECK(copy.to_vector<float>() == p.to_vector<float>());

  saved["0.1.exp_avg"] = zeros({2, 3});
  CHECK_THROWS_AS(resumed.load_state(saved), Error);
  saved.erase("0.1.exp_avg");
  saved["0.0.exp_avg"] = zeros({3, 2});
  CHECK_THROWS_AS(resumed.load_state(saved), Error);
  saved.erase("0.0.exp_avg");
  saved["0.0.momentum"] = zeros({2, 3});
  CHECK_THROWS_AS(resumed.load_state(saved), Error);
}

TEST_CASE("optim: schedules give the documented lr sequences", "[optim]") {
  auto sequence = [](Optimizer& opt, LRSchedule& schedule, int n) {
    std::vector<double> lrs{schedule.lr()};
    for (int i = 1; i < n; ++i) {
      schedule.step();
      lrs.push_back(opt.lr());
    }
    return lrs;
  };
  auto check_sequence = [](const std::vector<double>& got, const std::vector<double>& want) {
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).margin(1e-12));
  };
  {
    SGD opt({make_param()}, SGDOptions(1.0));
    StepLR schedule(opt, 2, 0.5);
    check_sequence(sequence(opt, schedule, 6), {1, 1, 0.5, 0.5, 0.25, 0.25});
  }
  {
    SGD opt({make_param()}, SGDOptions(1.0));
    CosineAnnealingLR schedule(opt, 4, 0.0);
    double c = (1 + std::cos(M_PI / 4)) / 2, d = (1 + std::cos(3 * M_PI / 4)) / 2;
    check_sequence(sequence(opt, schedule, 7), {1, c, 0.5, d, 0, 0, 0});
  }
  {
    SGD opt({make_param()}, SGDOptions(2.0));
    CosineAnnealingLR schedule(opt, 2, 0.5);
    check_sequence(sequence(opt, schedule, 3), {2, 1.25, 0.5});
  }
  {
    SGD opt({make_param()}, SGDOptions(1.0));
    LinearWarmup schedule(opt, 4);
    check_sequence(sequence(opt, schedule, 6), {0.25, 0.5, 0.75, 1, 1, 1});
  }
  {
    SGD opt({make_param()}, SGDOptions(1.0));
    LinearWarmup schedule(opt, 2, std::make_shared<StepLR>(opt, 1, 0.5));
    check_sequence(sequence(opt, schedule, 5), {0.5, 1, 1, 0.5, 0.25});
  }
  {  // every group scales from its own base lr
    Tensor a = make_param(), b = make_param();
    SGD opt({{{a}, SGDOptions(1.0)}, {{b}, SGDOptions(0.1)}});
    StepLR schedule(opt, 1, 0.5);
    schedule.step();
    CHECK(opt.group_lr(0) == Approx(0.5));
    CHECK(opt.group_lr(1) == Approx(0.05));
    CHECK(schedule.steps() == 1);
  }
}

TEST_CASE("optim: clip_grad_norm scales gradients above max_norm", "[optim]") {
  Tensor a = from_doubles({3, 0}, {2}, DType::Float32).realize().requires_grad_();
  Tensor b = from_doubles({0, 0, 4}, {3}, DType::Float32).realize().requires_grad_();
  Tensor unused = zeros({2}).realize().requires_grad_();
  // grad a = (3, 0), grad b = (0, 0, 4): total norm 5.
  ((a * a).sum() * 0.5 + (b * b).sum() * 0.5).backward();
  Tensor norm = clip_grad_norm({a, b, unused}, 1.0);
  CHECK(norm.item() == Approx(5.0));
  CHECK(!unused.grad().defined());
  std::vector<float> ga = a.grad().to_vector<float>(), gb = b.grad().to_vector<float>();
  CHECK(ga[0] == Approx(3.0 / (5.0 + 1e-6)));
  CHECK(gb[2] == Approx(4.0 / (5.0 + 1e-6)));

  // Below max_norm: unchanged.
  a.zero_grad();
  b.zero_grad();
  ((a * a).sum() * 0.5 + (b * b).sum() * 0.5).backward();
  CHECK(clip_grad_norm({a, b}, 10.0).item() == Approx(5.0));
  CHECK(a.grad().to_vector<float>() == std::vector<float>{3, 0});
  CHECK(b.grad().to_vector<float>() == std::vector<float>{0, 0, 4});

  // Lazily in a step: clipped gradients, then SGD.
  a.zero_grad();
  b.zero_grad();
  SGD opt({a, b}, SGDOptions(1.0));
  ((a * a).sum() * 0.5 + (b * b).sum() * 0.5).backward();
  Tensor lazy_norm = clip_grad_norm(opt.parameters(), 2.5);
  opt.step();
  CHECK(lazy_norm.item() == Approx(5.0));
  std::vector<float> pa = a.to_vector<float>();
  CHECK(pa[0] == Approx(3.0 - 3.0 * 2.5 / (5.0 + 1e-6)));
}

TEST_CASE("optim: an optimizer that clips steps as clip_grad_norm then step", "[optim]") {
  auto run = [](bool in_optimizer) {
    Tensor a = from_doubles({3, 0}, {2}, DType::Float32).realize().requires_grad_();
    Tensor b = from_doubles({0, 0, 4}, {3}, DType::Float32).realize().requires_grad_();
    Adam opt({a, b}, AdamOptions(0.1));
    if (in_optimizer) opt.clip_grad_norm(2.5);
    std::vector<double> norms;
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      ((a * a * a).sum() + (b * b).sum() * 0.5).backward();
      Tensor norm = in_optimizer ? Tensor() : clip_grad_norm(opt.parameters(), 2.5);
      opt.step();
      norms.push_back((in_optimizer ? opt.last_grad_norm() : norm).item());
    }
    std::vector<float> values = a.to_vector<float>(), more = b.to_vector<float>();
    values.insert(values.end(), more.begin(), more.end());
    return std::pair{values, norms};
  };
  const auto [clipped, norms] = run(true);
  const auto [by_hand, hand_norms] = run(false);
  CHECK(clipped == by_hand);
  CHECK(norms == hand_norms);
  CHECK(norms[0] == Approx(std::sqrt(27.0 * 27.0 + 16.0)));
  Tensor p = zeros({1}).realize().requires_grad_();
  SGD opt({p}, SGDOptions(0.1));
  CHECK_THROWS_WITH(opt.clip_grad_norm(-1), Catch::Contains("non-negative"));
}

namespace {

// A 2-layer MLP on a fixed synthetic problem: labels from a random linear teacher.
struct Problem {
  Tensor x, y;
  Problem() {
    manual_seed(5);
    x = randn({64, 8}).realize();                              // (B, 8)
    y = argmax(matmul(x, randn({8, 4})), 1).realize();         // (B) in [0, 4)
  }
  Tensor loss(const std::vector<Tensor>& params) const {
    Tensor h = relu(matmul(x, params[0]) + params[1]);  // (B, 16)
    return cross_entropy(matmul(h, params[2]) + params[3], y);
  }
};

// Trains for `steps`; returns the first and last loss.
std::pair<double, double> train(Optimizer& opt, const Problem& problem, Style style, int steps) {
  std::vector<Tensor> params = opt.parameters();
  double first = 0, last = 0;
  for (int s = 0; s < steps; ++s) {
    Tensor loss = problem.loss(params);
    if (style == Style::Backward) {
      opt.zero_grad();
      loss.backward();
      opt.step();
    } else {
      opt.step(loss);
    }
    last = loss.item();
    if (s == 0) first = last;
  }
  return {first, last};
}

}  // namespace

TEST_CASE("optim: a small MLP learns with SGD momentum and with Adam", "[optim][train]") {
  Problem problem;
  for (Style style : {Style::Backward, Style::StepLoss}) {
    INFO((style == Style::Backward ? "backward + step()" : "step(loss)"));
    manual_seed(6);
    SGD sgd(testing::make_mlp({8, 16, 4}), SGDOptions(0.1).momentum(0.9));
    auto [sgd_first, sgd_last] = train(sgd, problem, style, 60);
    CHECK(sgd_last < 0.5 * sgd_first);
    manual_seed(6);
    Adam adam(testing::make_mlp({8, 16, 4}), AdamOptions(0.01));
    auto [adam_first, adam_last] = train(adam, problem, style, 60);
    CHECK(adam_last < 0.5 * adam_first);
  }
}

TEST_CASE("optim: a training step replays from the plan cache and updates in place", "[optim][train]") {
  if (!flags().lazy) return;  // eager mode (KILN_LAZY=0) runs op by op: no plans to replay
  Problem problem;
  for (Style style : {Style::Backward, Style::StepLoss}) {
    INFO((style == Style::Backward ? "backward + step()" : "step(loss)"));
    manual_seed(7);
    Adam opt(testing::make_mlp({8, 16, 4}), AdamOptions(0.01));
    train(opt, problem, style, 2);
    std::vector<const void*> buffers;
    for (const Tensor& p : opt.parameters()) buffers.push_back(p.data());
    int64_t compiled = jit::stats().kernels_compiled;
    int64_t plans = jit::stats().plans_built;
    int64_t hits = jit::stats().plan_cache_hits;
    train(opt, problem, style, 3);
    CHECK(jit::stats().kernels_compiled == compiled);
    CHECK(jit::stats().plans_built == plans);
    CHECK(jit::stats().plan_cache_hits > hits);
    std::vector<Tensor> params = opt.parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      INFO("parameter " << i);
      CHECK(params[i].data() == buffers[i]);
    }
  }
}

TEST_CASE("step takes its outputs from any range of tensors", "[optim]") {
  // The same update from a braced list, a std::vector, a std::array and a std::span; every
  // output is realized by the step.
  auto run = [](auto make_outputs, bool with_loss) {
    Tensor p = from_vector<float>({1, -2, 3}, {3}).requires_grad_();
    SGD opt({p}, SGDOptions(0.1));
    Tensor loss = sum(p * p);
    Tensor metric = sum(abs(p.detach())), other = mean(p.detach());
    auto outputs = make_outputs(metric, other);
    if (with_loss) {
      opt.step(loss, outputs);
    } else {
      loss.backward();
      opt.step(outputs);
    }
    CHECK(metric.is_realized());
    CHECK(other.is_realized());
    CHECK(metric.item() == Approx(6.0));
    return p.to_vector<float>();
  };
  auto vector = [](Tensor a, Tensor b) { return std::vector<Tensor>{a, b}; };
  auto array = [](Tensor a, Tensor b) { return std::array<Tensor, 2>{a, b}; };
  std::vector<Tensor> storage;
  auto span = [&storage](Tensor a, Tensor b) {
    storage = {a, b};
    return std::span<const Tensor>(storage);
  };
  const std::vector<float> want{0.8f, -1.6f, 2.4f};  // p - 0.1 * 2p
  for (bool with_loss : {true, false}) {
    CAPTURE(with_loss);
    CHECK(run(vector, with_loss) == want);
    CHECK(run(array, with_loss) == want);
    CHECK(run(span, with_loss) == want);
  }
  Tensor p = from_vector<float>({1}, {1}).requires_grad_();
  SGD opt({p}, SGDOptions(0.5));
  Tensor done = sum(p.detach() * 2.0);
  opt.step(sum(p * p), {done});  // the braced list still works
  CHECK(done.item() == Approx(2.0));
}
