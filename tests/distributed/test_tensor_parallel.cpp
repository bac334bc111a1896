// Tensor parallel in any world (1 process under plain ctest; 2 and 3 ranks in the mpi.* entries):
// the column/row-parallel MLP computes what the dense one does, forward, backward and through
// training, with exactly one all-reduce each way; split/gather pass gradient checks.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include "backends/cuda/cuda_runtime.h"

#include "tests/support/gradcheck.h"

using namespace kiln;
namespace dist = kiln::distributed;

namespace {

// Widths divide by 1, 2 and 3 ranks.
constexpr int64_t kIn = 4, kHidden = 6, kOut = 5;

nn::LinearOptions f64(int64_t in, int64_t out) { return nn::LinearOptions(in, out).dtype(DType::Float64); }

// This rank's block [r * n / world, (r + 1) * n / world) of `t` along `axis`, as doubles.
std::vector<double> block(const Tensor& t, int64_t axis) {
  const int64_t n = t.size(axis) / dist::world_size(), r = dist::rank();
  return t.slice(axis, r * n, (r + 1) * n).to_doubles();
}

void check_close(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
  INFO(what << " on rank " << dist::rank());
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-12).margin(1e-14));
}

struct DenseMlp : nn::Module {
  DenseMlp() : Module("DenseMlp") {}
  nn::Linear fc1 = register_module("fc1", nn::Linear(f64(kIn, kHidden)));
  nn::Linear fc2 = register_module("fc2", nn::Linear(f64(kHidden, kOut)));
  Tensor forward(const Tensor& x) override { return fc2.forward(tanh(fc1.forward(x))); }
};

struct ParallelMlp : nn::Module {
  ParallelMlp() : Module("ParallelMlp") {}
  dist::ColumnParallelLinear fc1 = register_module("fc1", dist::ColumnParallelLinear(f64(kIn, kHidden), false));
  dist::RowParallelLinear fc2 = register_module("fc2", dist::RowParallelLinear(f64(kHidden, kOut), true));
  Tensor forward(const Tensor& x) override { return fc2.forward(tanh(fc1.forward(x))); }
};

Tensor input(uint64_t seed) {
  manual_seed(seed);
  return randn({3, kIn}, DType::Float64).realize();
}

// The output, the input's gradient and every parameter's (this rank's block of the dense one's)
// for one input on `device`, the loss sum(y^2) the same on every rank.
void check_against_dense(DenseMlp& dense, ParallelMlp& parallel) {
  const Device device = dense.fc1.weight.device();  // KILN_USE_CUDA=1 makes the models on cuda:0
  Tensor x1 = input(5).to(device).requires_grad_(), x2 = input(5).to(device).requires_grad_();
  Tensor want = dense.forward(x1), got = parallel.forward(x2);
  check_close(got.to_doubles(), want.to_doubles(), "output");
  (want * want).sum().backward();
  (got * got).sum().backward();
  check_close(x2.grad().to_doubles(), x1.grad().to_doubles(), "input gradient");
  check_close(parallel.fc1.weight.grad().to_doubles(), block(dense.fc1.weight.grad(), 0), "fc1.weight gradient");
  check_close(parallel.fc1.bias.grad().to_doubles(), block(dense.fc1.bias.grad(), 0), "fc1.bias gradient");
  check_close(parallel.fc2.weight.grad().to_doubles(), block(dense.fc2.weight.grad(), 1), "fc2.weight gradient");
  check_close(parallel.fc2.bias.grad().to_doubles(), dense.fc2.bias.grad().to_doubles(), "fc2.bias gradient");
}

}  // namespace

TEST_CASE("a tensor-parallel MLP computes the dense MLP's output and gradients", "[tensor_parallel][distributed]") {
  dist::init();
  manual_seed(21);
  DenseMlp dense;
  manual_seed(21);
  ParallelMlp parallel;  // the same draws: the dense weights, each rank keeping its block
  CHECK(parallel.fc1.weight.shape() == Shape{kHidden / dist::world_size(), kIn});
  CHECK(parallel.fc2.weight.shape() == Shape{kOut, kHidden / dist::world_size()});
  check_close(parallel.fc1.weight.to_doubles(), block(dense.fc1.weight, 0), "fc1.weight");
  check_close(parallel.fc2.weight.to_doubles(), block(dense.fc2.weight, 1), "fc2.weight");

  check_against_dense(dense, parallel);
}

TEST_CASE("a tensor-parallel MLP trains like the dense one for 10 steps", "[tensor_parallel][distributed]") {
  dist::init();
  manual_seed(8);
  DenseMlp dense;
  manual_seed(8);
  ParallelMlp parallel;
  optim::SGD reference(dense.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  optim::SGD opt(parallel.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 10; ++step) {
    Tensor x = input(100 + static_cast<uint64_t>(step));
    manual_seed(200 + static_cast<uint64_t>(step));
    Tensor y = randn({3, kOut}, DType::Float64).realize();
    Tensor want = mse_loss(dense.forward(x), y), got = mse_loss(parallel.forward(x), y);
    reference.step(want);
    opt.step(got);
    CHECK(got.item() == Approx(want.item()).epsilon(1e-12));
  }
  check_close(parallel.fc1.weight.to_doubles(), block(dense.fc1.weight, 0), "fc1.weight");
  check_close(parallel.fc1.bias.to_doubles(), block(dense.fc1.bias, 0), "fc1.bias");
  check_close(parallel.fc2.weight.to_doubles(), block(dense.fc2.weight, 1), "fc2.weight");
  check_close(parallel.fc2.bias.to_doubles(), dense.fc2.bias.to_doubles(), "fc2.bias");
}

TEST_CASE("a tensor-parallel MLP runs one all-reduce in its forward and one in its backward",
          "[tensor_parallel][distributed]") {
  dist::init();
  if (dist::world_size() == 1 || !flags().lazy) return;  // no collectives in a world of 1; eager runs them at once
  manual_seed(4);
  ParallelMlp parallel;
  Tensor x = input(6).requires_grad_();
  for (int round = 0; round < 2; ++round) {  // the second round replays cached plans
    const jit::JitStats start = jit::stats();
    Tensor out = parallel.forward(x);
    Tensor loss = (out * out).sum();
    loss.realize();
    const jit::JitStats forward = jit::stats();
    CHECK(forward.collectives_started - start.collectives_started == 1);
    auto grads = grad(loss, {x, parallel.fc1.weight, parallel.fc2.weight});
    for (Tensor& g : grads) g.realize();
    CHECK(jit::stats().collectives_started - forward.collectives_started == 1);
  }
}

TEST_CASE("split and gather pass gradient checks in float64", "[tensor_parallel][distributed]") {
  dist::init();
  // x is the same on every rank (a replicated value): split hands each rank a block, gather
  // puts the ranks' blocks back together, and the loss is the same on every rank.
  auto split_rows = [](const std::vector<Tensor>& in) {
    Tensor block = tanh(dist::split(in[0], 0)) * dist::split(in[1], 0);
    return sin(dist::gather(block, 0)) * in[0];
  };
  CHECK_GRADIENTS(split_rows, {testing::uniform({6, 2}, -1, 1, 1), testing::uniform({6, 2}, -1, 1, 2)});
  auto split_columns = [](const std::vector<Tensor>& in) {
    Tensor block = exp(dist::split(in[0], -1));
    return dist::gather(block * block, 1).sum(std::vector<int64_t>{0});
  };
  CHECK_GRADIENTS(split_columns, {testing::uniform({2, 6}, -1, 1, 3)});
  // A gathered value split again (a row-parallel layer's input split), gathered for the loss.
  auto round_trip = [](const std::vector<Tensor>& in) {
    Tensor again = dist::split(dist::gather(dist::split(in[0], 1) * 3.0, 1), 1);
    return dist::gather(again * dist::split(in[0], 1), 1);
  };
  CHECK_GRADIENTS(round_trip, {testing::uniform({3, 6}, -1, 1, 4)});
}

TEST_CASE("tensor parallel rejects widths the world does not divide, naming them", "[tensor_parallel][distributed]") {
  dist::init();
  const int64_t w = dist::world_size();
  CHECK_THROWS_WITH(dist::split(zeros({2, 3}, DType::Float64), 3), Catch::Contains("dim 3 is out of range"));
  CHECK_THROWS_WITH(dist::ColumnParallelLinear(4, 6)
                        .forward(zeros({2, 5})),
                    Catch::Contains("does not end in in_features=4"));
  CHECK_THROWS_WITH(dist::split(zeros({4, 2}, DType::Int64), 0), Catch::Contains("floating-point"));
  if (w == 1) return;
  CHECK_THROWS_WITH(dist::ColumnParallelLinear(4, 2 * w + 1),
                    Catch::Contains(fmt::format("out_features = {} does not divide by the world of {} ranks", 2 * w + 1, w)));
  CHECK_THROWS_WITH(dist::RowParallelLinear(2 * w + 1, 4),
                    Catch::Contains(fmt::format("in_features = {} does not divide by the world of {} ranks", 2 * w + 1, w)));
  CHECK_THROWS_WITH(dist::split(zeros({2 * w + 1, 2}), 0), Catch::Contains("do not divide by the world"));
  CHECK_THROWS_WITH(dist::RowParallelLinear(2 * w, 4).forward(zeros({3, 2 * w})),
                    Catch::Contains(fmt::format("does not end in 2 (this rank's block of in_features={}", 2 * w)));
}

TEST_CASE("a tensor-parallel layer pair over a group equals the dense layers on its members",
          "[tensor_parallel][distributed]") {
  dist::init();
  const int n = dist::world_size();
  // The first two ranks (or the only one) split the layers; a third rank, if any, stays out.
  dist::Group pair = dist::new_group(n == 1 ? std::vector<int>{0} : std::vector<int>{0, 1});
  if (!pair.contains_me()) {
    CHECK_THROWS_WITH(dist::ColumnParallelLinear(f64(kIn, kHidden), false, pair), Catch::Contains("not a member"));
    return;
  }
  manual_seed(31);
  nn::Linear fc1(f64(kIn, kHidden)), fc2(f64(kHidden, kOut));
  manual_seed(31);
  dist::ColumnParallelLinear col(f64(kIn, kHidden), false, pair);
  dist::RowParallelLinear row(f64(kHidden, kOut), true, pair);
  Tensor x1 = input(9).requires_grad_(), x2 = input(9).requires_grad_();
  Tensor want = fc2.forward(tanh(fc1.forward(x1))), got = row.forward(tanh(col.forward(x2)));
  check_close(got.to_doubles(), want.to_doubles(), "output");
  (want * want).sum().backward();
  (got * got).sum().backward();
  check_close(x2.grad().to_doubles(), x1.grad().to_doubles(), "input gradient");
  const int64_t h = kHidden / pair.size(), r = pair.rank();
  check_close(col.weight.grad().to_doubles(), fc1.weight.grad().slice(0, r * h, (r + 1) * h).to_doubles(), "fc1.weight gradient");
  check_close(row.weight.grad().to_doubles(), fc2.weight.grad().slice(1, r * h, (r + 1) * h).to_doubles(), "fc2.weight gradient");
}

TEST_CASE("a tensor-parallel MLP on a CUDA device computes the dense MLP's output and gradients",
          "[tensor_parallel][distributed][device]") {
  if (!cuda::available()) {
    WARN("SKIPPED: no CUDA device (KILN_CUDA_EMULATOR=1 emulates one)");
    return;
  }
  dist::init();
  const Device gpu = Device::cuda(0);
  manual_seed(41);
  DenseMlp dense;
  manual_seed(41);
  ParallelMlp parallel;
  dense.to(gpu);
  parallel.to(gpu);
  check_against_dense(dense, parallel);
}
