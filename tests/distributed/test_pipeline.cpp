// Pipeline parallel in any world (1 process under plain ctest; 2, 3 and 4 stages in the mpi.*
// entries): each rank trains its stage and ends with the parameters one process gets on the
// whole model and batch.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include "backends/cuda/cuda_runtime.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <unistd.h>

using namespace kiln;
namespace dist = kiln::distributed;

namespace {

constexpr int64_t kLayers = 8;

// A float64 MLP of kLayers layers (Linear and Tanh alternating), the same on every rank.
nn::Sequential mlp(uint64_t seed) {
  manual_seed(seed);
  nn::Sequential net;
  for (int64_t i = 0; i < kLayers / 2; ++i) {
    net.push_back(nn::Linear(nn::LinearOptions(6, 6).dtype(DType::Float64)));
    net.push_back(nn::Tanh());
  }
  return net;
}

std::pair<Tensor, Tensor> batch(int step) {
  manual_seed(500 + static_cast<uint64_t>(step));
  return {randn({8, 6}, DType::Float64).realize(), randn({8, 6}, DType::Float64).realize()};
}

Tensor mse(const Tensor& out, const Tensor& target) { return mse_loss(out, target); }

// Trains `steps` steps of SGD momentum through a Pipeline and, on every rank, the same model in
// one process; checks this rank's stage against the single process, and the loss on the last stage.
void check_against_one_process(dist::PipelineSchedule schedule, int64_t micro_batches, int steps) {
  dist::init();
  nn::Sequential whole = mlp(3);
  dist::Pipeline pipe(mlp(3), dist::PipelineOptions().micro_batches(micro_batches).schedule(schedule));
  optim::SGD opt(pipe.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  optim::SGD reference(whole.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = batch(step);
    Tensor loss = pipe.train_step(opt, x, y, mse);
    Tensor expected = mse(whole.forward(x), y);
    reference.step(expected);
    if (pipe.is_last()) {
      REQUIRE(loss.defined());
      CHECK(loss.item() == Approx(expected.item()).epsilon(1e-12));
    } else {
      CHECK_FALSE(loss.defined());
    }
  }
  std::map<std::string, Tensor> full;
  for (const auto& [name, p] : whole.named_parameters()) full[name] = p;
  const auto named = pipe.named_parameters();
  CHECK(!named.empty());
  for (const auto& [name, p] : named) {
    INFO("parameter " << name << " on stage " << pipe.stage());
    REQUIRE(full.count(name) == 1);
    std::vector<double> got = p.to_doubles(), want = full[name].to_doubles();
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-12));
  }
}

}  // namespace

TEST_CASE("pipeline orders: every forward before its backward, 1F1B holds at most stages - stage", "[pipeline]") {
  for (int64_t p : {1, 2, 4})
    for (int64_t m : {1, 3, 8})
      for (int64_t s = 0; s < p; ++s)
        for (auto schedule : {dist::PipelineSchedule::GPipe, dist::PipelineSchedule::OneFOneB}) {
          auto order = dist::pipeline_order(schedule, p, s, m);
          REQUIRE(order.size() == static_cast<size_t>(2 * m));
          std::vector<int> forwarded(static_cast<size_t>(m), 0), backwarded(static_cast<size_t>(m), 0);
          int64_t live = 0, peak = 0;
          for (const auto& a : order) {
            if (a.forward) {
              forwarded[static_cast<size_t>(a.micro_batch)]++;
              peak = std::max(peak, ++live);
            } else {
              CHECK(forwarded[static_cast<size_t>(a.micro_batch)] == 1);
              backwarded[static_cast<size_t>(a.micro_batch)]++;
              --live;
            }
          }
          CHECK(std::all_of(backwarded.begin(), backwarded.end(), [](int b) { return b == 1; }));
          CHECK(peak == (schedule == dist::PipelineSchedule::GPipe ? m : std::min(m, p - s)));
        }
}

TEST_CASE("pipeline stages follow balance or split the parameters evenly, and reject bad numbers", "[pipeline]") {
  nn::Sequential net = mlp(1);  // 4 Linear(6, 6) with a Tanh after each
  CHECK(dist::pipeline_stages(net, {3, 5}, 2) == std::vector<int64_t>{0, 3, 8});
  CHECK(dist::pipeline_stages(net, {}, 2) == std::vector<int64_t>{0, 4, 8});
  CHECK(dist::pipeline_stages(net, {}, 4) == std::vector<int64_t>{0, 2, 4, 6, 8});
  CHECK(dist::pipeline_stages(net, {}, 8) == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8});
  CHECK_THROWS_WITH(dist::pipeline_stages(net, {3, 4}, 2), Catch::Contains("sums to 7 layers but the model has 8"));
  CHECK_THROWS_WITH(dist::pipeline_stages(net, {8}, 2), Catch::Contains("balance gives 1 stages but the world has 2"));
  CHECK_THROWS_WITH(dist::pipeline_stages(net, {8, 0}, 2), Catch::Contains("at least one layer"));
  CHECK_THROWS_WITH(dist::pipeline_stages(net, {}, 9), Catch::Contains("9 stages need at least one layer each"));
}

TEST_CASE("pipeline rejects micro-batches that do not divide the batch", "[pipeline][distributed]") {
  dist::init();
  dist::Pipeline pipe(mlp(2), dist::PipelineOptions().micro_batches(3));
  optim::SGD opt(pipe.parameters(), optim::SGDOptions(0.1));
  auto [x, y] = batch(0);
  CHECK_THROWS_WITH(pipe.train_step(opt, x, y, mse), Catch::Contains("into 3 equal micro-batches"));
  CHECK_THROWS_WITH(dist::Pipeline(mlp(2), dist::PipelineOptions().micro_batches(0)), Catch::Contains("micro_batches"));
}

TEST_CASE("a GPipe pipeline trains like one process on the whole model", "[pipeline][distributed][train]") {
  check_against_one_process(dist::PipelineSchedule::GPipe, 4, 10);
}

TEST_CASE("a 1F1B pipeline trains like one process on the whole model", "[pipeline][distributed][train]") {
  check_against_one_process(dist::PipelineSchedule::OneFOneB, 4, 10);
}

TEST_CASE("a pipeline step is one plan per rank and 1F1B keeps fewer micro-batches than GPipe", "[pipeline][distributed]") {
  dist::init();
  if (!flags().lazy) return;  // eager mode runs every op on its own
  auto peak = [](dist::PipelineSchedule schedule) {
    dist::Pipeline pipe(mlp(4), dist::PipelineOptions().micro_batches(8).schedule(schedule));
    optim::SGD opt(pipe.parameters(), optim::SGDOptions(0.1));
    auto [x, y] = batch(1);
    pipe.train_step(opt, x, y, mse);  // learns the layouts, makes the plan
    const jit::JitStats before = jit::stats();
    pipe.train_step(opt, x, y, mse);
    const jit::JitStats after = jit::stats();
    CHECK(after.plans_built + after.plan_cache_hits - before.plans_built - before.plan_cache_hits == 1);
    const int64_t messages = (pipe.is_first() ? 0 : 1) + (pipe.is_last() ? 0 : 1);
    CHECK(after.messages_sent - before.messages_sent == 8 * messages);
    CHECK(after.messages_received - before.messages_received == 8 * messages);
    // Sent messages are let go of once received, on every stage (the last one never waits for a
    // collective, so nothing else would): memory in use does not grow from step to step.
    dist::barrier();
    pipe.train_step(opt, x, y, mse);
    dist::barrier();
    const int64_t in_use = memory::pool_stats().allocated.current;
    for (int s = 0; s < 3; ++s) pipe.train_step(opt, x, y, mse);
    dist::barrier();
    pipe.train_step(opt, x, y, mse);
    CHECK(memory::pool_stats().allocated.current <= in_use);
    return pipe.last_step().peak_live_micro_batches;
  };
  const int64_t gpipe = peak(dist::PipelineSchedule::GPipe);
  const int64_t one_f_one_b = peak(dist::PipelineSchedule::OneFOneB);
  CHECK(gpipe == 8);
  CHECK(one_f_one_b == std::min<int64_t>(8, dist::world_size() - dist::rank()));
}

TEST_CASE("pipeline forward gives the whole model's output on the last stage", "[pipeline][distributed]") {
  dist::init();
  nn::Sequential whole = mlp(7);
  dist::Pipeline pipe(mlp(7));
  auto [x, y] = batch(2);
  NoGradGuard no_grad;
  for (int repeat = 0; repeat < 2; ++repeat) {  // the second learns nothing new
    Tensor out = pipe.forward(x);
    if (!pipe.is_last()) {
      CHECK_FALSE(out.defined());
      continue;
    }
    std::vector<double> got = out.to_doubles(), want = whole.forward(x).to_doubles();
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-12));
  }
}

TEST_CASE("a stage that fails mid-step makes the others fail naming it, within the timeout", "[pipeline][distributed]") {
  dist::init();
  if (dist::world_size() != 2 || !flags().lazy) return;
  dist::Pipeline pipe(mlp(8), dist::PipelineOptions().micro_batches(2));
  optim::SGD opt(pipe.parameters(), optim::SGDOptions(0.1));
  auto [x, y] = batch(3);
  pipe.train_step(opt, x, y, mse);  // both stages learn the layouts
  if (pipe.is_first()) {
    FlagsGuard guard;
    flags().collective_timeout = 1.0;
    CHECK_THROWS_WITH(pipe.train_step(opt, x, y, mse),
                      Catch::Contains("for a message from rank 1") && Catch::Contains("KILN_COLLECTIVE_TIMEOUT"));
  } else {
    auto failing = [](const Tensor&, const Tensor&) -> Tensor { throw std::runtime_error("the loss failed"); };
    CHECK_THROWS_WITH(pipe.train_step(opt, x, y, failing), Catch::Contains("the loss failed"));
    // Takes the activations the first stage sent, so that both ranks go on with nothing in flight.
    for (int64_t k = 0; k < 2; ++k) dist::recv({4, 6}, DType::Float64, 0, static_cast<int>(dist::pipeline_tag(k, false)));
  }
  dist::barrier();
}

TEST_CASE("a pipeline stage holds one set of gradient sums, not a micro-batch's gradients besides",
          "[pipeline][distributed]") {
  dist::init();
  manual_seed(2);
  nn::Sequential net;
  for (int i = 0; i < 8; ++i) net.push_back(nn::Linear(128, 128));  // 64 KiB weights; tiny activations
  dist::Pipeline pipe(net, dist::PipelineOptions().micro_batches(4));
  optim::SGD opt(pipe.parameters(), optim::SGDOptions(0.01).momentum(0.9));
  Tensor x = randn({8, 128}).realize(), y = randn({8, 128}).realize();
  for (int step = 0; step < 2; ++step) pipe.train_step(opt, x, y, mse);
  int64_t params = 0, largest = 0;
  for (const Tensor& p : pipe.parameters()) {
    params += p.numel() * 4;
    largest = std::max(largest, p.numel() * 4);
  }
  // The sums (as many bytes as the parameters); while one is added to, its old value and the
  // micro-batch's gradient (at most 2 x the largest parameter); activations of a few KiB. Each
  // micro-batch's gradients kept until they are added (or until the update) would double it.
  INFO("stage " << pipe.stage() << ": arena " << pipe.last_step().arena_bytes << " B, parameters " << params << " B");
  CHECK(pipe.last_step().arena_bytes <= params + 2 * largest + 16 * 1024);
}

TEST_CASE("a pipeline step's trace shows the stage's forward, backward, update and messages on rows of their own",
          "[pipeline][distributed]") {
  dist::init();
  if (!flags().lazy) return;  // eager mode runs no plan
  dist::Pipeline pipe(mlp(4), dist::PipelineOptions().micro_batches(2));
  optim::SGD opt(pipe.parameters(), optim::SGDOptions(0.1));
  auto [x, y] = batch(1);
  pipe.train_step(opt, x, y, mse);
  memory::start_trace();
  pipe.train_step(opt, x, y, mse);  // a replay of the cached plan keeps the labels
  memory::stop_trace();
  const std::string path =
      (std::filesystem::temp_directory_path() / fmt::format("kiln_pipeline_trace_{}_{}.json", ::getpid(), dist::rank()))
          .string();
  memory::export_trace(path);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::filesystem::remove(path);
  const nlohmann::json trace = nlohmann::json::parse(text.str());
  std::set<std::string> rows, labels;
  std::string process;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("name") == "thread_name") rows.insert(e.at("args").at("name").get<std::string>());
    if (e.at("name") == "process_name") process = e.at("args").at("name").get<std::string>();
    if (e.at("ph") == "X" && e.at("args").contains("label")) labels.insert(e.at("args").at("label").get<std::string>());
  }
  CHECK(process.find(fmt::format("stage {} of {}", pipe.stage(), pipe.stages())) != std::string::npos);
  CHECK(rows.count("forward") == 1);
  CHECK(rows.count("backward") == 1);
  CHECK(rows.count("update") == 1);
  CHECK(labels.count("forward 0") == 1);
  CHECK(labels.count("backward 1") == 1);
  // Messages (sends, receives and the waits for them) run on a row of their own.
  CHECK(rows.count("communication") == (pipe.stages() > 1 ? 1u : 0u));
}

TEST_CASE("2 pipeline stages x 2 data-parallel replicas (4 ranks) train like one process", "[pipeline][distributed]") {
  dist::init();
  if (dist::world_size() != 4) return;  // the layout needs 4 ranks (ctest's mpi.np4.pipeline)
  // Ranks 0, 1 are replica 0's stages, ranks 2, 3 replica 1's; every rank makes every group.
  std::vector<dist::Group> replicas{dist::new_group({0, 1}), dist::new_group({2, 3})};
  std::vector<dist::Group> stages{dist::new_group({0, 2}), dist::new_group({1, 3})};
  const int me = dist::rank(), replica = me / 2;
  nn::Sequential whole = mlp(5);
  dist::Pipeline pipe(mlp(5), dist::PipelineOptions().micro_batches(2).group(replicas[static_cast<size_t>(replica)]));
  CHECK(pipe.stage() == me % 2);
  dist::DataParallel averaged(pipe, stages[static_cast<size_t>(me % 2)]);  // the replicas of this stage
  optim::SGD opt(pipe.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  optim::SGD reference(whole.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 5; ++step) {
    auto [x, y] = batch(step);  // 8 rows: each replica trains on its 4
    Tensor xs = x.slice(0, 4 * replica, 4 * replica + 4), ys = y.slice(0, 4 * replica, 4 * replica + 4);
    Tensor loss = pipe.train_step(opt, xs, ys, mse);
    reference.step(mse(whole.forward(x), y));
    CHECK(loss.defined() == pipe.is_last());
  }
  std::map<std::string, Tensor> full;
  for (const auto& [name, p] : whole.named_parameters()) full[name] = p;
  for (const auto& [name, p] : pipe.named_parameters()) {
    INFO("parameter " << name << " on rank " << me);
    std::vector<double> got = p.to_doubles(), want = full.at(name).to_doubles();
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-12));
  }
  dist::barrier();
}

TEST_CASE("a pipeline on a CUDA device trains like one process", "[pipeline][distributed][device]") {
  if (!cuda::available()) {
    WARN("SKIPPED: no CUDA device (KILN_CUDA_EMULATOR=1 emulates one)");
    return;
  }
  dist::init();
  const Device gpu = Device::cuda(0);
  nn::Sequential whole = mlp(6), stages = mlp(6);
  whole.to(gpu);
  stages.to(gpu);
  dist::Pipeline pipe(stages, dist::PipelineOptions().micro_batches(2));
  optim::SGD opt(pipe.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  optim::SGD reference(whole.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    Tensor xg = x.to(gpu), yg = y.to(gpu);
    Tensor loss = pipe.train_step(opt, xg, yg, mse);
    Tensor expected = mse(whole.forward(xg), yg);
    reference.step(expected);
    if (pipe.is_last()) CHECK(loss.item() == Approx(expected.item()).epsilon(1e-12));
  }
  std::map<std::string, Tensor> full;
  for (const auto& [name, p] : whole.named_parameters()) full[name] = p;
  for (const auto& [name, p] : pipe.named_parameters()) {
    CHECK(p.device() == gpu);
    std::vector<double> got = p.to_doubles(), want = full.at(name).to_doubles();
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-12));
  }
}

namespace {

// A (Linear, Tanh) pair whose activations are recomputed in the backward (nn::checkpoint).
struct CheckpointedPair : nn::Module {
  CheckpointedPair()
      : Module("CheckpointedPair"),
        block(register_module("block", nn::Sequential(nn::Linear(nn::LinearOptions(6, 6).dtype(DType::Float64)), nn::Tanh()))) {}
  nn::Sequential block;
  Tensor forward(const Tensor& x) override { return nn::checkpoint(block, x); }
};

nn::Sequential checkpointed_mlp(uint64_t seed) {
  manual_seed(seed);
  nn::Sequential net;
  for (int i = 0; i < 4; ++i) net.push_back(CheckpointedPair());
  return net;
}

}  // namespace

TEST_CASE("pipeline stages with nn::checkpoint inside train like one process", "[pipeline][distributed]") {
  dist::init();
  nn::Sequential whole = checkpointed_mlp(4);
  dist::Pipeline pipe(checkpointed_mlp(4), dist::PipelineOptions().micro_batches(2));
  optim::SGD opt(pipe.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  optim::SGD reference(whole.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    Tensor loss = pipe.train_step(opt, x, y, mse);
    Tensor expected = mse(whole.forward(x), y);
    reference.step(expected);
    if (pipe.is_last()) CHECK(loss.item() == Approx(expected.item()).epsilon(1e-12));
  }
  std::map<std::string, Tensor> full;
  for (const auto& [name, p] : whole.named_parameters()) full[name] = p;
  const auto named = pipe.named_parameters();
  CHECK(!named.empty());
  for (const auto& [name, p] : named) {
    INFO("parameter " << name);
    REQUIRE(full.count(name) == 1);
    std::vector<double> got = p.to_doubles(), want = full.at(name).to_doubles();
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-12));
  }
}

// The reading of a compressed activation (memory/compress.h) is made when the plan is built, so
// its id is the newest of the step; ordered by it, the backward reading it would wait for every
// later receive and send: 1F1B would become GPipe here, and a stage whose neighbour compresses
// nothing would deadlock with it. The first stage has nothing to compress (a Linear of the
// realized batch); the last stage's ReLU outputs are int8.
TEST_CASE("a pipeline whose last stage compresses its activations keeps its order and trains", "[pipeline]") {
  dist::init();
  FlagsGuard flags_guard;
  flags().collective_timeout = 60;
  auto model = [] {
    manual_seed(21);
    return nn::Sequential(nn::Linear(64, 64), nn::ReLU(), nn::Linear(64, 64), nn::ReLU(), nn::Linear(64, 64));
  };
  const int world = dist::world_size();
  std::vector<int64_t> balance = world == 2 ? std::vector<int64_t>{1, 4} : std::vector<int64_t>{};
  if (world > 2) return;  // the layout above is for one or two stages
  nn::Sequential whole = model();
  dist::PipelineOptions options = dist::PipelineOptions().micro_batches(4);
  if (!balance.empty()) options.balance(balance);
  dist::Pipeline pipe(model(), options);
  optim::SGD opt(pipe.parameters(), optim::SGDOptions(0.05));
  optim::SGD reference(whole.parameters(), optim::SGDOptions(0.05));
  CompressActivationsGuard int8(true);
  for (int step = 0; step < 3; ++step) {
    manual_seed(700 + static_cast<uint64_t>(step));
    Tensor x = randn({16, 64}).realize(), y = randn({16, 64}).realize();
    Tensor loss = pipe.train_step(opt, x, y, mse);
    Tensor expected;
    {
      CompressActivationsGuard off(false);
      expected = mse(whole.forward(x), y);
      reference.step(expected);
    }
    if (pipe.is_last()) CHECK(loss.item() == Approx(expected.item()).epsilon(2e-2));
  }
}

TEST_CASE("a GPT cut into stages trains like one process, clipping by the whole model's norm",
          "[pipeline][distributed][train]") {
  dist::init();
  // Untied: the embedding is on the first stage, the head on the last.
  const nn::GPTConfig config = nn::GPTConfig().vocab(11).ctx(8).layers(2).heads(2).dim(16).tie_weights(false);
  manual_seed(17);
  nn::GPT whole(config);
  manual_seed(17);
  nn::GPT cut(config);
  dist::Pipeline pipe(cut.as_sequential(), dist::PipelineOptions().micro_batches(2));
  // A small max_norm, so that every step clips: a stage clipping by its own norm would differ.
  const optim::AdamOptions options = optim::AdamWOptions(1e-2).weight_decay(0.1);
  optim::AdamW opt(pipe.parameters(), options), reference(whole.parameters(), options);
  opt.clip_grad_norm(0.05, [](const Tensor& sum_of_squares) { return dist::all_reduce(sum_of_squares); });
  reference.clip_grad_norm(0.05);
  auto lm = [](const Tensor& logits, const Tensor& y) {
    return nn::cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
  };
  for (int step = 0; step < 3; ++step) {
    manual_seed(900 + static_cast<uint64_t>(step));
    auto tokens = [] { return (rand({4, 8}) * 11).cast(DType::Int64).realize(); };  // 0 ... 10
    Tensor x = tokens(), y = tokens();
    Tensor loss = pipe.train_step(opt, x, y, lm);
    Tensor expected = lm(whole.forward(x), y);
    reference.zero_grad();
    expected.backward();
    reference.step({expected});
    if (pipe.is_last()) CHECK(loss.item() == Approx(expected.item()).epsilon(1e-5));
  }
  CHECK(reference.last_grad_norm().item() > 0.05);  // the steps did clip
  std::map<std::string, Tensor> full;
  for (const auto& [name, p] : whole.as_sequential().named_parameters()) full[name] = p;
  for (const auto& [name, p] : pipe.named_parameters()) {
    INFO("parameter " << name << " on stage " << pipe.stage());
    REQUIRE(full.count(name) == 1);
    const std::vector<float> got = p.to_vector<float>(), want = full[name].to_vector<float>();
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).margin(1e-5));
  }
  CHECK_THROWS_WITH(nn::GPT(nn::GPTConfig()).as_sequential(), Catch::Contains("tie_weights(false)"));
}
