// backward() adds into .grad (PyTorch's contract, which gradient accumulation over micro-batches
// relies on): two backward passes give the sum of their gradients, and the gradients of
// micro-batches add up to the whole batch's.
#include <catch2/catch.hpp>

#include <kiln/kiln.h>

using namespace kiln;

namespace {

void check_all_close(const Tensor& got, const std::vector<double>& want, double rtol) {
  std::vector<double> g = got.to_doubles();
  REQUIRE(g.size() == want.size());
  for (size_t i = 0; i < g.size(); ++i) {
    INFO("element " << i);
    CHECK(g[i] == Approx(want[i]).epsilon(rtol).margin(1e-12));
  }
}

}  // namespace

TEST_CASE("backward() adds to .grad: two losses give the sum of their gradients", "[autograd][accumulate]") {
  Tensor w = from_doubles({0.5, -1.0, 2.0, 0.0}, {4}, DType::Float64).requires_grad_();
  (w * w).sum().backward();  // 2w
  CHECK(w.grad().to_doubles() == std::vector<double>{1.0, -2.0, 4.0, 0.0});
  (w * 3.0).sum().backward();  // + 3
  CHECK(w.grad().to_doubles() == std::vector<double>{4.0, 1.0, 7.0, 3.0});
  // The same loss twice through a retained graph: twice its gradient on top.
  Tensor loss = (w * w * w).sum();  // 3w^2
  loss.backward(/*retain_graph=*/true);
  loss.backward();
  CHECK(w.grad().to_doubles() == std::vector<double>{4.0 + 1.5, 1.0 + 6.0, 7.0 + 24.0, 3.0});
  // zero_grad starts over.
  w.zero_grad();
  (w * 2.0).sum().backward();
  CHECK(w.grad().to_doubles() == std::vector<double>{2.0, 2.0, 2.0, 2.0});
}

TEST_CASE("the gradients of micro-batches add up to the whole batch's", "[autograd][accumulate]") {
  // A two-layer network in float64; the loss sums over the batch, so the batch's gradient is the
  // sum of its parts' (with a mean each part would be scaled by its share).
  manual_seed(5);
  Tensor w1 = randn({6, 8}, DType::Float64).realize().requires_grad_();
  Tensor b1 = (randn({8}, DType::Float64) * 0.1).realize().requires_grad_();
  Tensor w2 = randn({8, 3}, DType::Float64).realize().requires_grad_();
  Tensor x = randn({12, 6}, DType::Float64).realize();
  Tensor y = randn({12, 3}, DType::Float64).realize();
  auto loss_of = [&](const Tensor& xb, const Tensor& yb) {
    Tensor d = matmul(tanh(matmul(xb, w1) + b1), w2) - yb;
    return (d * d).sum();
  };
  const std::vector<Tensor> params = {w1, b1, w2};
  loss_of(x, y).backward();
  std::vector<std::vector<double>> whole;
  for (const Tensor& p : params) whole.push_back(p.grad().to_doubles());
  for (Tensor p : params) p.zero_grad();
  for (int64_t part = 0; part < 3; ++part)  // three micro-batches of 4 rows
    loss_of(x.slice(0, 4 * part, 4 * part + 4), y.slice(0, 4 * part, 4 * part + 4)).backward();
  for (size_t i = 0; i < params.size(); ++i) {
    INFO("parameter " << i);
    check_all_close(params[i].grad(), whole[i], 1e-12);
  }
}

TEST_CASE("accumulated gradients step an optimizer as the whole batch does", "[autograd][accumulate][optim]") {
  // The usual accumulation loop: backward per micro-batch, one step. Bit for bit the one-batch
  // step is not promised (the sums are grouped differently); to float64 rounding it is.
  auto run = [](int parts) {
    manual_seed(9);
    Tensor w = randn({5, 2}, DType::Float64).realize().requires_grad_();
    Tensor x = randn({8, 5}, DType::Float64).realize();
    optim::SGD opt({w}, optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      const int64_t rows = 8 / parts;
      for (int p = 0; p < parts; ++p) (tanh(matmul(x.slice(0, rows * p, rows * (p + 1)), w)).sum()).backward();
      opt.step();
    }
    return w.to_doubles();
  };
  std::vector<double> one = run(1), four = run(4);
  REQUIRE(one.size() == four.size());
  for (size_t i = 0; i < one.size(); ++i) CHECK(four[i] == Approx(one[i]).epsilon(1e-12).margin(1e-12));
}
