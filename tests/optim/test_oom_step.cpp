// Running out of memory in the middle of training is recoverable: the step that did not fit
// (KILN_MEMORY_LIMIT) changes no parameter, no optimizer state and no step count, and the same
// optimizer then trains on with a smaller batch exactly as if the failed step had never been tried.
#include <catch2/catch.hpp>

#include <kiln/kiln.h>

#include "memory/allocator.h"

using namespace kiln;

namespace {

struct Model {
  std::vector<Tensor> params;  // w1 (64, 512), b1 (512), w2 (512, 10), b2 (10)
  optim::Adam opt;
  explicit Model(const std::vector<std::vector<double>>& init)
      : params(make(init)), opt(params, optim::AdamOptions(1e-2)) {}

  static std::vector<Tensor> make(const std::vector<std::vector<double>>& init) {
    const std::vector<Shape> shapes = {{64, 512}, {512}, {512, 10}, {10}};
    std::vector<Tensor> p;
    for (size_t i = 0; i < shapes.size(); ++i) p.push_back(from_doubles(init[i], shapes[i], DType::Float32).requires_grad_());
    return p;
  }
  void step(const Tensor& x, const Tensor& y) {
    Tensor h = relu(matmul(x, params[0]) + params[1]);  // (B, 512)
    opt.step(cross_entropy(matmul(h, params[2]) + params[3], y));
  }
  // Parameters, then every optimizer state tensor (Adam's moments and step counts), as values.
  std::vector<std::vector<double>> values() const {
    std::vector<std::vector<double>> out;
    for (const Tensor& p : params) out.push_back(p.to_doubles());
    for (const auto& [name, t] : opt.state()) out.push_back(t.to_doubles());
    return out;
  }
};

std::pair<Tensor, Tensor> batch(int64_t rows, uint64_t seed) {
  manual_seed(seed);
  Tensor x = randn({rows, 64}).realize();
  Tensor y = cast(rand({rows}) * 10.0, DType::Int64).realize();
  return {x, y};
}

}  // namespace

TEST_CASE("out of memory at step N leaves step N-1's parameters and optimizer state; a smaller batch trains on",
          "[optim][memory][faults]") {
  FlagsGuard guard;
  flags().use_cuda = false;  // KILN_MEMORY_LIMIT caps host memory (the use_cuda.* entries run this too)
  manual_seed(3);
  std::vector<std::vector<double>> init;
  for (Shape s : std::vector<Shape>{{64, 512}, {512}, {512, 10}, {10}}) init.push_back((randn(s) * 0.05).to_doubles());
  Model model(init), reference(init);
  std::vector<std::pair<Tensor, Tensor>> small = {batch(16, 10), batch(16, 11), batch(16, 12)};
  auto [big_x, big_y] = batch(16384, 13);  // (16384, 64): activations of 32 MiB each
  for (int k = 0; k < 2; ++k) {
    model.step(small[k].first, small[k].second);
    reference.step(small[k].first, small[k].second);
  }
  const std::vector<std::vector<double>> after_two = model.values();
  REQUIRE(after_two == reference.values());

  // Room for a small step, not for the big one.
  kiln::empty_cache();
  flags().memory_limit = std::to_string(memory::host_allocator().bytes_in_use() + (int64_t{16} << 20));
  CHECK_THROWS_WITH(model.step(big_x, big_y), Catch::Contains("out of memory"));
  // Nothing moved: not the parameters, not Adam's moments, not its step count (which sets the bias
  // correction of the next step). Read under the limit: a pending update would have to run here.
  CHECK(model.values() == after_two);
  // The same optimizer, a smaller batch: the step the reference takes, to the bit.
  model.step(small[2].first, small[2].second);
  flags().memory_limit = "";
  reference.step(small[2].first, small[2].second);
  CHECK(model.values() == reference.values());
}
