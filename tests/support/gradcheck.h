// Gradient checking: kiln::grad against central finite differences, in float64.
//
//   auto f = [](const std::vector<kiln::Tensor>& x) { return kiln::tanh(x[0] * x[1]); };
//   auto result = kiln::testing::gradcheck(f, {kiln::testing::uniform({3, 4}, -2, 2, 1),
//                                              kiln::testing::uniform({4}, -2, 2, 2)});
//   INFO(result.report);
//   CHECK(result.ok);
//
// A non-scalar output is reduced to sum(output * w) with fixed random weights w, so every output
// element matters. Each finite-difference evaluation rebuilds the graph (forward and backward,
// exactly as the analytic run) from new from_vector inputs of the same shapes: the structure
// repeats, so one module is compiled per check and every other evaluation is a plan-cache hit.
// Keep inputs small (a handful to ~30 elements): a check runs the graph 2 * elements + 1 times.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace kiln::testing {

using TensorFn = std::function<Tensor(const std::vector<Tensor>&)>;

struct GradcheckOptions {
  double eps = 1e-6;   // finite-difference step
  double atol = 1e-5;  // |analytic - numeric| <= atol + rtol * |numeric| passes
  double rtol = 1e-5;
  uint64_t weight_seed = 12345;  // weights of the reduction of a non-scalar output
};

struct GradcheckResult {
  bool ok = true;
  std::string report;  // the worst element of each input, and every failure
};

// `inputs` are float64 tensors (realized or not) giving the point at which to check; only their
// values are used. `f` must be deterministic and differentiable near that point.
GradcheckResult gradcheck(const TensorFn& f, const std::vector<Tensor>& inputs, const GradcheckOptions& options = {});

// The analytic gradient of the weighted sum of f(inputs) (see above) for each input, as doubles.
// The inputs are copied into fresh leaves of `dtype` (values rounded to it): used to compare a
// float32 path's gradient with the float64 one.
std::vector<std::vector<double>> analytic_gradients(const TensorFn& f, const std::vector<Tensor>& inputs, DType dtype,
                                                    uint64_t weight_seed = 12345);

// A float64 tensor of uniform values in [lo, hi) from a fixed seed (std::mt19937_64).
Tensor uniform(Shape shape, double lo, double hi, uint64_t seed);
// Like uniform, but every element has magnitude in [lo, hi) and a random sign: keeps inputs away
// from 0 for abs, sign-sensitive and 1/x functions.
Tensor away_from_zero(Shape shape, double lo, double hi, uint64_t seed);
// A float64 tensor of distinct values (a shuffled ramp plus small noise) spaced at least `gap`
// apart: no ties for max/min/relu-like functions.
Tensor distinct(Shape shape, double gap, uint64_t seed);

}  // namespace kiln::testing

// In a Catch2 test: runs gradcheck(...) and reports its worst elements when it fails.
#define CHECK_GRADIENTS(...)                                     \
  do {                                                           \
    auto gradcheck_result = ::kiln::testing::gradcheck(__VA_ARGS__); \
    INFO(gradcheck_result.report);                               \
    CHECK(gradcheck_result.ok);                                  \
  } while (0)
