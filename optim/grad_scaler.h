// GradScaler: dynamic loss scaling for mixed precision (torch.amp.GradScaler's API and defaults),
// decided on the device. The loss is multiplied by a scale S before the backward so that small
// float16 gradients do not underflow to zero; the gradients are divided by S before the update.
// A step whose gradients hold an inf or NaN is skipped and S is halved; after growth_interval
// clean steps in a row S is doubled.
//
//   kiln::optim::GradScaler scaler;                  // init_scale 2^16, growth 2 every 2000 steps
//   kiln::optim::Adam opt(net.parameters(), kiln::optim::AdamOptions(1e-3));
//   // PyTorch style:
//   opt.zero_grad();
//   scaler.scale(loss).backward();
//   scaler.step(opt, {loss});                        // unscales p.grad(), steps unless inf/NaN
//   scaler.update();                                 // next scale
//   // Jittor style: gradients of the scaled loss, unscaled and applied, loss realized, one plan
//   scaler.step(opt, loss);
//   scaler.update();
//
// No host read. PyTorch's scaler reads found_inf on the host every step to decide whether to call
// optimizer.step(). Here the inf/NaN check is a reduction fused into the unscale (one Bool
// found_inf per step, on the device), the skip is a select inside the update kernels
// (p = where(found_inf, p, p_new) for every parameter and every state tensor: see
// Optimizer::apply_gradients), and the next scale and growth tracker are computed in the step's
// own plan. A step with a scaler runs one plan, as a step without one: a few more kernels (one
// reduction per gradient and three scalar kernels), no more realizes, and from the second step
// on the same cached plan, updating the parameters in place.
//
// Deviations from PyTorch that follow from never reading found_inf on the host:
// - optimizer counters on the host advance on a skipped step: Adam's bias correction after a
//   skipped step uses t + 1 (PyTorch: t); an SGD momentum buffer still at zero after a skipped first
//   step is updated as momentum * 0 + (1 - dampening) * g on the next one (PyTorch: g; the same
//   unless dampening != 0).
// - update(new_scale) is not offered; set a scale with load_state.
//
// Every parameter with a gradient must be on the device of the loss scaled first (one scaler,
// one device). enabled(false) makes every method a pass-through (scale(loss) is loss, step is
// opt.step), so one code path serves both. Save the scaler with its optimizer:
//   kiln::optim::save(opt, scaler, "net.optim.safetensors");   // optim/serialize.h
//   kiln::optim::load(opt, scaler, "net.optim.safetensors");
#pragma once
#include <map>
#include <string>
#include <vector>

#include "core/options.h"
#include "core/tensor.h"
#include "optim/optimizer.h"

namespace kiln::optim {

struct GradScalerOptions {
  KILN_OPTION(double, init_scale, 65536.0)   // 2^16
  KILN_OPTION(double, growth_factor, 2.0)    // > 1
  KILN_OPTION(double, backoff_factor, 0.5)   // in (0, 1)
  KILN_OPTION(int64_t, growth_interval, 2000)  // clean steps in a row before the scale grows
  KILN_OPTION(bool, enabled, true)
};

class GradScaler {
 public:
  // Throws kiln::Error for a non-positive or non-finite init_scale, growth_factor <= 1,
  // backoff_factor outside (0, 1), or growth_interval < 1.
  explicit GradScaler(GradScalerOptions options = {});

  // loss * scale, recorded lazily (the scale is a float32 scalar on the loss's device; a float16
  // loss gives a float32 product).
  Tensor scale(const Tensor& loss);

  // Divides every p.grad() of `optimizer` by the scale (set_grad, lazily) and records whether any
  // of them holds an inf or NaN. At most once per optimizer between update()s, and not after
  // step(): call it before clipping gradients (clip_grad_norm) so the clipping sees true values.
  void unscale_(Optimizer& optimizer);

  // PyTorch style: unscales p.grad() (unless unscale_ did) and updates the parameters unless a
  // gradient holds an inf or NaN, realizing `outputs` (the loss, metrics) in the same plan.
  void step(Optimizer& optimizer, std::initializer_list<Tensor> outputs = {}) {
    step_outputs(optimizer, {outputs.begin(), outputs.end()});
  }
  template <TensorRange R> void step(Optimizer& optimizer, R&& outputs) {
    step_outputs(optimizer, to_tensors(std::forward<R>(outputs)));
  }
  // Jittor style, like optimizer.step(loss): the gradients of scale(loss), unscaled and applied
  // unless one holds an inf or NaN, with `loss` and `outputs` realized, all in one plan.
  void step(Optimizer& optimizer, const Tensor& loss, std::initializer_list<Tensor> outputs = {}) {
    step_loss(optimizer, loss, {outputs.begin(), outputs.end()});
  }
  template <TensorRange R> void step(Optimizer& optimizer, const Tensor& loss, R&& outputs) {
    step_loss(optimizer, loss, to_tensors(std::forward<R>(outputs)));
  }

  // Takes the next scale and growth tracker: scale * backoff_factor after a step with an inf or
  // NaN (any optimizer's since the last update), scale * growth_factor after growth_interval clean
  // steps in a row (unless that overflows float32), otherwise the same scale. Call once per
  // iteration, after the step(s); no host read.
  void update();

  // The current scale (reads the device; 1.0 when disabled).
  double get_scale() const;
  bool is_enabled() const { return options_.enabled(); }
  const GradScalerOptions& options() const { return options_; }

  // {"scale": float32 scalar, "growth_tracker": int32 scalar (clean steps in a row)}; {} when
  // disabled. load_state replaces both: a missing or unknown key, a shape other than a scalar, a
  // dtype other than those, a scale that is not positive and finite or a negative tracker throws
  // kiln::Error and leaves the scaler unchanged. A disabled scaler ignores load_state.
  std::map<std::string, Tensor> state() const;
  void load_state(const std::map<std::string, Tensor>& state);

 private:
  template <TensorRange R> static std::vector<Tensor> to_tensors(R&& range) {
    std::vector<Tensor> out;
    for (auto&& t : range) out.push_back(Tensor(t));
    return out;
  }
  void step_outputs(Optimizer& optimizer, std::vector<Tensor> outputs);
  void step_loss(Optimizer& optimizer, const Tensor& loss, std::vector<Tensor> outputs);
  // Creates the scale and tracker on `device` (realized), or moves loaded ones there.
  void place_on(Device device);
  // Divides `grads` by the scale in place (lazily); the Bool "some gradient is inf or NaN".
  Tensor unscale(std::vector<Tensor>& grads) const;
  // Applies `grads` unless `found_inf`, computing the next scale and tracker in the same plan.
  void apply(Optimizer& optimizer, std::vector<Tensor> grads, const Tensor& found_inf, std::vector<Tensor> outputs);
  // The scale and tracker update() takes, from the found_inf of every optimizer so far.
  std::pair<Tensor, Tensor> next_scale_and_tracker() const;

  // Where each optimizer is between two update()s (PyTorch's OptState).
  struct Progress {
    bool unscaled = false, stepped = false;
    Tensor found_inf;  // Bool scalar, set by unscale_ or step
  };

  GradScalerOptions options_;
  Tensor scale_;           // float32 scalar; undefined until the first scale() (or load_state)
  Tensor growth_tracker_;  // int32 scalar: clean steps in a row
  std::map<const Optimizer*, Progress> progress_;
  Tensor next_scale_, next_growth_tracker_;  // computed by the last step for update()
};

}  // namespace kiln::optim
