// Central-difference gradient checking (see gradcheck.h).
#include "tests/support/gradcheck.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "core/autograd.h"
#include "ops/ops.h"

namespace kiln::testing {

namespace {

using Values = std::vector<std::vector<double>>;

std::vector<double> reduction_weights(const Shape& shape, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(0.5, 1.5);
  std::vector<double> w(static_cast<size_t>(numel(shape)));
  for (size_t i = 0; i < w.size(); ++i) w[i] = (i % 2 ? -1.0 : 1.0) * dist(rng);  // mixed signs
  return w;
}

// sum(y * w) for a non-scalar y; y itself for a one-element y.
Tensor reduce_output(const Tensor& y, uint64_t seed) {
  if (y.numel() == 1) return y;
  Tensor w = cast(from_vector<double>(reduction_weights(y.shape(), seed), y.shape()), y.dtype());
  return sum(y * w);
}

std::vector<Tensor> make_inputs(const Values& values, const std::vector<Tensor>& like, DType dtype, bool leaves) {
  std::vector<Tensor> out;
  for (size_t i = 0; i < values.size(); ++i) {
    Tensor t = dtype == DType::Float64 ? from_vector<double>(values[i], like[i].shape())
                                       : from_doubles(values[i], like[i].shape(), dtype);
    if (leaves) t.requires_grad_();
    out.push_back(t);
  }
  return out;
}

Values host_values(const std::vector<Tensor>& inputs) {
  Values values;
  for (const Tensor& t : inputs) values.push_back(t.to_doubles());
  return values;
}

struct Evaluation {
  double loss;
  Values grads;
};

// The reduced output and its gradients at `values`. The analytic gradient and every
// finite-difference evaluation go through here, so all of them record one graph structure and,
// after the first, hit the plan cache (one compiled module per check).
Evaluation evaluate(const TensorFn& f, const Values& values, const std::vector<Tensor>& like, DType dtype,
                    uint64_t seed) {
  std::vector<Tensor> leaves = make_inputs(values, like, dtype, true);
  Tensor loss = reduce_output(f(leaves), seed);
  std::vector<Tensor> grads = grad(loss, leaves);
  std::vector<Tensor> targets = grads;
  targets.push_back(loss);
  sync(targets);
  Evaluation e{loss.item(), {}};
  for (size_t i = 0; i < grads.size(); ++i) {
    KILN_CHECK(grads[i].shape() == leaves[i].shape(), "gradcheck", "gradient {} of input {} has shape {}", i,
               shape_str(leaves[i].shape()), shape_str(grads[i].shape()));
    e.grads.push_back(grads[i].to_doubles());
  }
  return e;
}

}  // namespace

std::vector<std::vector<double>> analytic_gradients(const TensorFn& f, const std::vector<Tensor>& inputs, DType dtype,
                                                    uint64_t weight_seed) {
  return evaluate(f, host_values(inputs), inputs, dtype, weight_seed).grads;
}

GradcheckResult gradcheck(const TensorFn& f, const std::vector<Tensor>& inputs, const GradcheckOptions& options) {
  GradcheckResult result;
  for (const Tensor& t : inputs)
    KILN_CHECK(t.dtype() == DType::Float64, "gradcheck", "inputs must be float64, got {}", t.str());
  Values point = host_values(inputs);
  const Evaluation at_point = evaluate(f, point, inputs, DType::Float64, options.weight_seed);
  const Values& analytic = at_point.grads;
  const double base = at_point.loss;
  if (!std::isfinite(base)) {
    result.ok = false;
    result.report += fmt::format("f is not finite at the check point ({})\n", base);
    return result;
  }
  int failures = 0;
  for (size_t i = 0; i < point.size(); ++i) {
    double worst_excess = -INFINITY;
    std::string worst;
    for (size_t j = 0; j < point[i].size(); ++j) {
      Values shifted = point;
      shifted[i][j] = point[i][j] + options.eps;
      const double plus = evaluate(f, shifted, inputs, DType::Float64, options.weight_seed).loss;
      shifted[i][j] = point[i][j] - options.eps;
      const double minus = evaluate(f, shifted, inputs, DType::Float64, options.weight_seed).loss;
      const double numeric = (plus - minus) / (2 * options.eps);
      const double a = analytic[i][j];
      const double allowed = options.atol + options.rtol * std::abs(numeric);
      const double excess = std::isfinite(a) ? std::abs(a - numeric) - allowed : INFINITY;
      const std::string line =
          fmt::format("input {} {} element {} (x = {:.6g}): analytic {:.10g}, numeric {:.10g}, |diff| {:.3g}",
                      i, shape_str(inputs[i].shape()), j, point[i][j], a, numeric, std::abs(a - numeric));
      if (excess > 0) {
        result.ok = false;
        if (++failures <= 20) result.report += "FAIL " + line + "\n";
      }
      if (excess > worst_excess || worst.empty()) worst_excess = excess, worst = line;
    }
    if (!worst.empty()) result.report += "worst " + worst + "\n";
  }
  if (failures > 20) result.report += fmt::format("... {} failures in all\n", failures);
  return result;
}

Tensor uniform(Shape shape, double lo, double hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(static_cast<size_t>(numel(shape)));
  for (double& x : v) x = dist(rng);
  return from_vector<double>(v, std::move(shape));
}

Tensor away_from_zero(Shape shape, double lo, double hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::bernoulli_distribution negative(0.5);
  std::vector<double> v(static_cast<size_t>(numel(shape)));
  for (double& x : v) x = (negative(rng) ? -1.0 : 1.0) * dist(rng);
  return from_vector<double>(v, std::move(shape));
}

Tensor distinct(Shape shape, double gap, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> v(static_cast<size_t>(numel(shape)));
  std::iota(v.begin(), v.end(), 0.0);
  std::shuffle(v.begin(), v.end(), rng);
  std::uniform_real_distribution<double> noise(0.0, 0.25 * gap);
  const double center = 0.5 * static_cast<double>(v.size() - 1);
  for (double& x : v) x = (x - center) * gap + noise(rng);
  return from_vector<double>(v, std::move(shape));
}

}  // namespace kiln::testing
