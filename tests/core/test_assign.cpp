// Tensor::assign, the one operation that writes into an existing variable (and set_grad, which
// writes its gradient slot), keeps the variable's dtype: a value of another dtype is a kiln::Error naming both (never a silent narrowing), and
// an explicit .to(DType) converts on purpose. The optimizers, which update through assign, keep
// working on float32, float64 and bfloat16 parameters.
#include <catch2/catch.hpp>

#include <vector>

#include "core/error.h"
#include "ops/ops.h"
#include "optim/adam.h"
#include "optim/sgd.h"

using kiln::DType;
using kiln::Tensor;
using Catch::Contains;

TEST_CASE("assign refuses a value of another dtype and names both", "[assign][dtype][error]") {
  Tensor p = kiln::from_vector<float>({1, 2, 3}, {3}).requires_grad_();
  Tensor wide = kiln::from_vector<double>({0.1, 0.2, 0.3}, {3});
  CHECK_THROWS_AS(p.assign(wide), kiln::Error);
  CHECK_THROWS_WITH(p.assign(wide), Contains("assign") && Contains("float64") && Contains("float32") &&
                                        Contains("[3]") && Contains(".to(DType::Float32)"));
  // Widening and integer values are refused too: one rule, no exceptions to remember.
  Tensor d = kiln::zeros({3}, DType::Float64).realize();
  CHECK_THROWS_WITH(d.assign(kiln::ones({3})), Contains("float32") && Contains(".to(DType::Float64)"));
  CHECK_THROWS_WITH(p.assign(kiln::arange(3, DType::Int32)), Contains("int32") && Contains("float32"));
  // A refused assign leaves the variable as it was.
  CHECK(p.dtype() == DType::Float32);
  CHECK(p.to_vector<float>() == std::vector<float>{1, 2, 3});
  CHECK(p.requires_grad());
  // An explicit conversion says it is meant.
  p.assign(wide.to(DType::Float32));
  CHECK(p.to_vector<float>() == std::vector<float>{0.1f, 0.2f, 0.3f});
  d.assign(kiln::ones({3}).to(DType::Float64));
  CHECK(d.to_vector<double>() == std::vector<double>{1, 1, 1});
  // Shape and device mismatches are still refused.
  CHECK_THROWS_WITH(p.assign(kiln::zeros({2})), Contains("assign") && Contains("[2]"));
}

TEST_CASE("set_grad takes a gradient of the tensor's own dtype and shape", "[assign][dtype][error]") {
  Tensor p = kiln::zeros({2}).realize().requires_grad_();
  CHECK_THROWS_WITH(p.set_grad(kiln::ones({2}, DType::Float64)),
                    Contains("set_grad") && Contains("float64") && Contains(".to(DType::Float32)"));
  CHECK_THROWS_WITH(p.set_grad(kiln::ones({3})), Contains("set_grad") && Contains("[3]"));
  CHECK_FALSE(p.grad().defined());
  p.set_grad(kiln::ones({2}, DType::Float64).to(DType::Float32));
  CHECK(p.grad().to_vector<float>() == std::vector<float>{1, 1});
  p.set_grad({});
  CHECK_FALSE(p.grad().defined());
}

TEST_CASE("Tensor::to(DType) is cast", "[assign][dtype]") {
  Tensor x = kiln::from_vector<double>({1.5, -2.25}, {2});
  CHECK(x.to(DType::Float32).dtype() == DType::Float32);
  CHECK(x.to(DType::Int64).to_vector<int64_t>() == std::vector<int64_t>{1, -2});
  CHECK(x.to(DType::Float64).node() == x.node());  // already that dtype: the same value
}

TEST_CASE("optimizers update float32, float64 and bfloat16 parameters in their own dtype", "[assign][optim]") {
  for (DType dtype : {DType::Float32, DType::Float64, DType::BFloat16}) {
    CAPTURE(kiln::dtype_name(dtype));
    Tensor a = kiln::full({4}, 1.0, dtype).realize().requires_grad_();
    Tensor b = kiln::full({4}, 1.0, dtype).realize().requires_grad_();
    kiln::optim::SGD sgd({a}, kiln::optim::SGDOptions(0.5).momentum(0.9).weight_decay(0.1));
    kiln::optim::Adam adam({b}, kiln::optim::AdamWOptions(0.1));
    for (int step = 0; step < 2; ++step) {
      Tensor loss = kiln::sum(a * a) + kiln::sum(b * b);
      sgd.zero_grad();
      adam.zero_grad();
      loss.backward();
      sgd.step({loss});
      adam.step({loss});
    }
    CHECK(a.dtype() == dtype);
    CHECK(b.dtype() == dtype);
    // Both moved towards 0 from 1.
    for (double v : a.to_doubles()) CHECK(v < 1.0);
    for (double v : b.to_doubles()) CHECK(v < 1.0);
  }
}
