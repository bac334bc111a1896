// Stochastic gradient descent with momentum, dampening, Nesterov and weight decay, with
// PyTorch's update rule (torch.optim.SGD), for each parameter p with gradient g:
//
//   g = g + weight_decay * p                      (if weight_decay != 0)
//   buf = g                                       (first step, if momentum != 0)
//   buf = momentum * buf + (1 - dampening) * g    (later steps)
//   g = nesterov ? g + momentum * buf : buf       (if momentum != 0)
//   p = p - lr * g
//
//   kiln::optim::SGD opt(params, kiln::optim::SGDOptions(0.05).momentum(0.9).nesterov(true));
#pragma once
#include "optim/optimizer.h"

namespace kiln::optim {

struct SGDOptions {
  explicit SGDOptions(double lr) : lr_(lr) {}
  KILN_OPTION(double, lr, 0.0)
  KILN_OPTION(double, momentum, 0.0)
  KILN_OPTION(double, dampening, 0.0)
  KILN_OPTION(bool, nesterov, false)
  KILN_OPTION(double, weight_decay, 0.0)
};

class SGD : public OptimizerWith<SGDOptions> {
 public:
  SGD(std::vector<Tensor> params, SGDOptions options);
  explicit SGD(std::vector<ParamGroup<SGDOptions>> groups);
  std::string type_name() const override { return "SGD"; }

 protected:
  Hyperparameters to_hyperparameters(const SGDOptions& o) const override;
  SGDOptions from_hyperparameters(const Hyperparameters& h) const override;
  void update(size_t group, Tensor& param, const Tensor& grad, ParamState& state) override;
  std::vector<double> update_scalars(size_t group, const ParamState& state) const override;
  std::vector<std::string> state_names(size_t group) const override;
};

}  // namespace kiln::optim
