// Adam and AdamW with PyTorch's update rules (torch.optim.Adam / AdamW, amsgrad off). For each
// parameter p with gradient g at step t (1, 2, ...):
//
//   g = g + weight_decay * p                      (Adam, if weight_decay != 0)
//   p = p * (1 - lr * weight_decay)               (AdamW: decoupled decay)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   p = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//
// The step-dependent factors are numbers bound at run time, so every step replays one plan.
//
//   kiln::optim::Adam opt(params, kiln::optim::AdamOptions(1e-3).betas(0.9, 0.999));
//   kiln::optim::AdamW optw(params, kiln::optim::AdamWOptions(1e-3));  // weight_decay 0.01
#pragma once
#include "optim/optimizer.h"

namespace kiln::optim {

struct AdamOptions {
  explicit AdamOptions(double lr = 1e-3) : lr_(lr) {}
  KILN_OPTION(double, lr, 1e-3)
  KILN_OPTION(double, beta1, 0.9)
  KILN_OPTION(double, beta2, 0.999)
  KILN_OPTION(double, eps, 1e-8)
  KILN_OPTION(double, weight_decay, 0.0)
  AdamOptions& betas(double b1, double b2) {
    beta1_ = b1;
    beta2_ = b2;
    return *this;
  }
};

// AdamW's defaults: PyTorch's weight_decay of 0.01.
inline AdamOptions AdamWOptions(double lr = 1e-3) { return AdamOptions(lr).weight_decay(0.01); }

class Adam : public OptimizerWith<AdamOptions> {
 public:
  Adam(std::vector<Tensor> params, AdamOptions options);
  explicit Adam(std::vector<ParamGroup<AdamOptions>> groups, bool decoupled_weight_decay = false);
  std::string type_name() const override { return decoupled_weight_decay_ ? "AdamW" : "Adam"; }

 protected:
  Hyperparameters to_hyperparameters(const AdamOptions& o) const override;
  AdamOptions from_hyperparameters(const Hyperparameters& h) const override;
  void update(size_t group, Tensor& param, const Tensor& grad, ParamState& state) override;
  std::vector<double> update_scalars(size_t group, const ParamState& state) const override;
  std::vector<std::string> state_names(size_t) const override { return {"exp_avg", "exp_avg_sq"}; }

 private:
  bool decoupled_weight_decay_;
};

// Adam with weight decay applied to the parameter directly (Loshchilov & Hutter), not to the
// gradient.
class AdamW : public Adam {
 public:
  AdamW(std::vector<Tensor> params, AdamOptions options = AdamWOptions());
  explicit AdamW(std::vector<ParamGroup<AdamOptions>> groups) : Adam(std::move(groups), true) {}
};

}  // namespace kiln::optim
