// Adam and AdamW: see adam.h for the update rules.
#include "optim/adam.h"

#include <cmath>

#include "core/error.h"
#include "ops/ops.h"

namespace kiln::optim {

namespace {
void check(const AdamOptions& o) {
  KILN_CHECK(o.lr() >= 0 && o.eps() >= 0 && o.weight_decay() >= 0, "optim::Adam",
             "lr {}, eps {} and weight_decay {} must not be negative", o.lr(), o.eps(), o.weight_decay());
  KILN_CHECK(o.beta1() >= 0 && o.beta1() < 1 && o.beta2() >= 0 && o.beta2() < 1, "optim::Adam",
             "betas must lie in [0, 1), got ({}, {})", o.beta1(), o.beta2());
}
}  // namespace

Adam::Adam(std::vector<Tensor> params, AdamOptions options)
    : Adam(std::vector<ParamGroup<AdamOptions>>{{std::move(params), options}}) {}

Adam::Adam(std::vector<ParamGroup<AdamOptions>> groups, bool decoupled_weight_decay)
    : OptimizerWith(std::move(groups)), decoupled_weight_decay_(decoupled_weight_decay) {
  for (const auto& g : groups_) check(g.options);
}

AdamW::AdamW(std::vector<Tensor> params, AdamOptions options)
    : Adam(std::vector<ParamGroup<AdamOptions>>{{std::move(params), options}}, true) {}

Hyperparameters Adam::to_hyperparameters(const AdamOptions& o) const {
  return {{"lr", o.lr()}, {"beta1", o.beta1()}, {"beta2", o.beta2()}, {"eps", o.eps()}, {"weight_decay", o.weight_decay()}};
}

AdamOptions Adam::from_hyperparameters(const Hyperparameters& h) const {
  const std::string name = type_name();
  check_hyperparameter_names(h, {"lr", "beta1", "beta2", "eps", "weight_decay"}, name);
  AdamOptions o = AdamOptions(hyperparameter(h, "lr", name))
                      .betas(hyperparameter(h, "beta1", name), hyperparameter(h, "beta2", name))
                      .eps(hyperparameter(h, "eps", name))
                      .weight_decay(hyperparameter(h, "weight_decay", name));
  check(o);
  return o;
}

namespace {
enum AdamScalar : size_t { kDecay, kWeightDecay, kBeta1, kOneMinusBeta1, kBeta2, kOneMinusBeta2, kInvSqrtBc2, kEps, kStepSize };
}  // namespace

std::vector<double> Adam::update_scalars(size_t group, const ParamState& state) const {
  const AdamOptions& o = groups_[group].options;
  check(o);  // a replayed step (TrainStep) refuses a bad lr as update() does
  const double t = static_cast<double>(state.step);
  const double bias_correction1 = 1.0 - std::pow(o.beta1(), t);
  const double bias_correction2 = 1.0 - std::pow(o.beta2(), t);
  return {1.0 - o.lr() * o.weight_decay(), o.weight_decay(), o.beta1(), 1.0 - o.beta1(), o.beta2(), 1.0 - o.beta2(),
          1.0 / std::sqrt(bias_correction2), o.eps(), o.lr() / bias_correction1};
}

void Adam::update(size_t group, Tensor& param, const Tensor& grad, ParamState& state) {
  const AdamOptions& o = groups_[group].options;
  check(o);
  Tensor g = grad;
  Tensor p = param;
  if (o.weight_decay() != 0) {
    if (decoupled_weight_decay_) p = p * scalar(kDecay, p);
    else g = g + param * scalar(kWeightDecay, param);
  }
  Tensor& m = state.tensors.at("exp_avg");     // shaped like param
  Tensor& v = state.tensors.at("exp_avg_sq");  // shaped like param
  assign(m, m * scalar(kBeta1, m) + g * scalar(kOneMinusBeta1, g));
  Tensor gg = g * g;
  assign(v, v * scalar(kBeta2, v) + gg * scalar(kOneMinusBeta2, gg));
  Tensor root = sqrt(v);
  Tensor denom = root * scalar(kInvSqrtBc2, root);
  denom = denom + scalar(kEps, denom);
  Tensor step = m * scalar(kStepSize, m);
  assign(param, p - step / denom);
}

}  // namespace kiln::optim
