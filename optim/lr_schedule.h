// Learning-rate schedules. A schedule reads each group's learning rate when it is made (the base
// lr), sets lr_at(0) at once, and each step() advances one step and calls set_group_lr. Call
// step() once per epoch or per batch, after opt.step(), as in PyTorch.
//
//   kiln::optim::SGD opt(params, kiln::optim::SGDOptions(0.1));
//   kiln::optim::StepLR schedule(opt, /*step_size=*/2, /*gamma=*/0.5);
//   // lr(): 0.1, 0.1, 0.05, 0.05, 0.025, ... (before the first step(), after one, ...)
//   for (...) { opt.step(loss); schedule.step(); }
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "optim/optimizer.h"

namespace kiln::optim {

class LRSchedule {
 public:
  explicit LRSchedule(Optimizer& optimizer);
  virtual ~LRSchedule() = default;

  void step();                                      // one more step; sets the new lr
  double lr() const { return optimizer_.lr(); }     // group 0's current lr
  int64_t steps() const { return steps_; }          // step() calls so far
  // The lr after `step` steps for a group whose base lr is `base_lr`.
  virtual double lr_at(int64_t step, double base_lr) const = 0;

 protected:
  void apply();  // sets every group's lr for steps_; derived constructors call it

 private:
  Optimizer& optimizer_;
  std::vector<double> base_lrs_;
  int64_t steps_ = 0;
};

// lr = base * gamma^floor(step / step_size). step_size 2, gamma 0.5, base 1: 1, 1, .5, .5, .25, ...
class StepLR : public LRSchedule {
 public:
  StepLR(Optimizer& optimizer, int64_t step_size, double gamma = 0.1);
  double lr_at(int64_t step, double base_lr) const override;

 private:
  int64_t step_size_;
  double gamma_;
};

// lr = eta_min + (base - eta_min) * (1 + cos(pi * step / T_max)) / 2 (PyTorch's closed form), so
// base at step 0 and eta_min at step T_max; past T_max it stays at eta_min.
// T_max 4, base 1, eta_min 0: 1, 0.8536, 0.5, 0.1464, 0, 0, ...
class CosineAnnealingLR : public LRSchedule {
 public:
  CosineAnnealingLR(Optimizer& optimizer, int64_t T_max, double eta_min = 0.0);
  double lr_at(int64_t step, double base_lr) const override;

 private:
  int64_t T_max_;
  double eta_min_;
};

// Linear warm-up: lr = base * (step + 1) / warmup_steps for step < warmup_steps; then the base
// lr, or `then`'s lr_at(step - warmup_steps) when given (`then` is only asked for values: do not
// step it yourself). warmup_steps 4, base 1: 0.25, 0.5, 0.75, 1, then 1, 1, ... or then(0),
// then(1), ...
class LinearWarmup : public LRSchedule {
 public:
  LinearWarmup(Optimizer& optimizer, int64_t warmup_steps, std::shared_ptr<const LRSchedule> then = nullptr);
  double lr_at(int64_t step, double base_lr) const override;

 private:
  int64_t warmup_steps_;
  std::shared_ptr<const LRSchedule> then_;
};

}  // namespace kiln::optim
