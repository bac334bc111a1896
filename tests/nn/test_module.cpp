// nn::Module: registration, dotted names, aliasing, train/eval, printing, gradients.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include "backends/cuda/cuda_runtime.h"

using namespace kiln;

namespace {

struct Block : nn::Module {
  nn::Linear fc = register_module("fc", nn::Linear(3, 4));
  nn::BatchNorm1d norm = register_module("norm", nn::BatchNorm1d(4));
  Block() : Module("Block") {}
  Tensor forward(const Tensor& x) { return relu(norm.forward(fc.forward(x))); }
};

struct Net : nn::Module {
  Tensor scale = register_parameter("scale", ones({1}));
  Block block = register_module("block", Block());
  nn::Linear head = register_module("head", nn::Linear(nn::LinearOptions(4, 2).bias(false)));
  Net() : Module("Net") {}
  Tensor forward(const Tensor& x) { return head.forward(block.forward(x * scale)); }
};

}  // namespace

TEST_CASE("module registers parameters with dotted names in order", "[nn]") {
  Net net;
  std::vector<std::string> names;
  for (auto& [name, p] : net.named_parameters()) {
    names.push_back(name);
    CHECK(p.requires_grad());
  }
  CHECK(names == std::vector<std::string>{"scale", "block.fc.weight", "block.fc.bias", "block.norm.weight",
                                          "block.norm.bias", "head.weight"});
  std::vector<std::string> buffers;
  for (auto& [name, b] : net.named_buffers()) buffers.push_back(name);
  CHECK(buffers == std::vector<std::string>{"block.norm.running_mean", "block.norm.running_var",
                                            "block.norm.num_batches_tracked"});
  CHECK(net.children().size() == 2);
  CHECK(net.parameters(false).size() == 1);
  CHECK(net.parameter_count() == 1 + 12 + 4 + 4 + 4 + 8);
}

TEST_CASE("module rejects bad and duplicate names", "[nn]") {
  nn::Module m;
  CHECK_THROWS_AS(m.register_parameter("", zeros({2})), Error);
  CHECK_THROWS_AS(m.register_parameter("a.b", zeros({2})), Error);
  CHECK_THROWS_AS(m.register_buffer("x.y", zeros({2})), Error);
  CHECK_THROWS_AS(m.register_module("", nn::ReLU()), Error);
  CHECK_THROWS_AS(m.register_module("fc.1", nn::ReLU()), Error);
  m.register_parameter("w", zeros({2}));
  CHECK_THROWS_AS(m.register_buffer("w", zeros({2})), Error);
  CHECK_THROWS_AS(m.register_module("w", nn::ReLU()), Error);
  CHECK_THROWS_AS(m.register_parameter("i", zeros({2}, DType::Int64)), Error);
  CHECK_THROWS_WITH(m.register_parameter("a.b", zeros({2})), Catch::Contains("a.b"));
}

TEST_CASE("module copies alias the same module", "[nn]") {
  nn::Linear a(2, 2);
  nn::Linear b = a;
  CHECK(a.same_as(b));
  nn::init::zeros_(b.weight);
  CHECK(a.weight.to_vector<float>() == std::vector<float>(4, 0.0f));
  CHECK(a.named_parameters()[0].second.to_vector<float>() == std::vector<float>(4, 0.0f));
  b.eval();
  CHECK_FALSE(a.is_training());
}

TEST_CASE("train and eval apply recursively", "[nn]") {
  Net net;
  CHECK(net.block.norm.is_training());
  net.eval();
  CHECK_FALSE(net.is_training());
  CHECK_FALSE(net.block.is_training());
  CHECK_FALSE(net.block.norm.is_training());
  net.train();
  CHECK(net.block.fc.is_training());
}

TEST_CASE("module to(device) accepts the cpu and refuses a device that is not there", "[nn]") {
  Net net;
  CHECK_NOTHROW(net.to(Device::cpu()));
  CHECK_THROWS_AS(net.to(Device::cuda(cuda::device_count())), Error);
}

TEST_CASE("module printing shows the tree with parameter counts", "[nn]") {
  Net net;
  std::string text = net.to_string();
  CHECK_THAT(text, Catch::StartsWith("Net - 33 parameters\n"));
  CHECK_THAT(text, Catch::Contains("  (block): Block - 24 parameters\n"));
  CHECK_THAT(text, Catch::Contains("    (fc): Linear(in=3, out=4, bias=true) - 16 parameters\n"));
  CHECK_THAT(text, Catch::Contains("  (head): Linear(in=4, out=2, bias=false) - 8 parameters\n"));
  nn::Linear big(784, 512);
  CHECK_THAT(big.to_string(), Catch::Contains("401,920 parameters"));
  std::ostringstream os;
  os << net;
  CHECK(os.str() == text);
}

TEST_CASE("gradient reaches every parameter and zero_grad clears it", "[nn]") {
  manual_seed(3);
  Net net;
  Tensor x = randn({5, 3});
  Tensor loss = nn::cross_entropy(net.forward(x), from_vector<int64_t>({0, 1, 1, 0, 1}, {5}));
  loss.backward();
  for (auto& [name, p] : net.named_parameters()) {
    INFO(name);
    REQUIRE(p.grad().defined());
    double norm = 0;
    for (double g : p.grad().to_doubles()) norm += g * g;
    CHECK(norm > 0.0);
  }
  net.zero_grad();
  for (auto& p : net.parameters()) CHECK_FALSE(p.grad().defined());
}

TEST_CASE("sequential chains and names its children by position", "[nn]") {
  nn::Sequential seq(nn::Linear(3, 5), nn::ReLU(), nn::Linear(5, 2));
  seq.push_back(nn::Tanh());
  CHECK(seq.size() == 4);
  std::vector<std::string> names;
  for (auto& [name, _] : seq.named_parameters()) names.push_back(name);
  CHECK(names == std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"});
  Tensor x = randn({4, 3});
  Tensor y = seq.forward(x);
  CHECK(y.shape() == Shape{4, 2});
  for (double v : y.to_doubles()) CHECK(std::abs(v) < 1.0);
  nn::Sequential alias = seq;
  CHECK(alias.same_as(seq));
  CHECK(alias.size() == 4);
}
