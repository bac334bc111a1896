// SGD: see sgd.h for the update rule.
#include "optim/sgd.h"

#include "core/error.h"
#include "ops/ops.h"

namespace kiln::optim {

namespace {
void check(const SGDOptions& o) {
  KILN_CHECK(o.lr() >= 0 && o.momentum() >= 0 && o.weight_decay() >= 0, "optim::SGD",
             "lr {}, momentum {} and weight_decay {} must not be negative", o.lr(), o.momentum(), o.weight_decay());
  KILN_CHECK(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0), "optim::SGD",
             "Nesterov momentum needs momentum > 0 and dampening 0 (got momentum {}, dampening {})", o.momentum(),
             o.dampening());
}
}  // namespace

SGD::SGD(std::vector<Tensor> params, SGDOptions options)
    : SGD(std::vector<ParamGroup<SGDOptions>>{{std::move(params), options}}) {}

SGD::SGD(std::vector<ParamGroup<SGDOptions>> groups) : OptimizerWith(std::move(groups)) {
  for (const auto& g : groups_) check(g.options);
}

Hyperparameters SGD::to_hyperparameters(const SGDOptions& o) const {
  return {{"lr", o.lr()},
          {"momentum", o.momentum()},
          {"dampening", o.dampening()},
          {"nesterov", o.nesterov() ? 1.0 : 0.0},
          {"weight_decay", o.weight_decay()}};
}

SGDOptions SGD::from_hyperparameters(const Hyperparameters& h) const {
  check_hyperparameter_names(h, {"lr", "momentum", "dampening", "nesterov", "weight_decay"}, "SGD");
  double nesterov = hyperparameter(h, "nesterov", "SGD");
  KILN_CHECK(nesterov == 0 || nesterov == 1, "optim::SGD", "nesterov must be 0 or 1, got {}", nesterov);
  SGDOptions o = SGDOptions(hyperparameter(h, "lr", "SGD"))
                     .momentum(hyperparameter(h, "momentum", "SGD"))
                     .dampening(hyperparameter(h, "dampening", "SGD"))
                     .nesterov(nesterov == 1)
                     .weight_decay(hyperparameter(h, "weight_decay", "SGD"));
  check(o);
  return o;
}

std::vector<std::string> SGD::state_names(size_t group) const {
  if (groups_[group].options.momentum() == 0) return {};
  return {"momentum_buffer"};
}

namespace {
enum SgdScalar : size_t { kWeightDecay, kKeep, kTake, kMomentum, kLr };
}  // namespace

std::vector<double> SGD::update_scalars(size_t group, const ParamState& state) const {
  const SGDOptions& o = groups_[group].options;
  check(o);  // a replayed step (TrainStep) refuses a bad lr as update() does
  // The buffer starts as zeros, so the first step's `buf = g` is `0 * buf + 1 * g`: the same
  // graph as every later step, with different run-time scalars.
  const bool first = state.step == 1;
  return {o.weight_decay(), first ? 0.0 : o.momentum(), first ? 1.0 : 1.0 - o.dampening(), o.momentum(), o.lr()};
}

void SGD::update(size_t group, Tensor& param, const Tensor& grad, ParamState& state) {
  const SGDOptions& o = groups_[group].options;
  check(o);
  Tensor g = grad;
  if (o.weight_decay() != 0) g = g + param * scalar(kWeightDecay, param);
  if (o.momentum() != 0) {
    Tensor& buf = state.tensors.at("momentum_buffer");
    assign(buf, buf * scalar(kKeep, buf) + g * scalar(kTake, g));
    g = o.nesterov() ? g + buf * scalar(kMomentum, buf) : buf;
  }
  assign(param, param - g * scalar(kLr, g));
}

}  // namespace kiln::optim
