// GradScaler: see grad_scaler.h.
#include "optim/grad_scaler.h"

#include <cmath>
#include <limits>
#include <tuple>

#include "core/autograd.h"
#include "core/error.h"
#include "ops/ops.h"

namespace kiln::optim {

namespace {

constexpr const char* kOp = "optim::GradScaler";

void check(const GradScalerOptions& o) {
  KILN_CHECK(o.init_scale() > 0 && std::isfinite(o.init_scale()), kOp,
             "init_scale must be positive and finite, got {}; PyTorch's default is 65536 (2^16)", o.init_scale());
  KILN_CHECK(o.growth_factor() > 1 && std::isfinite(o.growth_factor()), kOp,
             "growth_factor must be finite and greater than 1, got {}; the default is 2", o.growth_factor());
  KILN_CHECK(o.backoff_factor() > 0 && o.backoff_factor() < 1, kOp,
             "backoff_factor must lie in (0, 1), got {}; the default is 0.5", o.backoff_factor());
  KILN_CHECK(o.growth_interval() >= 1, kOp, "growth_interval must be at least 1, got {}; the default is 2000",
             o.growth_interval());
}

// A Bool scalar: does `u` hold an inf or NaN? u - u is 0 for every finite value and NaN for inf
// and NaN (no fast-math anywhere in kiln's kernels, so it is not folded away); the max over u
// fuses with the elementwise work that produced u (the unscale) into one reduction kernel.
Tensor has_inf_or_nan(const Tensor& u) {
  Tensor d = u - u;
  return max(cast(ne(d, zeros_like(d)), DType::Float32)) > zeros({}, DType::Float32);
}

void check_state_entry(const std::map<std::string, Tensor>& state, const std::string& key, DType dtype) {
  auto it = state.find(key);
  KILN_CHECK(it != state.end() && it->second.defined(), kOp,
             "load_state: the state has no `{}`; pass what GradScaler::state() returned (\"scale\", "
             "\"growth_tracker\")", key);
  const Tensor& t = it->second;
  KILN_CHECK(t.dim() == 0 && t.dtype() == dtype, kOp, "load_state: `{}` must be a {} scalar, got {}", key,
             dtype_name(dtype), t.str());
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(options) { check(options_); }

void GradScaler::place_on(Device device) {
  if (scale_.defined() && scale_.device() == device) return;
  KILN_CHECK(!scale_.defined() || progress_.empty(), kOp,
             "the scale is on {} but this loss is on {}; one scaler serves one device", scale_.device().str(),
             device.str());
  NoGradGuard no_grad;
  if (!scale_.defined()) {
    // Realized now, so the first step's graph is the same as every later one's and the plan
    // cache serves all of them (as the optimizer's zero state).
    scale_ = full({}, options_.init_scale(), DType::Float32).to(device);
    growth_tracker_ = full({}, 0, DType::Int32).to(device);
  } else {  // loaded state
    scale_ = scale_.to(device);
    growth_tracker_ = growth_tracker_.to(device);
  }
  sync({scale_, growth_tracker_});
}

Tensor GradScaler::scale(const Tensor& loss) {
  if (!is_enabled()) return loss;
  KILN_CHECK(loss.defined(), kOp, "scale: the loss is an undefined tensor");
  KILN_CHECK(is_floating(loss.dtype()), kOp, "scale: the loss must be a floating tensor, got {}", loss.str());
  place_on(loss.device());
  return loss * scale_;
}

Tensor GradScaler::unscale(std::vector<Tensor>& grads) const {
  NoGradGuard no_grad;
  Tensor inv_scale = reciprocal(scale_);
  Tensor found;  // Bool: some gradient so far holds an inf or NaN
  for (Tensor& g : grads) {
    if (!g.defined()) continue;
    KILN_CHECK(g.device() == scale_.device(), kOp,
               "a gradient {} is on {} but the scale is on {}; one scaler serves the parameters of one device",
               g.str(), g.device().str(), scale_.device().str());
    g = cast(g * inv_scale, g.dtype());
    Tensor bad = has_inf_or_nan(g);
    found = found.defined() ? logical_or(found, bad) : bad;
  }
  return found.defined() ? found : cast(zeros_like(scale_), DType::Bool);  // no gradients: false, on the device
}

void GradScaler::unscale_(Optimizer& optimizer) {
  if (!is_enabled()) return;
  Progress& progress = progress_[&optimizer];
  KILN_CHECK(!progress.unscaled, kOp,
             "unscale_ has already been called on this optimizer since the last update(); call it once per step");
  KILN_CHECK(!progress.stepped, kOp, "unscale_ is being called after step(); call it before step(), then update()");
  KILN_CHECK(scale_.defined(), kOp,
             "unscale_ before any scale(loss): scale the loss (scaler.scale(loss).backward()) first");
  std::vector<Tensor> params = optimizer.parameters();
  std::vector<Tensor> grads;
  for (const Tensor& p : params) grads.push_back(p.grad());
  progress.found_inf = unscale(grads);
  for (size_t i = 0; i < params.size(); ++i)
    if (grads[i].defined()) params[i].set_grad(grads[i]);
  progress.unscaled = true;
  next_scale_ = next_growth_tracker_ = Tensor();  // the next step computes them with this found_inf
}

void GradScaler::step_outputs(Optimizer& optimizer, std::vector<Tensor> outputs) {
  if (!is_enabled()) return optimizer.step(outputs);
  Progress& progress = progress_[&optimizer];
  KILN_CHECK(!progress.stepped, kOp,
             "step() has already been called on this optimizer since the last update(); call update() once per step");
  if (!progress.unscaled) unscale_(optimizer);
  std::vector<Tensor> grads;
  for (const Tensor& p : optimizer.parameters()) grads.push_back(p.grad());
  apply(optimizer, std::move(grads), progress.found_inf, std::move(outputs));
}

void GradScaler::step_loss(Optimizer& optimizer, const Tensor& loss, std::vector<Tensor> outputs) {
  if (!is_enabled()) return optimizer.step(loss, outputs);
  Progress& progress = progress_[&optimizer];
  KILN_CHECK(!progress.stepped, kOp,
             "step() has already been called on this optimizer since the last update(); call update() once per step");
  KILN_CHECK(!progress.unscaled, kOp,
             "step(optimizer, loss) takes the gradients of the loss itself, but unscale_ already unscaled p.grad(); "
             "use step(optimizer) after backward(), or drop the unscale_");
  std::vector<Tensor> grads = optimizer.gradients(scale(loss));
  progress.found_inf = unscale(grads);
  progress.unscaled = true;
  outputs.insert(outputs.begin(), loss);
  apply(optimizer, std::move(grads), progress.found_inf, std::move(outputs));
}

void GradScaler::apply(Optimizer& optimizer, std::vector<Tensor> grads, const Tensor& found_inf,
                       std::vector<Tensor> outputs) {
  // The next scale and tracker are computed in the step's plan, so update() has nothing left to
  // run and no lazy graph piles up from one step to the next.
  auto [scale, tracker] = next_scale_and_tracker();
  for (const Tensor& t : {found_inf, scale, tracker, scale_, growth_tracker_})
    if (!t.is_realized()) outputs.push_back(t);
  optimizer.apply_gradients(std::move(grads), std::move(outputs), found_inf);
  progress_[&optimizer].stepped = true;
  next_scale_ = scale;
  next_growth_tracker_ = tracker;
}

std::pair<Tensor, Tensor> GradScaler::next_scale_and_tracker() const {
  NoGradGuard no_grad;
  Tensor found;
  for (const auto& [_, progress] : progress_)
    if (progress.found_inf.defined())
      found = found.defined() ? logical_or(found, progress.found_inf) : progress.found_inf;
  KILN_CHECK(found.defined(), kOp,
             "update() without an inf check since the last update(): call step() (or unscale_) first");
  const Tensor zero = zeros_like(growth_tracker_);
  Tensor clean_steps = growth_tracker_ + 1;  // int32
  Tensor grow = clean_steps >= full({}, static_cast<double>(options_.growth_interval()), DType::Int32);
  Tensor grown = scale_ * options_.growth_factor();
  Tensor grown_finite = grown <= full({}, std::numeric_limits<float>::max(), DType::Float32);
  Tensor scale = where(found, scale_ * options_.backoff_factor(),
                       where(logical_and(grow, grown_finite), grown, scale_));
  Tensor tracker = where(logical_or(found, grow), zero, clean_steps);
  return {scale, tracker};
}

void GradScaler::update() {
  if (!is_enabled()) return;
  if (!next_scale_.defined()) std::tie(next_scale_, next_growth_tracker_) = next_scale_and_tracker();
  scale_ = next_scale_;
  growth_tracker_ = next_growth_tracker_;
  next_scale_ = next_growth_tracker_ = Tensor();
  progress_.clear();
}

double GradScaler::get_scale() const {
  if (!is_enabled()) return 1.0;
  return scale_.defined() ? scale_.item() : options_.init_scale();
}

std::map<std::string, Tensor> GradScaler::state() const {
  if (!is_enabled()) return {};
  if (!scale_.defined())
    return {{"scale", full({}, options_.init_scale(), DType::Float32)}, {"growth_tracker", full({}, 0, DType::Int32)}};
  return {{"scale", scale_}, {"growth_tracker", growth_tracker_}};
}

void GradScaler::load_state(const std::map<std::string, Tensor>& state) {
  if (!is_enabled()) return;
  for (const auto& [key, _] : state)
    KILN_CHECK(key == "scale" || key == "growth_tracker", kOp,
               "load_state: unknown key `{}`; a scaler's state is \"scale\" and \"growth_tracker\"", key);
  check_state_entry(state, "scale", DType::Float32);
  check_state_entry(state, "growth_tracker", DType::Int32);
  Tensor scale = state.at("scale").detach(), tracker = state.at("growth_tracker").detach();
  const double s = scale.item(), t = tracker.item();
  KILN_CHECK(s > 0 && std::isfinite(s), kOp, "load_state: `scale` must be positive and finite, got {}", s);
  KILN_CHECK(t >= 0, kOp, "load_state: `growth_tracker` must not be negative, got {}", t);
  if (scale_.defined()) {  // keep the device the scaler works on
    scale = scale.to(scale_.device());
    tracker = tracker.to(scale_.device());
  }
  scale_ = scale;
  growth_tracker_ = tracker;
  next_scale_ = next_growth_tracker_ = Tensor();
}

}  // namespace kiln::optim
