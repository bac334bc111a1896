// nn::checkpoint: a 16-layer MLP written as modules (4 blocks of 4 Linear + ReLU + Dropout)
// trains with and without checkpointing each block. Gradients and updated parameters must be
// bit-identical, and the planned arena of the training step must shrink.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <cstring>

#include "jit/executor.h"

using namespace kiln;

namespace {

constexpr int kBlocks = 4, kLayersPerBlock = 4;
constexpr int64_t kWidth = 64, kBatch = 32, kClasses = 10;

nn::Sequential make_block() {
  nn::Sequential block;
  for (int i = 0; i < kLayersPerBlock; ++i) {
    block.push_back(nn::Linear(kWidth, kWidth));
    block.push_back(nn::ReLU());
    block.push_back(nn::Dropout(0.1));
  }
  return block;
}

struct DeepNet : nn::Module {
  DeepNet() : Module("DeepNet") {}
  std::vector<nn::Sequential> blocks = register_blocks();
  nn::Linear head = register_module("head", nn::Linear(kWidth, kClasses));
  bool use_checkpoint = false;

  std::vector<nn::Sequential> register_blocks() {
    std::vector<nn::Sequential> out;
    for (int b = 0; b < kBlocks; ++b) out.push_back(register_module("block" + std::to_string(b), make_block()));
    return out;
  }
  Tensor forward(const Tensor& x) {  // (B, W) -> logits (B, classes)
    Tensor h = x;
    for (nn::Sequential& block : blocks) h = use_checkpoint ? nn::checkpoint(block, h) : block.forward(h);
    return head.forward(h);
  }
};

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.data(), b.data(), static_cast<size_t>(a.numel()) * dtype_size(a.dtype())) == 0;
}

struct Batch {
  Tensor x, y;
};
Batch make_batch() {
  std::vector<int64_t> labels(kBatch);
  for (int64_t i = 0; i < kBatch; ++i) labels[i] = (i * 7) % kClasses;
  return {randn({kBatch, kWidth}).realize(), from_vector<int64_t>(labels, {kBatch})};
}

}  // namespace

TEST_CASE("nn::checkpoint gives bit-identical gradients, dropout included", "[nn][recompute]") {
  auto run = [](bool use_checkpoint) {
    manual_seed(21);
    DeepNet net;
    net.use_checkpoint = use_checkpoint;
    Batch batch = make_batch();
    Tensor loss = nn::cross_entropy(net.forward(batch.x), batch.y);
    std::vector<Tensor> outputs = grad(loss, net.parameters());
    outputs.push_back(loss);
    sync(outputs);
    return outputs;
  };
  std::vector<Tensor> plain = run(false), checkpointed = run(true);
  REQUIRE(plain.size() == 2 * (kBlocks * kLayersPerBlock + 1) + 1);
  for (size_t i = 0; i < plain.size(); ++i) {
    INFO("output " << i);
    CHECK(same_bits(plain[i], checkpointed[i]));
  }
  double norm = 0;  // the comparison means something: gradients reach the first layer
  for (double v : plain[0].to_doubles()) norm += std::abs(v);
  CHECK(norm > 0);
}

TEST_CASE("nn::checkpoint shrinks a training step's arena and keeps the result", "[nn][recompute]") {
  if (!flags().lazy) return;  // eager mode keeps every value: there is no plan to shrink
  struct Result {
    int64_t arena = 0;
    size_t kernels = 0;
    std::vector<Tensor> params;
  };
  auto train = [](bool use_checkpoint) {
    manual_seed(22);
    DeepNet net;
    net.use_checkpoint = use_checkpoint;
    Batch batch = make_batch();
    optim::SGD opt(net.parameters(), optim::SGDOptions(0.05).momentum(0.9));
    Result r;
    for (int step = 0; step < 2; ++step) {
      opt.step(nn::cross_entropy(net.forward(batch.x), batch.y));
      memory::PlanLayout plan = jit::last_plan_memory();
      r.arena = plan.arena_bytes;
      r.kernels = plan.kernels.size();
    }
    r.params = net.parameters();
    return r;
  };
  // What checkpoints save alone: by default the dropout masks are recomputed in both plans.
  FlagsGuard guard;
  flags().recompute = "off";
  Result plain = train(false), checkpointed = train(true);
  INFO("arena without checkpoint " << plain.arena << " B, with " << checkpointed.arena << " B");
  REQUIRE(plain.arena > 0);
  CHECK(checkpointed.arena <= plain.arena * 60 / 100);
  CHECK(checkpointed.kernels > plain.kernels);  // the insides of the blocks run again
  REQUIRE(plain.params.size() == checkpointed.params.size());
  for (size_t i = 0; i < plain.params.size(); ++i) {
    INFO("parameter " << i);
    CHECK(same_bits(plain.params[i], checkpointed.params[i]));
  }
}

TEST_CASE("nn::checkpoint is a plain forward without gradient tracking", "[nn][recompute]") {
  manual_seed(23);
  DeepNet net;
  net.eval();  // no dropout
  Batch batch = make_batch();
  NoGradGuard no_grad;
  Tensor plain = net.forward(batch.x);
  net.use_checkpoint = true;
  CHECK(same_bits(net.forward(batch.x), plain));
}
