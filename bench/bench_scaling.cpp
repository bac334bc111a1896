// bench_scaling: the training step of an MLP 784-W-W-10 (ReLU, cross-entropy, SGD momentum 0.9:
// one plan) over a sweep of batch sizes or widths, on random Fashion-MNIST-shaped batches. Prints
// one CSV row per configuration: the median step time, so the sweep shows where kiln's fixed cost
// per step ends and the matrix products take over. bench/scaling.py runs it beside PyTorch's
// (bench/pytorch_scaling.py) and plots both against the GEMM bound (docs/scaling.png).
//
//   ./build/bench/bench_scaling --batches 1,8,64,512 --width 512     # batch sweep
//   ./build/bench/bench_scaling --batch 128 --widths 256,1024,4096    # width sweep
//   ./build/bench/bench_scaling --ratio                               # step / its products at the GEMM rate
//   ./build/bench/bench_scaling --amp-ratio                           # float32 step / bf16 (autocast) step
//
// --ratio alternates blocks of steps with the GEMM-rate measurement in one process and prints the
// median of the per-round ratios: on a shared host whose speed changes from one minute to the
// next, both sides of the ratio then see the same moments. --amp-ratio does the same with two
// models of the same weights, one trained in float32 and one under bfloat16 autocast (issue 19's
// "bf16 >= 2.5x float32").
#include <kiln/kiln.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <fmt/format.h>
#include <optional>
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

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// One model, optimizer and batch (seed the generator first); 3 steps of warm-up (the first
// builds the plan).
struct Training {
  // `amp`: the step's matmuls under autocast to that type (bfloat16), or float32 throughout.
  Training(int64_t batch, int64_t width, kiln::DType amp = kiln::DType::Float32, double lr = 0.01)
      : amp(amp),
        model(width),
        opt(model.parameters(), kiln::optim::SGDOptions(lr).momentum(0.9)),
        x(kiln::rand({batch, 784}).realize()),
        y(kiln::cast(kiln::floor(kiln::rand({batch}) * 10.0), kiln::DType::Int64).realize()) {
    for (int i = 0; i < 3; ++i) step();
  }
  // The step's loss, recorded (the forward under autocast where asked for).
  Tensor loss() {
    std::optional<kiln::AutocastGuard> autocast;
    if (amp != kiln::DType::Float32) autocast.emplace(amp);
    return nn::cross_entropy(model.forward(x), y);
  }
  void step() {
    if (replayed) {
      (*replayed)({x, y})[0].item();
      return;
    }
    Tensor l = loss();
    opt.step(l);
    l.item();
  }
  // Median milliseconds per step over steps until `seconds` have passed (at least 5, at most 500).
  double step_ms(double seconds) {
    std::vector<double> ms;
    const auto start = std::chrono::steady_clock::now();
    while (ms.size() < 5 ||
           (ms.size() < 500 && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds)) {
      const auto t0 = std::chrono::steady_clock::now();
      step();
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    return median(ms);
  }
  kiln::DType amp;
  Mlp model;
  kiln::optim::SGD opt;
  Tensor x, y;
  std::optional<kiln::optim::TrainStep> replayed;  // steps replayed, not recorded (--replay)
};

// The floating-point operations of the step's matrix products: three forward, three weight
// gradients, and the input gradients of the two upper layers.
double step_flops(int64_t batch, int64_t width) {
  const double B = static_cast<double>(batch), W = static_cast<double>(width);
  const double forward = 2.0 * B * (784.0 * W + W * W + W * 10.0);
  return 3.0 * forward - 2.0 * B * 784.0 * W;
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
  return 2.0 * static_cast<double>(n * n * n) / median(s) / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"MLP training step time over batch sizes or widths (CSV: framework,batch,width,step_ms; with\n"
                "--ratio also gemm_gflops,products_ms,ratio)"};
  std::vector<int64_t> batches = {128}, widths = {512};
  double seconds = 1.0;
  app.add_option("--batches,--batch", batches, "batch sizes, comma-separated")->delimiter(',')->check(CLI::PositiveNumber);
  app.add_option("--widths,--width", widths, "hidden widths, comma-separated")->delimiter(',')->check(CLI::PositiveNumber);
  app.add_option("--seconds", seconds, "time measured per configuration")->check(CLI::PositiveNumber);
  bool gemm_rate = false, ratio = false;
  int rounds = 7;
  app.add_flag("--gemm-rate", gemm_rate, "print kiln's float32 matmul rate on 1024^3 (gemm,GFLOP/s) and stop");
  app.add_flag("--ratio", ratio,
               "per configuration, alternate blocks of steps with the GEMM rate; print the median of the "
               "per-round ratios (the step's products at that rate) / (the step)");
  bool amp_ratio = false;
  app.add_flag("--amp-ratio", amp_ratio,
               "per configuration, alternate blocks of float32 steps and bfloat16-autocast steps of the same "
               "model; print both medians and the median of the per-round ratios float32 / bf16");
  app.add_option("--rounds", rounds, "rounds of --ratio or --amp-ratio")->check(CLI::PositiveNumber);
  bool replay = false;
  app.add_flag("--replay", replay,
               "--amp-ratio of steps captured once and replayed (jit::replay): nothing recorded per step");
  CLI11_PARSE(app, argc, argv);
  if (amp_ratio) {
    fmt::print("framework,batch,width,float32_ms,bf16_ms,ratio{}\n", replay ? ",replayed" : "");
    for (int64_t width : widths)
      for (int64_t batch : batches) {
        // lr 0: the same work every step (the updates still run). Trained on random labels, the
        // steps slowed as the weights drifted (bf16 1.5x, float32 1.2x after a few thousand
        // steps), and the blocks measured late would time that drift.
        kiln::manual_seed(0);
        Training full(batch, width, kiln::DType::Float32, 0.0);
        kiln::manual_seed(0);
        Training half(batch, width, kiln::DType::BFloat16, 0.0);
        for (Training* t : {&full, &half})
          if (replay) {
            t->replayed.emplace(t->opt, [t](const std::vector<Tensor>&) { return t->loss(); });
            for (int i = 0; i < 3; ++i) t->step();  // an eager step, the recorded one, a replay
            KILN_CHECK(t->replayed->replaying(), "bench_scaling", "--replay: {}", t->replayed->why_not_replayed());
          }
        std::vector<double> f32, bf16, ratios;
        for (int r = 0; r < rounds; ++r) {
          f32.push_back(full.step_ms(seconds / rounds / 2));
          bf16.push_back(half.step_ms(seconds / rounds / 2));
          ratios.push_back(f32.back() / bf16.back());
        }
        fmt::print("kiln,{},{},{:.4f},{:.4f},{:.3f}{}\n", batch, width, median(f32), median(bf16), median(ratios),
                   replay ? ",yes" : "");
      }
    return 0;
  }
  if (gemm_rate) {
    fmt::print("gemm,{:.1f}\n", gemm_gflops());
    return 0;
  }
  if (ratio) {
    fmt::print("framework,batch,width,step_ms,gemm_gflops,products_ms,ratio\n");
    for (int64_t width : widths)
      for (int64_t batch : batches) {
        kiln::manual_seed(0);
        Training training(batch, width);
        std::vector<double> steps, rates, ratios;
        for (int r = 0; r < rounds; ++r) {
          steps.push_back(training.step_ms(seconds / rounds));
          rates.push_back(gemm_gflops());
          ratios.push_back(step_flops(batch, width) / rates.back() / 1e6 / steps.back());
        }
        const double rate = median(rates);
        fmt::print("kiln,{},{},{:.4f},{:.1f},{:.4f},{:.3f}\n", batch, width, median(steps), rate,
                   step_flops(batch, width) / rate / 1e6, median(ratios));
      }
    return 0;
  }
  fmt::print("framework,batch,width,step_ms\n");
  for (int64_t width : widths)
    for (int64_t batch : batches) {
      kiln::manual_seed(0);
      Training training(batch, width);
      fmt::print("kiln,{},{},{:.4f}\n", batch, width, training.step_ms(seconds));
    }
  return 0;
}
