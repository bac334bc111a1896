// The plan cache's key must tell apart graphs that differ only in what the key could forget: the
// dtype of an input, of an intermediate, an attribute. Each case runs graphs of one structure one
// after the other in this process, so a key that leaves something out replays the first plan on
// the second graph's buffers and reads them as the wrong type.
#include <catch2/catch.hpp>

#include <kiln/kiln.h>

using namespace kiln;

namespace {

// Small whole numbers: exact in every dtype, uint8 and bool aside (handled by the caller).
std::vector<double> small_values(int64_t n) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<double>((i * 7) % 13);
  return v;
}

}  // namespace

TEST_CASE("casts of inputs that differ only in dtype each get their own plan", "[jit][plan-cache][dtype]") {
  const Shape shape{6, 5};
  const std::vector<double> values = small_values(30);
  double want_sum = 0;
  for (double v : values) want_sum += v;
  std::vector<double> doubled;
  for (double v : values) doubled.push_back(2 * v + 1);
  // int32 first, then float64 of the same shape: the case a key without input dtypes gets wrong.
  for (DType t : {DType::Int32, DType::Float64, DType::Int64, DType::Float32, DType::Float16, DType::BFloat16,
                  DType::Int8, DType::UInt8}) {
    INFO("input dtype " << dtype_name(t));
    Tensor x = from_doubles(values, shape, t);
    CHECK(x.dtype() == t);
    // The same graph each time: a cast to float32 and arithmetic in float32.
    Tensor y = cast(x, DType::Float32) * 2.0 + 1.0;
    Tensor s = sum(cast(x, DType::Float32));
    sync({y, s});
    CHECK(y.to_doubles() == doubled);
    CHECK(s.item() == want_sum);
  }
}

TEST_CASE("graphs that differ only in an intermediate dtype each get their own plan", "[jit][plan-cache][dtype]") {
  // 2.75 survives float32, float64 and the half types; an integer cast truncates it to 2, bool to 1.
  Tensor x = full({4, 3}, 2.75, DType::Float32).realize();
  const std::vector<std::pair<DType, double>> cases = {
      {DType::Int32, 2.0}, {DType::Float64, 2.75}, {DType::Int64, 2.0}, {DType::Float16, 2.75},
      {DType::BFloat16, 2.75}, {DType::Int8, 2.0}, {DType::Bool, 1.0}, {DType::Float32, 2.75}};
  for (auto [t, want] : cases) {
    INFO("through " << dtype_name(t));
    CHECK(cast(cast(x, t), DType::Float32).to_doubles() == std::vector<double>(12, want));
  }
}

TEST_CASE("a training step in float32 and in float64 of the same shapes give their own results",
          "[jit][plan-cache][dtype]") {
  // The same step recorded over parameters of each dtype; float64 must not replay float32's plan.
  std::vector<double> results;
  for (DType t : {DType::Float32, DType::Float64}) {
    Tensor w = from_doubles({0.5, -0.25, 0.125, 1.0, -1.5, 2.0}, {3, 2}, t).requires_grad_();
    Tensor x = from_doubles({1, 2, 3, -1, 0.5, 0.25}, {2, 3}, t);
    Tensor loss = sum(tanh(matmul(x, w)) * 3.0);
    auto g = grad(loss, {w});
    {
      NoGradGuard no_grad;
      w.assign(w - 0.1 * g[0]);
    }
    sync({w, loss});
    CHECK(w.dtype() == t);
    results.push_back(sum(w).item());
  }
  CHECK(results[0] == Approx(results[1]).epsilon(1e-6));
}
