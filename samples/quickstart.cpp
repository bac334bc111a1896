// quickstart: fits a 2-layer MLP (16 -> 64 -> 1, tanh) to y = sin(x . w) with plain SGD written
// in kiln ops. Each step records forward, backward and update lazily, and kiln::sync runs the
// whole step as one plan; from the second step on the plan cache replays it.
//
// Build and run (from the repository root):
//   cmake -S . -B build && cmake --build build -j
//   ./build/samples/quickstart                   # defaults: --steps 300 --lr 0.1
//   ./build/samples/quickstart --steps 1000 --lr 0.05
//   KILN_LOG=1 ./build/samples/quickstart --steps 3   # see the schedule and cache hits
//
// Legend: N = samples, D = input features, H = hidden units.
#include <kiln/kiln.h>

#include "samples/command_line.h"

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <fmt/format.h>
#include <vector>

namespace {

constexpr int64_t N = 256, D = 16, H = 64;

struct Mlp {
  kiln::Tensor w1, b1, w2, b2;  // (D, H), (H), (H, 1), (1)

  std::vector<kiln::Tensor> parameters() const { return {w1, b1, w2, b2}; }

  kiln::Tensor forward(const kiln::Tensor& x) const {  // x (N, D) -> (N, 1)
    kiln::Tensor hidden = kiln::tanh(kiln::matmul(x, w1) + b1);  // (N, H)
    return kiln::matmul(hidden, w2) + b2;
  }
};

// A realized tensor of `shape`, normal with standard deviation `stddev`, marked as a parameter.
kiln::Tensor parameter(kiln::Shape shape, double stddev) {
  kiln::Tensor p = stddev == 0 ? kiln::zeros(std::move(shape)) : kiln::randn(std::move(shape)) * stddev;
  p.realize();
  p.requires_grad_();
  return p;
}

// Records one SGD step (forward, backward, p <- p - lr * grad for every parameter) and returns
// the loss of the parameters before the update. Nothing runs here.
kiln::Tensor record_sgd_step(Mlp& model, const kiln::Tensor& x, const kiln::Tensor& y, double lr) {
  kiln::Tensor loss = kiln::mse_loss(model.forward(x), y);
  std::vector<kiln::Tensor> params = model.parameters();
  std::vector<kiln::Tensor> grads = kiln::grad(loss, params);
  kiln::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) params[i].assign(params[i] - lr * grads[i]);
  return loss;  // `grads` dies here, so the plan keeps no gradient buffer it does not need
}

}  // namespace

// Data, model and `steps` SGD steps, each forward + backward + update as one plan.
static void train(int steps, double lr, int print_every) {
  kiln::manual_seed(42);
  // Data: y = sin(x . w / sqrt(D)), so the argument of sin has unit variance.
  kiln::Tensor x = kiln::randn({N, D});                                            // (N, D)
  kiln::Tensor y = kiln::sin(kiln::matmul(x, kiln::randn({D, 1})) / std::sqrt(double(D)));  // (N, 1)
  kiln::sync({x, y});

  Mlp model{parameter({D, H}, 1.0 / std::sqrt(double(D))), parameter({H}, 0.0),
            parameter({H, 1}, 1.0 / std::sqrt(double(H))), parameter({1}, 0.0)};

  auto start = std::chrono::steady_clock::now();
  double first_loss = 0, last_loss = 0;
  for (int step = 1; step <= steps; ++step) {
    kiln::Tensor loss = record_sgd_step(model, x, y, lr);
    std::vector<kiln::Tensor> to_run = model.parameters();
    to_run.push_back(loss);
    kiln::sync(to_run);  // forward + backward + update: one plan
    last_loss = loss.item();
    if (step == 1) first_loss = last_loss;
    if (step == 1 || step % print_every == 0 || step == steps) fmt::print("step {:5d}  loss {:.6f}\n", step, last_loss);
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  const kiln::jit::JitStats& s = kiln::jit::stats();
  fmt::print("\ntrained {} steps in {:.2f} s ({:.1f} us/step); loss {:.4f} -> {:.4f}\n", steps, seconds,
             seconds * 1e6 / steps, first_loss, last_loss);
  fmt::print("jit: {} kernels compiled ({} modules, {:.2f} s compiling), {} kernels run\n", s.kernels_compiled,
             s.modules_compiled, s.compile_seconds, s.kernels_run);
  fmt::print("     plans built {}, plan cache hits {}, disk cache hits {}, memory cache hits {}\n", s.plans_built,
             s.plan_cache_hits, s.disk_cache_hits, s.memory_cache_hits);
  fmt::print("     kernel cache dir: {}\n", kiln::jit::cache_directory());
}

int main(int argc, char** argv) {
  int steps = 300;
  double lr = 0.1;
  int print_every = 25;
  CLI::App app{"kiln quickstart: a 2-layer MLP trained with SGD, one plan per step"};
  kiln::samples::CommandLine cli(app);
  cli.at_least("--steps", steps, 1, "training steps");
  cli.positive("--lr", lr, "SGD learning rate");
  cli.at_least("--print-every", print_every, 1, "print the loss every this many steps");
  if (std::optional<int> exit_code = cli.parse(argc, argv)) return *exit_code;
  try {
    train(steps, lr, print_every);
  } catch (const std::exception& e) {  // kiln::Error (a bad flag value, no memory) and the rest: a message
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}

