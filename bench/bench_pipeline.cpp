// Pipeline parallel under mpirun (one stage per rank): a deep MLP of equal layers (default 16
// Linear layers of 512 with ReLU), cut into stages of equal parameter count, trained with SGD
// momentum on random data, GPipe then 1F1B in the same run. Prints, on the last rank, for each
// schedule: the median step time, the measured bubble (each stage's time blocked waiting for a
// message from another stage over its step time, median over steps, mean over stages) next to
// the theory (p - 1) / (m + p - 1), and each stage's parameter and step-arena bytes next to one
// process training the whole model on the whole batch (measured on every rank, same run).
//
//   mpirun -np 2 ./build/bench/bench_pipeline [--micro-batches 8] [--layers 16 --width 512 --batch 256]
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

nn::Sequential deep_mlp(int layers, int width) {
  manual_seed(1);
  nn::Sequential net;
  for (int i = 0; i < layers; ++i) {
    net.push_back(nn::Linear(width, width));
    net.push_back(nn::ReLU());
  }
  return net;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kiln pipeline parallel: bubble, memory and step time"};
  int layers = 16, width = 512, batch = 256, micro_batches = 8, steps = 20, warmup = 3;
  app.add_option("--layers", layers, "Linear layers (each followed by a ReLU)");
  app.add_option("--width", width, "features of every layer");
  app.add_option("--batch", batch, "examples per step (every stage sees the same batch)");
  app.add_option("--micro-batches", micro_batches, "micro-batches per step");
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--warmup", warmup, "untimed steps first (compilation)");
  CLI11_PARSE(app, argc, argv);
  try {
    dist::init();
    manual_seed(7);
    Tensor x = randn({batch, width}).realize(), y = randn({batch, width}).realize();
    auto mse = [](const Tensor& out, const Tensor& target) { return nn::mse_loss(out, target); };

    // One process, the whole model and batch: the memory baseline.
    nn::Sequential whole = deep_mlp(layers, width);
    optim::SGD whole_opt(whole.parameters(), optim::SGDOptions(0.01).momentum(0.9));
    for (int s = 0; s < 2; ++s) whole_opt.step(nn::mse_loss(whole.forward(x), y));
    const int64_t whole_arena = memory::last_plan()->arena_bytes;
    const int64_t whole_params = parameter_bytes(whole.parameters());

    for (auto schedule : {dist::PipelineSchedule::GPipe, dist::PipelineSchedule::OneFOneB}) {
      dist::Pipeline pipe(deep_mlp(layers, width), dist::PipelineOptions().micro_batches(micro_batches).schedule(schedule));
      optim::SGD opt(pipe.parameters(), optim::SGDOptions(0.01).momentum(0.9));
      std::vector<double> times, bubbles;
      for (int s = 0; s < warmup + steps; ++s) {
        if (s == warmup) dist::barrier();
        pipe.train_step(opt, x, y, mse);
        if (s < warmup) continue;
        times.push_back(pipe.last_step().step_seconds * 1e3);
        bubbles.push_back(pipe.last_step().recv_wait_seconds / pipe.last_step().step_seconds);
      }
      Tensor mine = from_vector<double>({median(times), median(bubbles), static_cast<double>(parameter_bytes(pipe.parameters())),
                                         static_cast<double>(pipe.last_step().arena_bytes),
                                         static_cast<double>(pipe.last_step().peak_live_micro_batches)},
                                        {1, 5});
      std::vector<double> all = dist::all_gather(mine).to_doubles();
      if (!pipe.is_last()) continue;
    const char* name = schedule == dist::PipelineSchedule::GPipe ? "GPipe" : "1F1B";
      double bubble = 0, step = 0;
      for (int64_t s = 0; s < pipe.stages(); ++s) {
        bubble += all[static_cast<size_t>(5 * s + 1)] / static_cast<double>(pipe.stages());
        step = std::max(step, all[static_cast<size_t>(5 * s)]);
      }
      fmt::print("{} p {} m {} layers {} width {} batch {}: step {:.2f} ms (median of {}), bubble measured {:.1f}% theory "
                 "{:.1f}%\n",
                 name, pipe.stages(), micro_batches, layers, width, batch, step, steps, 100 * bubble,
                 100 * pipe.theoretical_bubble());
      for (int64_t s = 0; s < pipe.stages(); ++s) {
        const double* r = &all[static_cast<size_t>(5 * s)];
        const double whole = static_cast<double>(whole_params + whole_arena);
        // The stage's arena holds the gradient sums over the micro-batches (as many bytes as its
        // parameters) until the flush; one process on the whole batch never holds all its weight
        // gradients at once (each update consumes its gradient as the backward makes it).
        fmt::print("  stage {}: waiting {:.1f}% of the step, live micro-batches {}, parameters {} + step arena {} = "
                   "{:.2f}x one process ({} + {}); without the gradient sums {:.2f}x\n",
                   s, 100 * r[1], static_cast<int64_t>(r[4]), memory::format_bytes(static_cast<int64_t>(r[2])),
                   memory::format_bytes(static_cast<int64_t>(r[3])), (r[2] + r[3]) / whole,
                   memory::format_bytes(whole_params), memory::format_bytes(whole_arena), r[3] / whole);
      }
    }
  } catch (const Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
