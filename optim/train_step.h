// A training step recorded once and then replayed: forward, loss, backward and the optimizer's
// update run as the step's cached plan on each new batch, with nothing recorded, collected or
// torn down per step (on 2 cores that is ~100 us of the Fashion-MNIST MLP's step).
//
//   kiln::optim::TrainStep step(opt, [&](const std::vector<Tensor>& batch) {
//     return nn::cross_entropy(model.forward(batch[0]), batch[1]);  // the loss (or {loss, metrics...})
//   });
//   for (data::Batch& b : loader) double loss = step({b.input, b.target})[0].item();
//
// A call is `outputs = fn(batch); opt.step(outputs[0], rest of outputs)`, its outputs realized.
// The first call runs it so (the optimizer creates its state); the second records it once more
// and keeps its plan; later calls replay that plan on the new batch, the optimizer's current
// values (parameters, their autocast copies, state, sync_with_step tensors, p.grad()), its
// update_scalars() for the advanced step counts (a scheduler's learning rate, Adam's bias
// corrections) and fresh random keys (dropout): the same values a recorded step computes, bit for
// bit. Host code in fn runs only when a step is recorded; any other value fn reads is a constant
// of the recorded step, as a closed-over array is under jax.jit.
//
// A step is recorded again when the batch's shapes or types change (a few recordings are kept: an
// epoch's last, partial batch), when a hyperparameter other than lr changes, when the optimizer's
// tensors are not those recorded (load_state) or an autocast copy the step read is gone, or when
// the plan cache was cleared. A step that cannot be replayed runs as fn + opt.step on every call,
// and says why (replaying(), why_not_replayed()): fn or the optimizer reads a value on the host
// within the step (item(), GradScaler), a DataParallel reduces the gradients, fn assigns a tensor
// the optimizer does not know (give BatchNorm's buffers to opt.sync_with_step), or an optimizer's
// update() records a host number its update_scalars() does not give.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "core/tensor.h"
#include "optim/optimizer.h"

namespace kiln::optim {

class TrainStep {
 public:
  // fn(batch): the loss, then any values to compute with the step (metrics).
  using Function = std::function<std::vector<Tensor>(const std::vector<Tensor>& batch)>;
  TrainStep(Optimizer& optimizer, Function fn);
  // A function returning only the loss.
  template <class F>
    requires std::is_convertible_v<std::invoke_result_t<F&, const std::vector<Tensor>&>, Tensor>
  TrainStep(Optimizer& optimizer, F fn)
      : TrainStep(optimizer, Function([fn = std::move(fn)](const std::vector<Tensor>& batch) mutable {
          return std::vector<Tensor>{Tensor(fn(batch))};
        })) {}
  ~TrainStep();
  TrainStep(const TrainStep&) = delete;
  TrainStep& operator=(const TrainStep&) = delete;

  // One training step on `batch`: fn's outputs, realized.
  std::vector<Tensor> operator()(const std::vector<Tensor>& batch);

  bool replaying() const { return why_not_.empty(); }
  const std::string& why_not_replayed() const { return why_not_; }
  int64_t replays() const { return replays_; }      // calls that replayed a recorded step
  int64_t recordings() const { return recordings_; }  // steps recorded for replay

 private:
  struct Recording;
  std::vector<Tensor> run_eagerly(const std::vector<Tensor>& batch);
  std::vector<Tensor> record(const std::vector<Tensor>& batch);
  Recording* find(const std::vector<Tensor>& batch, const std::vector<std::shared_ptr<Var>>& vars);
  std::vector<Tensor> replay(Recording& r, const std::vector<Tensor>& batch,
                             const std::vector<std::shared_ptr<Var>>& vars);

  Optimizer& opt_;
  Function fn_;
  std::vector<std::unique_ptr<Recording>> recordings_kept_;  // most recently used first
  std::string why_not_;
  int64_t replays_ = 0, recordings_ = 0, calls_ = 0;
};

}  // namespace kiln::optim
