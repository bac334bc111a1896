// bench_scaling: the training step of an MLP 784-W-W-10 (ReLU, cross-entropy, SGD momentum 0.9:
// one plan) over a sweep of batch sizes or widths, on random Fashion-MNIST-shaped batches. Prints
// one CSV row per configuration: the median step time, so the sweep shows where kiln's fixed cost
// per step ends and the matrix products take over. bench/scaling.py runs it beside PyTorch's
// (bench/pytorch_scaling.py) and plots both against the GEMM bound (docs/scaling.png).
//
//   ./build/bench/bench_scaling --batches 1,8,64,512 --width 512     # batch sweep
//   ./build/bench/bench_scaling --batch 128 --widths 256,1024,4096    # width sweep
#include <kiln/kiln.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <fmt/format.h>
#include <vector>

namespace nn = kiln::nn;
using kiln::Tensor;

namespace {

struct Mlp : nn::Module {
  explicit Mlp(int64_t width)
      : Module("Mlp"),
        fc1(register_module("fc1", nn::Linear(784, width))),
        fc2(register_module("fc2", nn::Linear(width, width))),
        fc3(register_module("fc3", nn::Linear(width, 10))) {}
  nn::Linear fc1, fc2, fc3;
  Tensor forward(const Tensor& x) { return fc3.forward(kiln::relu(fc2.forward(kiln::relu(fc1.forward(x))))); }
};

// Median milliseconds per step: 3 steps of warm-up (the first builds the plan), then steps until
// `seconds` have passed (at least 5, at most 500).
double step_ms(int64_t batch, int64_t width, double seconds) {
  kiln::manual_seed(0);
  Mlp model(width);
  kiln::optim::SGD opt(model.parameters(), kiln::optim::SGDOptions(0.01).momentum(0.9));
  Tensor x = kiln::rand({batch, 784}).realize();
  Tensor y = kiln::cast(kiln::floor(kiln::rand({batch}) * 10.0), kiln::DType::Int64).realize();
  auto step = [&] {
    Tensor loss = nn::cross_entropy(model.forward(x), y);
    opt.step(loss);
    loss.item();
  };
  for (int i = 0; i < 3; ++i) step();
  std::vector<double> ms;
  const auto start = std::chrono::steady_clock::now();
  while (ms.size() < 5 || (ms.size() < 500 && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds)) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return ms[ms.size() / 2];
}

// kiln's float32 matmul rate on (n, n) x (n, n), GFLOP/s: the median of `reps` products.
double gemm_gflops(int64_t n = 1024, int reps = 20) {
  Tensor a = kiln::rand({n, n}).realize(), b = kiln::rand({n, n}).realize();
  kiln::matmul(a, b).realize();
  std::vector<double> s;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    kiln::matmul(a, b).realize();
    s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(s.begin(), s.begin() + reps / 2, s.end());
  return 2.0 * static_cast<double>(n * n * n) / s[reps / 2] / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"MLP training step time over batch sizes or widths (CSV: framework,batch,width,step_ms)"};
  std::vector<int64_t> batches = {128}, widths = {512};
  double seconds = 1.0;
  app.add_option("--batches,--batch", batches, "batch sizes, comma-separated")->delimiter(',')->check(CLI::PositiveNumber);
  app.add_option("--widths,--width", widths, "hidden widths, comma-separated")->delimiter(',')->check(CLI::PositiveNumber);
  app.add_option("--seconds", seconds, "time measured per configuration")->check(CLI::PositiveNumber);
  bool gemm_rate = false;
  app.add_flag("--gemm-rate", gemm_rate, "print kiln's float32 matmul rate on 1024^3 (gemm,GFLOP/s) and stop");
  CLI11_PARSE(app, argc, argv);
  if (gemm_rate) {
    fmt::print("gemm,{:.1f}\n", gemm_gflops());
    return 0;
  }
  fmt::print("framework,batch,width,step_ms\n");
  for (int64_t width : widths)
    for (int64_t batch : batches) fmt::print("kiln,{},{},{:.4f}\n", batch, width, step_ms(batch, width, seconds));
  return 0;
}
