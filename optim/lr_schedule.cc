// Learning-rate schedules: see lr_schedule.h for the sequences.
#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace kiln::optim {

LRSchedule::LRSchedule(Optimizer& optimizer) : optimizer_(optimizer) {
  for (size_t g = 0; g < optimizer.group_count(); ++g) base_lrs_.push_back(optimizer.group_lr(g));
}

void LRSchedule::step() {
  ++steps_;
  apply();
}

void LRSchedule::apply() {
  for (size_t g = 0; g < base_lrs_.size(); ++g) optimizer_.set_group_lr(g, lr_at(steps_, base_lrs_[g]));
}

StepLR::StepLR(Optimizer& optimizer, int64_t step_size, double gamma)
    : LRSchedule(optimizer), step_size_(step_size), gamma_(gamma) {
  KILN_CHECK(step_size > 0, "optim::StepLR", "step_size must be positive, got {}", step_size);
  apply();
}

double StepLR::lr_at(int64_t step, double base_lr) const {
  return base_lr * std::pow(gamma_, static_cast<double>(step / step_size_));
}

CosineAnnealingLR::CosineAnnealingLR(Optimizer& optimizer, int64_t T_max, double eta_min)
    : LRSchedule(optimizer), T_max_(T_max), eta_min_(eta_min) {
  KILN_CHECK(T_max > 0, "optim::CosineAnnealingLR", "T_max must be positive, got {}", T_max);
  apply();
}

double CosineAnnealingLR::lr_at(int64_t step, double base_lr) const {
  double progress = static_cast<double>(std::min(step, T_max_)) / static_cast<double>(T_max_);
  return eta_min_ + (base_lr - eta_min_) * (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
}

LinearWarmup::LinearWarmup(Optimizer& optimizer, int64_t warmup_steps, std::shared_ptr<const LRSchedule> then)
    : LRSchedule(optimizer), warmup_steps_(warmup_steps), then_(std::move(then)) {
  KILN_CHECK(warmup_steps > 0, "optim::LinearWarmup", "warmup_steps must be positive, got {}", warmup_steps);
  apply();
}

double LinearWarmup::lr_at(int64_t step, double base_lr) const {
  if (step < warmup_steps_) return base_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps_);
  return then_ ? then_->lr_at(step - warmup_steps_, base_lr) : base_lr;
}

}  // namespace kiln::optim
