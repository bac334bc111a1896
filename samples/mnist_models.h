// The two Fashion-MNIST models of samples/train_mnist.cpp, shared with bench/bench_cuda.cpp so
// that the GPU benchmark times exactly the sample's networks.
#pragma once
#include <kiln/kiln.h>

namespace kiln::samples {

// 784 -> 512 -> 512 -> 10 with ReLU.
struct Mlp : nn::Module {
  Mlp() : Module("Mlp") {}
  nn::Linear fc1 = register_module("fc1", nn::Linear(784, 512));
  nn::Linear fc2 = register_module("fc2", nn::Linear(512, 512));
  nn::Linear fc3 = register_module("fc3", nn::Linear(512, 10));
  Tensor forward(const Tensor& x) override {  // x: (B, 784) -> logits (B, 10)
    return fc3.forward(relu(fc2.forward(relu(fc1.forward(x)))));
  }
};

// The Mlp as a flat list of layers (the same parameters in the same order, so the same seed gives
// the same weights), for distributed::Pipeline to cut into stages.
inline nn::Sequential mlp_layers() {
  return nn::Sequential(nn::Linear(784, 512), nn::ReLU(), nn::Linear(512, 512), nn::ReLU(), nn::Linear(512, 10));
}

// The Mlp split over the ranks of a tensor-parallel world (mpirun -np T): fc1 column-parallel
// (each rank computes 512 / T of the hidden units), fc2 row-parallel (one all-reduce sums the
// ranks' partial products), fc3 replicated. Same names and draws as Mlp: the same seed gives Mlp's
// weights, each rank holding its block.
struct TensorParallelMlp : nn::Module {
  TensorParallelMlp() : Module("TensorParallelMlp") {}
  distributed::ColumnParallelLinear fc1 = register_module("fc1", distributed::ColumnParallelLinear(784, 512));
  distributed::RowParallelLinear fc2 = register_module("fc2", distributed::RowParallelLinear(512, 512));
  nn::Linear fc3 = register_module("fc3", nn::Linear(512, 10));
  Tensor forward(const Tensor& x) override { return fc3.forward(relu(fc2.forward(relu(fc1.forward(x))))); }
};

// LeNet-style: conv 32 (3x3, pad 1), ReLU, max pool 2, conv 64, ReLU, max pool 2, fc 128, fc 10.
struct Cnn : nn::Module {
  Cnn() : Module("Cnn") {}
  nn::Conv2d conv1 = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)));
  nn::Conv2d conv2 = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)));
  nn::MaxPool2d pool = register_module("pool", nn::MaxPool2d(2));
  nn::Linear fc1 = register_module("fc1", nn::Linear(64 * 7 * 7, 128));
  nn::Linear fc2 = register_module("fc2", nn::Linear(128, 10));
  Tensor forward(const Tensor& x) override {  // x: (B, 784) -> logits (B, 10)
    Tensor h = x.reshape({x.size(0), 1, 28, 28});
    h = pool.forward(relu(conv1.forward(h)));  // (B, 32, 14, 14)
    h = pool.forward(relu(conv2.forward(h)));  // (B, 64, 7, 7)
    return fc2.forward(relu(fc1.forward(h.reshape({x.size(0), 64 * 7 * 7}))));
  }
};

}  // namespace kiln::samples
