// bench_cnn_step: one training step (forward, backward, SGD momentum update: one plan) of the
// train_mnist CNN (conv 32, pool, conv 64, pool, fc 128, fc 10) on random Fashion-MNIST-shaped
// batches. Prints the median ms per step and examples/s; KILN_LOG=2 lists every kernel's time.
// The PyTorch side of the same model is in bench/pytorch_mnist.py (bench/mnist_vs_pytorch.sh).
//
//   cmake -S . -B build-bench -DKILN_BUILD_TESTS=OFF && cmake --build build-bench -j2
//   ./build-bench/bench/bench_cnn_step [steps] [batch]     # default 30 steps of 128
//   KILN_LOG=2 ./build-bench/bench/bench_cnn_step 3        # per-kernel times
#include <kiln/kiln.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fmt/format.h>
#include <vector>

namespace nn = kiln::nn;
using kiln::Tensor;

struct Cnn : nn::Module {
  Cnn() : Module("Cnn") {}
  nn::Conv2d conv1 = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)));
  nn::Conv2d conv2 = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)));
  nn::Linear fc1 = register_module("fc1", nn::Linear(64 * 7 * 7, 128));
  nn::Linear fc2 = register_module("fc2", nn::Linear(128, 10));
  Tensor forward(const Tensor& x) {
    Tensor h = kiln::max_pool2d(kiln::relu(conv1.forward(x)), {2, 2});
    h = kiln::max_pool2d(kiln::relu(conv2.forward(h)), {2, 2});
    return fc2.forward(kiln::relu(fc1.forward(h.reshape({h.size(0), 64 * 7 * 7}))));
  }
};

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 30;
  const int64_t batch = argc > 2 ? std::atoll(argv[2]) : 128;
  kiln::manual_seed(0);
  Cnn model;
  kiln::optim::SGD opt(model.parameters(), kiln::optim::SGDOptions(0.05).momentum(0.9));
  Tensor x = kiln::rand({batch, 1, 28, 28}).realize();
  Tensor y = kiln::cast(kiln::floor(kiln::rand({batch}) * 10.0), kiln::DType::Int64).realize();
  std::vector<double> ms;
  for (int s = 0; s < steps + 2; ++s) {
    auto t0 = std::chrono::steady_clock::now();
    Tensor loss = nn::cross_entropy(model.forward(x), y);
    opt.step(loss);
    loss.item();
    double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s >= 2) ms.push_back(t);  // the first steps compile
  }
  std::sort(ms.begin(), ms.end());
  double median = ms[ms.size() / 2];
  fmt::print("CNN training step, batch {}: median {:.2f} ms  ({:.0f} examples/s) over {} steps\n", batch, median,
             1000.0 * static_cast<double>(batch) / median, ms.size());
}
