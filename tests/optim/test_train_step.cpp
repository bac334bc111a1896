// optim::TrainStep: a replayed step trains exactly as recorded steps do (SGD and Adam with
// learning-rate schedules, autocast, dropout, batches of two shapes, BatchNorm through
// sync_with_step), records again when it must, and runs eagerly, saying why, when it cannot replay.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <functional>
#include <memory>
#include <optional>

using namespace kiln;

namespace {

struct Net : nn::Module {
  explicit Net(double dropout = 0, bool batch_norm = false) : Module("Net"), p(dropout), bn(batch_norm) {}
  double p;
  bool bn;
  nn::Linear fc1 = register_module("fc1", nn::Linear(12, 16));
  nn::BatchNorm1d norm = register_module("norm", nn::BatchNorm1d(16));
  nn::Linear fc2 = register_module("fc2", nn::Linear(16, 5));
  Tensor forward(const Tensor& x) override {
    Tensor h = fc1.forward(x);
    if (bn) h = norm.forward(h);
    h = relu(h);
    if (p > 0) h = dropout(h, p);
    return fc2.forward(h);
  }
};

struct Batch {
  Tensor x, y;
};
std::vector<Batch> batches(std::vector<int64_t> sizes) {
  std::vector<Batch> out;
  for (int64_t n : sizes) out.push_back({rand({n, 12}).realize(), cast(floor(rand({n}) * 5.0), DType::Int64).realize()});
  return out;
}

using MakeOptimizer = std::function<std::unique_ptr<optim::Optimizer>(std::vector<Tensor>)>;

struct Options {
  MakeOptimizer make;
  DType amp = DType::Float32;
  double dropout = 0;
  bool batch_norm = false;
  bool schedule = true;
};

struct Trained {
  std::vector<double> losses;
  std::vector<std::vector<float>> params, buffers;
  int64_t replays = 0, recordings = 0;
  bool replaying = true;
  std::string why;
};

// Trains a fresh Net (seed 1) on `data` (seed 7 for the steps' random draws): with a TrainStep,
// or recorded step by step.
Trained train(const Options& o, const std::vector<Batch>& data, bool replay,
              const std::function<void(Tensor&)>& inside = {}) {
  manual_seed(1);
  Net net(o.dropout, o.batch_norm);
  std::unique_ptr<optim::Optimizer> opt = o.make(net.parameters());
  if (o.batch_norm) opt->sync_with_step(net.buffers());
  std::optional<optim::CosineAnnealingLR> schedule;
  if (o.schedule) schedule.emplace(*opt, 10);
  auto loss_of = [&](const std::vector<Tensor>& b) {
    std::optional<AutocastGuard> autocast;
    if (o.amp != DType::Float32) autocast.emplace(o.amp);
    Tensor loss = nn::cross_entropy(net.forward(b[0]), b[1]);
    if (inside) inside(loss);
    return loss;
  };
  optim::TrainStep step(*opt, loss_of);
  manual_seed(7);
  Trained t;
  for (const Batch& b : data) {
    if (replay) {
      t.losses.push_back(step({b.x, b.y})[0].item());
    } else {
      Tensor loss = loss_of({b.x, b.y});
      opt->step(loss);
      t.losses.push_back(loss.item());
    }
    if (schedule) schedule->step();
  }
  for (const Tensor& p : net.parameters()) t.params.push_back(p.to_vector<float>());
  for (const Tensor& b : net.buffers())
    if (b.dtype() == DType::Float32) t.buffers.push_back(b.to_vector<float>());
  t.replays = step.replays();
  t.recordings = step.recordings();
  t.replaying = step.replaying();
  t.why = step.why_not_replayed();
  return t;
}

void check_same(const Trained& replayed, const Trained& recorded) {
  CHECK(replayed.losses == recorded.losses);
  REQUIRE(replayed.params.size() == recorded.params.size());
  for (size_t i = 0; i < replayed.params.size(); ++i) CHECK(replayed.params[i] == recorded.params[i]);
  CHECK(replayed.buffers == recorded.buffers);
}

MakeOptimizer sgd(double momentum, bool nesterov = false, double weight_decay = 0) {
  return [=](std::vector<Tensor> params) {
    return std::make_unique<optim::SGD>(
        std::move(params), optim::SGDOptions(0.1).momentum(momentum).nesterov(nesterov).weight_decay(weight_decay));
  };
}
MakeOptimizer adam(bool decoupled) {
  return [=](std::vector<Tensor> params) -> std::unique_ptr<optim::Optimizer> {
    optim::AdamOptions options = optim::AdamOptions(0.01).weight_decay(0.01);
    if (decoupled) return std::make_unique<optim::AdamW>(std::move(params), options);
    return std::make_unique<optim::Adam>(std::move(params), options);
  };
}

}  // namespace

TEST_CASE("TrainStep: replayed steps train as recorded steps do, bit for bit", "[optim][train_step]") {
  const std::vector<Batch> data = batches({8, 8, 8, 8, 8, 8, 8});
  struct Case {
    const char* name;
    Options options;
  };
  const Case cases[] = {{"SGD momentum, cosine lr", {sgd(0.9)}},
                        {"SGD Nesterov, weight decay", {sgd(0.9, true, 0.01)}},
                        {"SGD plain", {sgd(0)}},
                        {"Adam (bias corrections per step)", {adam(false)}},
                        {"AdamW", {adam(true)}},
                        {"SGD under bfloat16 autocast", {sgd(0.9), DType::BFloat16}},
                        {"Adam, dropout (random keys per step)", {adam(false), DType::Float32, 0.3}},
                        {"SGD, BatchNorm's running statistics", {sgd(0.9), DType::Float32, 0, true}}};
  for (const Case& c : cases) {
    INFO(c.name);
    const Trained recorded = train(c.options, data, false), replayed = train(c.options, data, true);
    INFO(replayed.why);
    CHECK(replayed.replaying);
    CHECK(replayed.recordings == 1);
    CHECK(replayed.replays == static_cast<int64_t>(data.size()) - 2);
    check_same(replayed, recorded);
  }
}

TEST_CASE("TrainStep: clipped gradients and their norm, as recorded steps give them", "[optim][train_step]") {
  const std::vector<Batch> data = batches({8, 8, 8, 8, 8});
  std::vector<double> norms[2];
  std::vector<std::vector<float>> params[2];
  for (int replay = 0; replay < 2; ++replay) {
    manual_seed(1);
    Net net;
    optim::SGD opt(net.parameters(), optim::SGDOptions(0.5).momentum(0.9));
    opt.clip_grad_norm(0.05);
    auto loss_of = [&](const std::vector<Tensor>& b) { return nn::cross_entropy(net.forward(b[0]), b[1]); };
    optim::TrainStep step(opt, loss_of);
    for (const Batch& b : data) {
      if (replay) step({b.x, b.y});
      else opt.step(loss_of({b.x, b.y}));
      norms[replay].push_back(opt.last_grad_norm().item());
    }
    if (replay) CHECK(step.replays() == 3);
    for (const Tensor& p : net.parameters()) params[replay].push_back(p.to_vector<float>());
  }
  CHECK(norms[0] == norms[1]);
  CHECK(params[0] == params[1]);
}

// Found in review: each of these replayed something other than what recording gives.
TEST_CASE("TrainStep: random draws recomputed by a checkpoint, or not needed by the plan", "[optim][train_step]") {
  const std::vector<Batch> data = batches({8, 8, 8, 8, 8, 8});
  for (int unused_draw = 0; unused_draw < 2; ++unused_draw) {
    INFO((unused_draw ? "fn draws numbers the plan does not need" : "dropout inside a checkpoint"));
    std::vector<double> losses[2];
    std::vector<std::vector<float>> params[2];
    for (int replay = 0; replay < 2; ++replay) {
      manual_seed(1);
      Net net;
      optim::SGD opt(net.parameters(), optim::SGDOptions(0.1).momentum(0.9));
      auto loss_of = [&](const std::vector<Tensor>& b) {
        if (unused_draw) (void)rand({100});
        Tensor h = relu(net.fc1.forward(b[0]));
        h = unused_draw ? dropout(h, 0.3) : kiln::checkpoint(std::function<Tensor(const Tensor&)>([](const Tensor& t) { return dropout(relu(t), 0.3); }), h);
        return nn::cross_entropy(net.fc2.forward(h), b[1]);
      };
      optim::TrainStep step(opt, loss_of);
      manual_seed(7);
      for (const Batch& b : data) {
        if (replay) {
          losses[1].push_back(step({b.x, b.y})[0].item());
        } else {
          Tensor loss = loss_of({b.x, b.y});
          opt.step(loss);
          losses[0].push_back(loss.item());
        }
      }
      if (replay) CHECK(step.replays() == 4);
      for (const Tensor& p : net.parameters()) params[replay].push_back(p.to_vector<float>());
    }
    CHECK(losses[0] == losses[1]);
    CHECK(params[0] == params[1]);
  }
}

TEST_CASE("TrainStep: a returned buffer is also the buffer's new value", "[optim][train_step]") {
  const std::vector<Batch> data = batches({8, 8, 8, 8, 8});
  std::vector<std::vector<float>> means[2];
  for (int replay = 0; replay < 2; ++replay) {
    manual_seed(1);
    Net net(0, true);
    optim::SGD opt(net.parameters(), optim::SGDOptions(0.1));
    opt.sync_with_step(net.buffers());
    auto loss_of = [&](const std::vector<Tensor>& b) -> std::vector<Tensor> {
      return {nn::cross_entropy(net.forward(b[0]), b[1]), net.norm.running_mean};
    };
    optim::TrainStep step(opt, loss_of);
    std::vector<Tensor> kept;  // the previous steps' outputs held: nothing is updated in place
    for (const Batch& b : data) {
      if (replay) {
        std::vector<Tensor> out = step({b.x, b.y});
        kept.insert(kept.end(), out.begin(), out.end());
      } else {
        std::vector<Tensor> out = loss_of({b.x, b.y});
        opt.step(out[0], {out[1]});
        kept.insert(kept.end(), out.begin(), out.end());
      }
      means[replay].push_back(net.norm.running_mean.to_vector<float>());
    }
    if (replay) CHECK(step.replays() == 3);
  }
  CHECK(means[0] == means[1]);
}

TEST_CASE("TrainStep: a batch that passes one tensor twice is recorded apart", "[optim][train_step]") {
  manual_seed(1);
  Net net;
  optim::SGD opt(net.parameters(), optim::SGDOptions(0.0));  // lr 0: every step sees the same weights
  optim::TrainStep step(opt, [&](const std::vector<Tensor>& b) { return (net.forward(b[0]) - net.forward(b[1])).abs().sum(); });
  Tensor x = rand({8, 12}).realize(), t = rand({8, 12}).realize();
  for (int i = 0; i < 3; ++i) CHECK(step({x, x})[0].item() == 0.0);
  const double apart = step({x, t})[0].item();
  CHECK(apart > 0);
  CHECK(step({x, t})[0].item() == apart);
  CHECK(step({x, x})[0].item() == 0.0);
  CHECK(step.recordings() == 2);
}

TEST_CASE("TrainStep: a replayed step refuses a bad learning rate as a recorded one does", "[optim][train_step]") {
  const std::vector<Batch> data = batches({8, 8, 8});
  manual_seed(1);
  Net net;
  optim::SGD opt(net.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  optim::TrainStep step(opt, [&](const std::vector<Tensor>& b) { return nn::cross_entropy(net.forward(b[0]), b[1]); });
  for (const Batch& b : data) step({b.x, b.y});
  REQUIRE(step.replays() == 1);
  const std::vector<float> before = net.fc1.weight.to_vector<float>();
  opt.set_lr(-0.1);
  CHECK_THROWS_WITH(step({data[0].x, data[0].y}), Catch::Contains("lr -0.1"));
  CHECK(net.fc1.weight.to_vector<float>() == before);
  opt.set_lr(0.1);
  step({data[0].x, data[0].y});
  CHECK(step.replays() == 2);
}

TEST_CASE("TrainStep: an epoch's last, smaller batch is recorded once and kept", "[optim][train_step]") {
  const std::vector<Batch> data = batches({8, 8, 5, 8, 8, 5, 8, 5});
  const Options options{sgd(0.9)};
  const Trained recorded = train(options, data, false), replayed = train(options, data, true);
  CHECK(replayed.replaying);
  CHECK(replayed.recordings == 2);
  CHECK(replayed.replays == static_cast<int64_t>(data.size()) - 3);
  check_same(replayed, recorded);
}

TEST_CASE("TrainStep: a step that reads a value on the host runs eagerly and says so", "[optim][train_step]") {
  const std::vector<Batch> data = batches({8, 8, 8, 8});
  const Options options{sgd(0.9)};
  auto reads = [](Tensor& loss) { (void)(loss * 2.0).item(); };
  const Trained recorded = train(options, data, false, reads), eager = train(options, data, true, reads);
  CHECK_FALSE(eager.replaying);
  CHECK_THAT(eager.why, Catch::Contains("item()"));
  CHECK(eager.replays == 0);
  check_same(eager, recorded);
}

TEST_CASE("TrainStep: a module buffer the optimizer does not know keeps the step eager", "[optim][train_step]") {
  const std::vector<Batch> data = batches({8, 8, 8, 8});
  manual_seed(1);
  Net net(0, true);
  optim::SGD opt(net.parameters(), optim::SGDOptions(0.1).momentum(0.9));  // no sync_with_step
  optim::TrainStep step(opt, [&](const std::vector<Tensor>& b) { return nn::cross_entropy(net.forward(b[0]), b[1]); });
  for (const Batch& b : data) step({b.x, b.y});
  CHECK_FALSE(step.replaying());
  CHECK_THAT(step.why_not_replayed(), Catch::Contains("sync_with_step"));
}

TEST_CASE("TrainStep: changed hyperparameters and a cleared plan cache are recorded again", "[optim][train_step]") {
  const std::vector<Batch> data = batches({8, 8, 8, 8, 8, 8});
  manual_seed(1);
  Net a, b;
  manual_seed(1);
  Net recorded_net;
  optim::SGD opt(a.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  optim::SGD opt_recorded(recorded_net.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  optim::TrainStep step(opt, [&](const std::vector<Tensor>& x) { return nn::cross_entropy(a.forward(x[0]), x[1]); });
  for (size_t i = 0; i < data.size(); ++i) {
    if (i == 3) {
      opt.group(0).options.momentum(0.5);
      opt_recorded.group(0).options.momentum(0.5);
    }
    if (i == 4) jit::clear_plan_cache();
    const double loss = step({data[i].x, data[i].y})[0].item();
    Tensor expected = nn::cross_entropy(recorded_net.forward(data[i].x), data[i].y);
    opt_recorded.step(expected);
    CHECK(loss == expected.item());
  }
  CHECK(step.replaying());
  CHECK(step.recordings() == 3);  // the second step, the new momentum, the cleared cache
  CHECK(step.replays() == 2);
  const std::vector<Tensor> pa = a.parameters(), pr = recorded_net.parameters();
  for (size_t i = 0; i < pa.size(); ++i) CHECK(pa[i].to_vector<float>() == pr[i].to_vector<float>());
}

TEST_CASE("TrainStep: a function's metrics are computed with the step", "[optim][train_step]") {
  const std::vector<Batch> data = batches({8, 8, 8, 8});
  manual_seed(1);
  Net net;
  optim::SGD opt(net.parameters(), optim::SGDOptions(0.1));
  optim::TrainStep step(opt, [&](const std::vector<Tensor>& b) -> std::vector<Tensor> {
    Tensor logits = net.forward(b[0]);
    Tensor correct = cast(eq(argmax(logits.detach(), 1), b[1]), DType::Int64).sum();
    return {nn::cross_entropy(logits, b[1]), correct};
  });
  for (const Batch& b : data) {
    std::vector<Tensor> out = step({b.x, b.y});
    REQUIRE(out.size() == 2);
    CHECK(out[1].is_realized());
    CHECK(out[1].item() >= 0);
  }
  CHECK(step.replays() == 2);
}
