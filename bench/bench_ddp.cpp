// Data parallel step time under mpirun: a deep MLP (default 48 Linear layers of 256, ~100
// parameter tensors) trained with DataParallel and SGD momentum on random data, each rank its own
// batch. Prints, on rank 0, the median step time, the all-reduces per step, and how much of the
// all-reduce time the backward hid: 1 - (time blocked in waits) / (the same buckets all-reduced
// blocking, measured right after in the same run).
//
//   mpirun -np 2 ./build/bench/bench_ddp                          # buckets of KILN_BUCKET_MB (25)
//   KILN_BUCKET_MB=0.0001 mpirun -np 2 ./build/bench/bench_ddp     # one all-reduce per tensor
//   python3 bench/ddp_vs_pytorch.py                                # both, and PyTorch DDP (gloo)
#include <kiln/kiln.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>

using namespace kiln;
namespace dist = kiln::distributed;

int main(int argc, char** argv) {
  CLI::App app{"kiln DataParallel step time"};
  int layers = 48, width = 256, batch = 64, steps = 30, warmup = 5;
  app.add_option("--layers", layers, "Linear layers");
  app.add_option("--width", width, "features of every layer");
  app.add_option("--batch", batch, "examples per rank and step");
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--warmup", warmup, "untimed steps first (compilation, buffers)");
  CLI11_PARSE(app, argc, argv);
  try {
    dist::init();
    const bool lead = dist::rank() == 0;
    manual_seed(1);
    nn::Sequential net;
    for (int i = 0; i < layers; ++i) {
      net.push_back(nn::Linear(width, width));
      if (i + 1 < layers) net.push_back(nn::ReLU());
    }
    dist::DataParallel model(net);
    optim::SGD opt(model.parameters(), optim::SGDOptions(0.01).momentum(0.9));
    manual_seed(100 + static_cast<uint64_t>(dist::rank()));
    Tensor x = randn({batch, width}).realize(), y = randn({batch, width}).realize();
    std::vector<double> times;
    int64_t reduces = 0;
    jit::JitStats before{};
    for (int s = 0; s < warmup + steps; ++s) {
      if (s == warmup) {
        dist::barrier();
        before = jit::stats();
        reduces = model.all_reduce_count();
      }
      auto t0 = std::chrono::steady_clock::now();
      Tensor loss = nn::mse_loss(model.forward(x), y);
      opt.step(loss);
      (void)loss.item();
      if (s >= warmup) times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    const jit::JitStats after = jit::stats();
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    const double waited = (after.collective_wait_seconds - before.collective_wait_seconds) * 1e3 / steps;
    // The same buckets, all-reduced one after the other with nothing to hide behind.
    std::vector<Tensor> buckets;
    const std::vector<Tensor> params = model.parameters();
    for (const auto& b : model.bucket_plan().buckets) {
      int64_t n = 0;
      for (size_t k : b) n += params[k].numel();
      buckets.push_back(zeros({n}).realize());
    }
    std::vector<double> blocking;
    for (int s = 0; s < 10; ++s) {
      dist::barrier();
      auto t0 = std::chrono::steady_clock::now();
      for (const Tensor& b : buckets) dist::all_reduce(b).realize();
      blocking.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(blocking.begin(), blocking.end());
    const double alone = blocking[blocking.size() / 2];
    if (lead)
      fmt::print("ranks {} layers {} width {} batch {}/rank bucket_mb {}: step {:.3f} ms (median of {}), "
                 "all-reduces/step {}, blocked in waits {:.3f} ms/step, the same all-reduces alone {:.3f} ms, "
                 "hidden {:.0f}%\n",
                 dist::world_size(), layers, width, batch, flags().bucket_mb, median, steps,
                 static_cast<double>(model.all_reduce_count() - reduces) / steps, waited, alone,
                 alone > 0 ? 100.0 * std::max(0.0, 1.0 - waited / alone) : 0.0);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_ddp on rank {}: {}\n", dist::rank(), e.what());
    return 1;
  }
  return 0;
}
