// Tensor parallel under mpirun: an MLP of (column-parallel, ReLU, row-parallel, ReLU) pairs
// (default: the train_mnist MLP's shape, 784 -> 512 -> 512, then a replicated 512 -> 10), trained
// with SGD momentum on random data. Prints, on rank 0: the median step time next to one process
// training the dense model (same run, every rank), the all-reduces per step counted from the
// plan, and each rank's parameter + step-arena bytes as a fraction of the dense model's.
//
//   KILN_NUM_THREADS=1 mpirun -np 2 ./build/bench/bench_tensor_parallel [--pairs 1 --in 784 --width 512 --batch 128]
#include <kiln/kiln.h>

#include "bench/bench_util.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>

using namespace kiln;
using kiln::bench::median;
using kiln::bench::parameter_bytes;
namespace dist = kiln::distributed;

namespace {

struct Dims {
  int pairs = 1, in = 784, width = 512, out = 10;
};

// The dense model and its tensor-parallel twin share names and draws: the same seed gives the
// same full weights.
template <typename Column, typename Row>
nn::Sequential mlp(const Dims& d, Column column, Row row) {
  manual_seed(1);
  nn::Sequential net;
  for (int i = 0; i < d.pairs; ++i) {
    net.push_back(column(i == 0 ? d.in : d.width, d.width));
    net.push_back(nn::ReLU());
    net.push_back(row(d.width, d.width));
    net.push_back(nn::ReLU());
  }
  net.push_back(nn::Linear(d.width, d.out));
  return net;
}

struct Run {
  double step_ms = 0;
  int64_t arena = 0, params = 0, collectives = 0;
};

Run train(nn::Sequential net, const Tensor& x, const Tensor& y, int warmup, int steps) {
  optim::SGD opt(net.parameters(), optim::SGDOptions(0.01).momentum(0.9));
  std::vector<double> times;
  Run run;
  for (int s = 0; s < warmup + steps; ++s) {
    if (s == warmup) dist::barrier();
    const int64_t started = jit::stats().collectives_started;
    auto t0 = std::chrono::steady_clock::now();
    Tensor loss = nn::cross_entropy(net.forward(x), y);
    opt.step(loss);
    loss.item();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    run.collectives = jit::stats().collectives_started - started;
  }
  times.erase(times.begin(), times.begin() + warmup);
  run.step_ms = median(times);
  run.arena = memory::last_plan()->arena_bytes;
  run.params = parameter_bytes(net.parameters());
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kiln tensor parallel: memory per rank, all-reduces and step time against the dense model"};
  Dims d;
  int batch = 128, steps = 30, warmup = 3;
  app.add_option("--pairs", d.pairs, "(column-parallel, row-parallel) pairs of Linear layers");
  app.add_option("--in", d.in, "input features");
  app.add_option("--width", d.width, "features of the hidden layers");
  app.add_option("--batch", batch, "examples per step (every rank sees the same batch)");
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--warmup", warmup, "untimed steps first (compilation)");
  CLI11_PARSE(app, argc, argv);
  try {
    dist::init();
    manual_seed(7);
    Tensor x = randn({batch, d.in}).realize();
    Tensor y = cast(floor(rand({batch}) * static_cast<double>(d.out)), DType::Int64).realize();
    auto linear = [](int64_t in, int64_t out) { return nn::Linear(in, out); };
    const Run dense = train(mlp(d, linear, linear), x, y, warmup, steps);
    const Run parallel = train(
        mlp(
            d, [](int64_t in, int64_t out) { return dist::ColumnParallelLinear(in, out); },
            [](int64_t in, int64_t out) { return dist::RowParallelLinear(in, out); }),
        x, y, warmup, steps);
    Tensor mine = from_vector<double>({parallel.step_ms, static_cast<double>(parallel.params),
                                       static_cast<double>(parallel.arena), dense.step_ms},
                                      {1, 4});
    std::vector<double> all = dist::all_gather(mine).to_doubles();
    if (dist::rank() != 0) return 0;
    double step = 0, dense_step = 0;
    for (int r = 0; r < dist::world_size(); ++r) {
      step = std::max(step, all[static_cast<size_t>(4 * r)]);
      dense_step = std::max(dense_step, all[static_cast<size_t>(4 * r + 3)]);
    }
    fmt::print("tensor parallel over {} ranks, {} pair(s) {} -> {} -> {}, batch {}: step {:.2f} ms, dense model in one "
               "process {:.2f} ms ({:.2f}x); {} all-reduces per step (forward + backward)\n",
               dist::world_size(), d.pairs, d.in, d.width, d.width, batch, step, dense_step, dense_step / step,
               parallel.collectives);
    for (int r = 0; r < dist::world_size(); ++r) {
      const double* v = &all[static_cast<size_t>(4 * r)];
      fmt::print("  rank {}: parameters {} + step arena {} = {:.2f}x one process ({} + {})\n", r,
                 memory::format_bytes(static_cast<int64_t>(v[1])), memory::format_bytes(static_cast<int64_t>(v[2])),
                 (v[1] + v[2]) / static_cast<double>(dense.params + dense.arena), memory::format_bytes(dense.params),
                 memory::format_bytes(dense.arena));
    }
  } catch (const Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
