// Unary ops at 0 and -0.0, in every float dtype and on every backend (the CPU here, cuda:0 in the
// [device] case, which CTest runs again on the host emulator): the inputs random tests never draw,
// where sign, abs and their gradients have a value of their own. The expected values are
// PyTorch's (sign(0) = 0, d|x|/dx = 0 at 0, relu'(0) = 0), written out, not computed by kiln.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <limits>

#include <kiln/kiln.h>

#include "backends/cuda/cuda_runtime.h"
#include "tests/support/compare.h"

using namespace kiln;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Expected {
  const char* name;
  std::function<Tensor(const Tensor&)> op;
  double at_zero, at_negative_zero;
  bool float_only;
};

// Equal as values, and with the same sign where the expected value is a signed zero of a
// function that IEEE arithmetic fixes (neg, sqrt, floor).
void check_value(double got, double want, bool check_sign_of_zero) {
  if (std::isnan(want)) {
    CHECK(std::isnan(got));
    return;
  }
  CHECK(got == want);
  if (check_sign_of_zero && want == 0) CHECK(std::signbit(got) == std::signbit(want));
}

void check_unary_at_zero(Device device) {
  const std::vector<Expected> ops = {
      {"sign", [](const Tensor& x) { return sign(x); }, 0.0, 0.0, false},
      {"abs", [](const Tensor& x) { return abs(x); }, 0.0, 0.0, false},
      {"neg", [](const Tensor& x) { return neg(x); }, -0.0, 0.0, false},
      {"relu", [](const Tensor& x) { return relu(x); }, 0.0, 0.0, true},
      {"floor", [](const Tensor& x) { return floor(x); }, 0.0, -0.0, true},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, 0.0, -0.0, true},
      {"exp", [](const Tensor& x) { return exp(x); }, 1.0, 1.0, true},
      {"log", [](const Tensor& x) { return log(x); }, -kInf, -kInf, true},
      {"reciprocal", [](const Tensor& x) { return reciprocal(x); }, kInf, -kInf, true},
      {"sin", [](const Tensor& x) { return sin(x); }, 0.0, 0.0, true},
      {"cos", [](const Tensor& x) { return cos(x); }, 1.0, 1.0, true},
      {"tanh", [](const Tensor& x) { return tanh(x); }, 0.0, 0.0, true},
      {"erf", [](const Tensor& x) { return erf(x); }, 0.0, 0.0, true},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, 0.5, 0.5, true},
      {"silu", [](const Tensor& x) { return silu(x); }, 0.0, 0.0, true},
      {"gelu", [](const Tensor& x) { return gelu(x); }, 0.0, 0.0, true},
  };
  for (DType t : {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16, DType::Int32, DType::Int64}) {
    const bool is_float = t == DType::Float32 || t == DType::Float64 || t == DType::Float16 || t == DType::BFloat16;
    // Zeros beside other values, so a vectorized loop sees them in every lane position.
    std::vector<double> values = {0.0, -0.0, 1.0, -2.0, 0.0, -0.0, 0.0, -0.0, 3.0};
    if (!is_float) values = {0, 0, 1, -2, 0, 0, 0, 0, 3};
    Tensor x = from_doubles(values, {9}, t).to(device);
    std::vector<Tensor> results;
    std::vector<const Expected*> which;
    for (const Expected& e : ops) {
      if (e.float_only && !is_float) continue;
      results.push_back(e.op(x));
      which.push_back(&e);
    }
    sync(results);
    for (size_t i = 0; i < results.size(); ++i) {
      const Expected& e = *which[i];
      INFO(e.name << " in " << dtype_name(t) << " on " << device.str());
      REQUIRE(results[i].device() == device);
      std::vector<double> got = results[i].to_doubles();
      const bool signed_zero = is_float && (std::string(e.name) == "neg" || std::string(e.name) == "sqrt" ||
                                            std::string(e.name) == "floor");
      for (size_t k : {0, 4, 6}) check_value(got[k], e.at_zero, signed_zero);
      for (size_t k : {1, 5, 7}) check_value(got[k], is_float ? e.at_negative_zero : e.at_zero, signed_zero);
    }
  }
}

void check_gradients_at_zero(Device device) {
  for (DType t : {DType::Float32, DType::Float64}) {
    INFO(dtype_name(t) << " on " << device.str());
    Tensor x = from_doubles({0.0, -0.0, 1.5, -2.0}, {4}, t).to(device).requires_grad_();
    auto g = grad(sum(abs(x)) + sum(relu(x)) * 10.0 + sum(sign(x)) * 100.0, {x});
    // |x|' = sign(x) (0 at 0), relu' = 1 where x > 0, sign' = 0.
    CHECK(g[0].to_doubles() == std::vector<double>{0.0, 0.0, 11.0, -1.0});
    // And through backward(), into .grad.
    Tensor y = from_doubles({0.0, -0.0, 3.0}, {3}, t).to(device).requires_grad_();
    abs(y * 2.0).sum().backward();
    CHECK(y.grad().to_doubles() == std::vector<double>{0.0, 0.0, 2.0});
  }
}

using kiln::testing::have_cuda;

}  // namespace

TEST_CASE("unary ops at 0 and -0.0 give PyTorch's values in every dtype", "[forward][elementwise][zero]") {
  check_unary_at_zero(Device::cpu());
}

TEST_CASE("the gradients of abs, relu and sign at 0 are 0", "[autograd][zero]") {
  check_gradients_at_zero(Device::cpu());
}

TEST_CASE("CUDA unary ops and their gradients at 0 and -0.0", "[cuda][device][cuda_ops][zero]") {
  if (!have_cuda()) return;
  check_unary_at_zero(Device::cuda(0));
  check_gradients_at_zero(Device::cuda(0));
}
