// Running modules through a type-erased handle: the virtual forward on a Module&, nn::AnyModule
// holding any module by value, Sequential's steps, nn::checkpoint on a Module&, the nn::Layer
// check that catches a forward that does not override, and options fixed at construction.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <type_traits>
#include <vector>

using namespace kiln;

namespace {

struct TwoLayer : nn::Module {
  nn::Linear fc1 = register_module("fc1", nn::Linear(3, 5));
  nn::Linear fc2 = register_module("fc2", nn::Linear(5, 2));
  TwoLayer() : Module("TwoLayer") {}
  Tensor forward(const Tensor& x) override { return fc2.forward(relu(fc1.forward(x))); }  // (B, 3) -> (B, 2)
};

// Declares a const forward: it hides the virtual one instead of overriding it.
struct ConstForward : nn::Module {
  Tensor forward(const Tensor& x) const { return x; }
};
struct NoForward : nn::Module {};

bool same_values(const Tensor& a, const Tensor& b) { return a.to_vector<float>() == b.to_vector<float>(); }

}  // namespace

static_assert(nn::Layer<nn::Linear> && nn::Layer<nn::Sequential> && nn::Layer<TwoLayer> && nn::Layer<nn::AnyModule>);
static_assert(!nn::Layer<ConstForward>, "a const forward does not override Module::forward");
static_assert(nn::Layer<NoForward>, "inherits the default forward, which throws when run");
// Options and settings can be read but not changed after construction.
static_assert(std::is_same_v<decltype(std::declval<nn::Linear&>().options()), const nn::LinearOptions&>);
static_assert(std::is_same_v<decltype(std::declval<nn::Conv2d&>().options()), const nn::Conv2dOptions&>);

TEST_CASE("a Module& runs the derived module's forward", "[nn][any_module]") {
  TwoLayer net;
  Tensor x = randn({4, 3}).realize();
  nn::Module& any = net;
  CHECK(same_values(any.forward(x), net.forward(x)));
}

TEST_CASE("a module without a single-input forward throws naming it", "[nn][any_module]") {
  nn::Module plain("Plain");
  CHECK_THROWS_AS(plain.forward(zeros({2})), Error);
  CHECK_THROWS_WITH(plain.forward(zeros({2})), Catch::Contains("Plain") && Catch::Contains("no single-input forward"));
  // A copy into a plain Module keeps the shared state but not the override.
  nn::Linear linear(3, 2);
  nn::Module sliced = linear;
  CHECK(sliced.same_as(linear));
  CHECK_THROWS_WITH(sliced.forward(zeros({1, 3})), Catch::Contains("Linear") && Catch::Contains("nn::AnyModule"));
}

TEST_CASE("AnyModule holds any module by value and dispatches to it", "[nn][any_module]") {
  TwoLayer net;
  nn::Linear linear(3, 3);
  std::vector<nn::AnyModule> modules{linear, nn::ReLU(), net};
  Tensor x = randn({4, 3}).realize();
  CHECK(same_values(modules[0].forward(x), linear.forward(x)));
  CHECK(same_values(modules[1].forward(x), relu(x)));
  CHECK(same_values(modules[2].forward(x), net.forward(x)));
  // The wrapped module's state, shared: parameters, names, train/eval, printing.
  CHECK(modules[2].same_as(net));
  CHECK(modules[2].type_name() == "TwoLayer");
  CHECK(modules[2].parameters().size() == 4);
  nn::init::zeros_(linear.weight);
  CHECK(modules[0].forward(x).to_vector<float>() == (zeros({4, 3}) + linear.bias).to_vector<float>());
  modules[2].eval();
  CHECK_FALSE(net.fc1.is_training());
  // The concrete type back, and copies of an AnyModule alias the same module.
  REQUIRE(modules[2].get<TwoLayer>() != nullptr);
  CHECK(modules[2].get<TwoLayer>()->fc2.same_as(net.fc2));
  CHECK(modules[2].get<nn::Linear>() == nullptr);
  nn::AnyModule copy = modules[0];
  CHECK(copy.same_as(linear));
  CHECK(copy.get<nn::Linear>() == modules[0].get<nn::Linear>());
}

TEST_CASE("Sequential runs user modules and gives each step as an AnyModule", "[nn][any_module]") {
  TwoLayer net;
  nn::Sequential seq(net, nn::Tanh());
  nn::Sequential outer(seq, nn::Sigmoid());  // nested: a Sequential is a Layer too
  Tensor x = randn({4, 3}).realize();
  Tensor want = sigmoid(kiln::tanh(net.forward(x)));
  CHECK(same_values(outer.forward(x), want));
  CHECK(same_values(seq[0].forward(x), net.forward(x)));
  CHECK(seq[0].same_as(net));
  nn::Module& as_module = outer;
  CHECK(same_values(as_module.forward(x), want));
  CHECK_THROWS_AS(seq[2], std::out_of_range);
}

TEST_CASE("nn::checkpoint runs any module through a Module&", "[nn][any_module][recompute]") {
  TwoLayer net;
  Tensor x = randn({6, 3}).realize();
  Tensor labels = from_vector<int64_t>({0, 1, 1, 0, 1, 0}, {6});
  auto gradients = [&](bool checkpointed) {
    net.zero_grad();
    nn::Module& module = net;
    Tensor logits = checkpointed ? nn::checkpoint(module, x) : module.forward(x);
    nn::cross_entropy(logits, labels).backward();
    std::vector<std::vector<float>> out;
    for (const Tensor& p : net.parameters()) out.push_back(p.grad().to_vector<float>());
    return out;
  };
  auto plain = gradients(false);
  CHECK(gradients(true) == plain);
  nn::AnyModule held = net;
  CHECK(same_values(nn::checkpoint(held, x), net.forward(x)));
}

TEST_CASE("layer settings are fixed at construction, so copies agree", "[nn][any_module]") {
  nn::Dropout dropout(0.25);
  nn::Dropout copy = dropout;
  CHECK(copy.p() == 0.25);
  nn::Linear head(nn::LinearOptions(4, 2).bias(false));
  nn::AnyModule held = head;
  CHECK(held.get<nn::Linear>()->options().in_features() == 4);
  CHECK_FALSE(held.get<nn::Linear>()->options().bias());
  nn::Flatten flatten(1, 2);
  CHECK(flatten.start_dim() == 1);
  CHECK(flatten.end_dim() == 2);
  CHECK(nn::GELU(true).tanh_approximation());
}
