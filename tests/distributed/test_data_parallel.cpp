// DataParallel in any world (1 process under plain ctest; 2 and 3 ranks in the mpi.np2 / mpi.np3
// entries): every rank trains on its shard and ends with the parameters one process gets on the
// whole batch.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include "backends/cuda/cuda_runtime.h"

using namespace kiln;
namespace dist = kiln::distributed;

namespace {

// A float64 MLP whose weights differ per rank before DataParallel broadcasts rank 0's.
struct Mlp : nn::Module {
  Tensor w1, b1, w2, b2;
  explicit Mlp(uint64_t seed) : nn::Module("Mlp") {
    manual_seed(seed);
    w1 = register_parameter("w1", randn({5, 8}, DType::Float64) * 0.4);
    b1 = register_parameter("b1", randn({8}, DType::Float64) * 0.1);
    w2 = register_parameter("w2", randn({8, 3}, DType::Float64) * 0.4);
    b2 = register_parameter("b2", randn({3}, DType::Float64) * 0.1);
  }
  Tensor forward(const Tensor& x) override { return matmul(tanh(matmul(x, w1) + b1), w2) + b2; }
};

// The global batch of step `step`: 4 examples per rank, the same on every rank.
std::pair<Tensor, Tensor> global_batch(int step, int world) {
  manual_seed(1000 + static_cast<uint64_t>(step));
  Tensor x = randn({4 * world, 5}, DType::Float64);
  Tensor y = randn({4 * world, 3}, DType::Float64);
  return {x.realize(), y.realize()};
}

Tensor loss_of(nn::Module& m, const Tensor& x, const Tensor& y) { return mse_loss(m.forward(x), y); }

std::vector<double> flat_parameters(const nn::Module& m) {
  std::vector<double> out;
  for (const Tensor& p : m.parameters())
    for (double v : p.to_doubles()) out.push_back(v);
  return out;
}

}  // namespace

TEST_CASE("data parallel SGD equals one process on the whole batch", "[distributed][train]") {
  dist::init();
  const int n = dist::world_size(), me = dist::rank();
  Mlp reference(7);  // every rank builds the single-process reference itself
  Mlp local(7 + static_cast<uint64_t>(me));
  dist::DataParallel model(local);  // rank 0's weights (seed 7) everywhere
  CHECK(flat_parameters(local) == flat_parameters(reference));
  optim::SGD ref_opt(reference.parameters(), optim::SGDOptions(0.05).momentum(0.9));
  optim::SGD opt(model.parameters(), optim::SGDOptions(0.05).momentum(0.9));
  const int64_t before = model.all_reduce_count();
  for (int step = 0; step < 20; ++step) {
    auto [x, y] = global_batch(step, n);
    ref_opt.step(loss_of(reference, x, y));
    Tensor xs = x.slice(0, 4 * me, 4 * me + 4), ys = y.slice(0, 4 * me, 4 * me + 4);
    if (step % 2 == 0) {
      opt.step(loss_of(model, xs, ys));
    } else {  // the other spelling: backward(), then step()
      opt.zero_grad();
      loss_of(model, xs, ys).backward();
      opt.step();
    }
  }
  std::vector<double> got = flat_parameters(local), want = flat_parameters(reference);
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-12).margin(1e-14));
  // One bucket (all 83 parameters fit in the first MiB) per step, and none in a world of 1.
  CHECK(model.all_reduce_count() - before == (n > 1 ? 20 : 0));
}

TEST_CASE("an optimizer that clips clips the averaged gradients: every rank as one process", "[distributed][train]") {
  dist::init();
  const int n = dist::world_size(), me = dist::rank();
  Mlp reference(7);
  Mlp local(7 + static_cast<uint64_t>(me));
  dist::DataParallel model(local);
  optim::AdamW ref_opt(reference.parameters(), optim::AdamWOptions(0.05));
  optim::AdamW opt(model.parameters(), optim::AdamWOptions(0.05));
  ref_opt.clip_grad_norm(0.05);  // small enough to clip every step
  opt.clip_grad_norm(0.05);
  for (int step = 0; step < 5; ++step) {
    auto [x, y] = global_batch(step, n);
    ref_opt.step(loss_of(reference, x, y));
    opt.step(loss_of(model, x.slice(0, 4 * me, 4 * me + 4), y.slice(0, 4 * me, 4 * me + 4)));
    CHECK(opt.last_grad_norm().item() == Approx(ref_opt.last_grad_norm().item()).epsilon(1e-9));
    CHECK(ref_opt.last_grad_norm().item() > 0.05);
  }
  std::vector<double> got = flat_parameters(local), want = flat_parameters(reference);
  for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-9).margin(1e-12));
}

TEST_CASE("gradient accumulation over micro-batches equals the big batch, with one all-reduce", "[distributed][train]") {
  dist::init();
  const int n = dist::world_size(), me = dist::rank();
  Mlp reference(3), local(3);
  dist::DataParallel model(local);
  optim::SGD ref_opt(reference.parameters(), optim::SGDOptions(0.1));
  optim::SGD opt(model.parameters(), optim::SGDOptions(0.1));
  auto [x, y] = global_batch(0, n);
  ref_opt.step(loss_of(reference, x, y));
  const int64_t before = model.all_reduce_count();
  opt.zero_grad();
  for (int k = 0; k < 2; ++k) {  // this rank's 4 examples as 2 micro-batches of 2
    const int64_t at = 4 * me + 2 * k;
    (loss_of(model, x.slice(0, at, at + 2), y.slice(0, at, at + 2)) * 0.5).backward();
  }
  opt.step();
  CHECK(model.all_reduce_count() - before == (n > 1 ? 1 : 0));
  std::vector<double> got = flat_parameters(local), want = flat_parameters(reference);
  for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-12).margin(1e-14));
}

TEST_CASE("DataParallel::accumulate(k) steps once per k micro-batches with their mean gradient", "[distributed][train]") {
  dist::init();
  const int n = dist::world_size(), me = dist::rank();
  Mlp reference(4), local(4);
  dist::DataParallel model(local);
  model.accumulate(2);
  optim::SGD ref_opt(reference.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  optim::SGD opt(model.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(step, n);
    ref_opt.step(loss_of(reference, x, y));
    const int64_t before = model.all_reduce_count();
    const std::vector<double> unchanged = flat_parameters(local);
    for (int k = 0; k < 2; ++k) {  // this rank's 4 examples as 2 micro-batches of 2, each its own step(loss)
      const int64_t at = 4 * me + 2 * k;
      opt.step(loss_of(model, x.slice(0, at, at + 2), y.slice(0, at, at + 2)));
      if (k == 0) CHECK(flat_parameters(local) == unchanged);  // the first micro-batch updates nothing
    }
    CHECK(model.all_reduce_count() - before == (n > 1 ? 1 : 0));
  }
  std::vector<double> got = flat_parameters(local), want = flat_parameters(reference);
  for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-12).margin(1e-14));
  CHECK(opt.state().at("0.0.momentum_buffer").defined());
  CHECK_THROWS_WITH(model.accumulate(0), Catch::Contains("positive"));
}

TEST_CASE("gradients travel in buckets of KILN_BUCKET_MB, the first one capped at 1 MiB", "[distributed]") {
  dist::init();
  FlagsGuard guard;
  nn::Sequential net;
  for (int i = 0; i < 6; ++i) net.push_back(nn::Linear(256, 256));  // 6 x (256 KiB + 1 KiB)
  dist::DataParallel model(net);
  flags().bucket_mb = 25;
  // Reverse registration order; the first bucket stops at 1 MiB (3 weights + 4 biases fit).
  dist::BucketPlan plan = model.bucket_plan();
  REQUIRE(plan.buckets.size() == 2);
  CHECK(plan.buckets[0].front() == 11);  // the last bias comes first
  CHECK(plan.buckets[0].size() + plan.buckets[1].size() == 12);
  flags().bucket_mb = 0.5;  // 512 KiB: a weight (256 KiB) and the biases around it, never two weights
  plan = model.bucket_plan();
  const std::vector<Tensor> params = model.parameters();
  const double grad_bytes = 6 * (256.0 * 256 + 256) * 4;
  CHECK(static_cast<double>(plan.buckets.size()) >= std::ceil(grad_bytes / (0.5 * 1048576)));
  for (const auto& b : plan.buckets) {
    int64_t bytes = 0;
    for (size_t k : b) bytes += params[k].numel() * 4;
    CHECK(bytes <= 512 * 1024);
  }
  flags().bucket_mb = 0.0001;  // one tensor per bucket (Jittor's way)
  CHECK(model.bucket_plan().buckets.size() == 12);
  // Tensors small against the bucket: ceil(gradient bytes / bucket) buckets.
  nn::Sequential deep;
  for (int i = 0; i < 48; ++i) deep.push_back(nn::Linear(64, 64));
  dist::DataParallel deep_model(deep);
  flags().bucket_mb = 0.25;
  CHECK(deep_model.bucket_plan().buckets.size() == static_cast<size_t>(std::ceil(48 * (64.0 * 64 + 64) * 4 / (0.25 * 1048576))));
}

TEST_CASE("NoSyncGuard keeps each rank's own gradients", "[distributed][train]") {
  dist::init();
  const int n = dist::world_size(), me = dist::rank();
  Mlp local(5);
  dist::DataParallel model(local);
  optim::SGD opt(model.parameters(), optim::SGDOptions(0.1));
  auto [x, y] = global_batch(3, n);
  const int64_t before = model.all_reduce_count();
  {
    dist::NoSyncGuard no_sync(model);
    opt.step(loss_of(model, x.slice(0, 4 * me, 4 * me + 4), y.slice(0, 4 * me, 4 * me + 4)));
  }
  CHECK(model.all_reduce_count() == before);
  // Rank 0's and the last rank's parameters now differ (their shards do).
  Tensor w = dist::all_gather(local.w1.reshape({1, 40}));
  std::vector<double> all = w.to_doubles();
  if (n > 1) CHECK(std::vector<double>(all.begin(), all.begin() + 40) != std::vector<double>(all.end() - 40, all.end()));
}

TEST_CASE("ranks that all-reduce different steps together fail after the step and name both counts", "[distributed][train]") {
  dist::init();
  const int n = dist::world_size(), me = dist::rank();
  if (n == 1) return;
  Mlp local(6);
  dist::DataParallel model(local);
  optim::SGD opt(model.parameters(), optim::SGDOptions(0.1));
  auto step = [&](int k) {
    auto [x, y] = global_batch(k, n);
    opt.step(loss_of(model, x.slice(0, 4 * me, 4 * me + 4), y.slice(0, 4 * me, 4 * me + 4)));
  };
  step(0);  // every rank syncs: counts agree
  // The last rank keeps its second pass local, so its third pass's all-reduce meets the others'
  // second: same bucket sizes, so MPI sees nothing wrong, but the counts in the first bucket differ.
  if (me == n - 1) {
    {
      dist::NoSyncGuard no_sync(model);
      step(1);
    }
    CHECK_THROWS_WITH(step(2), Catch::Contains("different steps") && Catch::Contains("rank 0 was at backward pass 2") &&
                                   Catch::Contains(fmt::format("rank {} at pass 3", n - 1)));
  } else {
    CHECK_THROWS_WITH(step(1), Catch::Contains("different steps") && Catch::Contains("rank 0 was at backward pass 2") &&
                                   Catch::Contains(fmt::format("rank {} at pass 3", n - 1)));
  }
  CHECK(model.all_reduce_count() == 2 * static_cast<int64_t>(model.bucket_plan().buckets.size()));
}

TEST_CASE("DataParallel names a parameter that differs between ranks", "[distributed]") {
  dist::init();
  if (dist::world_size() == 1) return;
  struct Odd : nn::Module {
    Odd() : nn::Module("Odd") {
      register_parameter("shared", zeros({3}));
      register_parameter("w", zeros({dist::rank() == 0 ? 4 : 5}));
    }
    Tensor forward(const Tensor& x) override { return x; }
  };
  CHECK_THROWS_WITH(dist::DataParallel(Odd()), Catch::Contains("parameter 'w'") && Catch::Contains("differs"));
}

TEST_CASE("a data parallel step overlaps its all-reduces with the rest of the backward", "[distributed][train]") {
  dist::init();
  if (dist::world_size() == 1 || !flags().lazy) return;  // eager mode runs each op, and all-reduce, at once
  FlagsGuard guard;
  flags().bucket_mb = 0.0001;  // one bucket per tensor: the last layer's starts long before the first's backward
  const int me = dist::rank();
  Mlp local(11);
  dist::DataParallel model(local);
  optim::SGD opt(model.parameters(), optim::SGDOptions(0.05).momentum(0.9));
  auto [x, y] = global_batch(0, dist::world_size());
  Tensor xs = x.slice(0, 4 * me, 4 * me + 4), ys = y.slice(0, 4 * me, 4 * me + 4);
  opt.step(loss_of(model, xs, ys));  // the first step also makes the momentum buffers
  const jit::JitStats before = jit::stats();
  opt.step(loss_of(model, xs, ys));
  const jit::JitStats after = jit::stats();
  CHECK(after.collectives_started - before.collectives_started == 4);  // in the step's one plan
  CHECK(after.plans_built + after.plan_cache_hits - before.plans_built - before.plan_cache_hits == 1);
  // The earlier layers' backward kernels ran while the last layers' gradients travelled.
  CHECK(after.kernels_during_collectives - before.kernels_during_collectives >= 3);
}

TEST_CASE("data parallel on a CUDA device equals one process on the whole batch", "[distributed][device]") {
  if (!cuda::available()) {
    WARN("SKIPPED: no CUDA device (KILN_CUDA_EMULATOR=1 emulates one)");
    return;
  }
  dist::init();
  const int n = dist::world_size(), me = dist::rank();
  const Device gpu = Device::cuda(0);
  Mlp reference(21), local(21 + static_cast<uint64_t>(me));
  reference.to(gpu);
  local.to(gpu);
  dist::DataParallel model(local);
  optim::SGD ref_opt(reference.parameters(), optim::SGDOptions(0.05).momentum(0.9));
  optim::SGD opt(model.parameters(), optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < 5; ++step) {
    auto [x, y] = global_batch(step, n);
    Tensor xg = x.to(gpu), yg = y.to(gpu);
    ref_opt.step(loss_of(reference, xg, yg));
    opt.step(loss_of(model, xg.slice(0, 4 * me, 4 * me + 4), yg.slice(0, 4 * me, 4 * me + 4)));
  }
  std::vector<double> got = flat_parameters(local), want = flat_parameters(reference);
  for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-12).margin(1e-14));
}
