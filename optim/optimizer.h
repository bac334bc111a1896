// Optimizers: the base class every optimizer derives from, with parameter groups, a first-class
// learning rate, and named state for checkpoints. An update is recorded as lazy ops and run with
// the forward and backward as one plan, so a training step is one fused, cached graph.
//
//   kiln::optim::SGD opt(params, kiln::optim::SGDOptions(0.05).momentum(0.9));
//   opt.zero_grad(); loss.backward(); opt.step();   // PyTorch style: uses p.grad()
//   opt.step(loss);                                  // Jittor style: takes the gradients itself
//   opt.step(loss, {correct});                       // + other values computed in the same plan
//   opt.step(loss, metrics);                         // ... from any range of tensors (vector, span, view)
//   opt.set_lr(0.01);                                // every group; no recompile (lr is bound at run time)
//   auto state = opt.state();                        // {"0.3.momentum_buffer": Tensor, ...}
//   opt.sync_with_step(net.buffers());               // BatchNorm running stats realized with each step
//   kiln::optim::save(opt, "net.optim.safetensors"); // state + hyperparameters (optim/serialize.h)
#pragma once
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <ranges>
#include <string>
#include <vector>

#include "core/options.h"
#include "core/tensor.h"
#include "optim/clip.h"

namespace kiln {
class GradientReducer;  // core/autograd.h
}

namespace kiln::optim {

// The per-parameter state of an optimizer: named tensors shaped like the parameter (momentum,
// Adam moments) and how many updates the parameter has had.
struct ParamState {
  std::map<std::string, Tensor> tensors;
  int64_t step = 0;
};

// Any range whose elements convert to Tensor: std::vector<Tensor>, std::span<const Tensor>,
// std::array, a view over a model's parameters, ...
template <typename R>
concept TensorRange = std::ranges::input_range<R> && std::convertible_to<std::ranges::range_reference_t<R>, Tensor>;

// A group's hyperparameters by name ("lr", "momentum", ...; booleans as 0 or 1).
using Hyperparameters = std::map<std::string, double>;

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // Clears p.grad() of every parameter (the next backward() starts from nothing).
  void zero_grad();
  // Updates every parameter that has a gradient from p.grad(), and runs the updates (one sync of
  // the parameters and their state). Parameters without a gradient are left alone.
  // `outputs` are realized in the same plan: the loss, or metrics of the step such as
  //   opt.step({loss, eq(argmax(logits.detach(), 1), labels).sum()});
  // Realize here whatever you still need that reads the parameters, and let no other handle
  // to it (the logits) outlive the step: a pending value that reads the old parameters keeps
  // them from being updated in place, and computing it after the step runs its part of the
  // forward again. Compute metrics from detached values: one that autograd could still go
  // through counts as pending history too.
  void step(std::initializer_list<Tensor> outputs = {}) { step_outputs({outputs.begin(), outputs.end()}); }
  template <TensorRange R> void step(R&& outputs) { step_outputs(to_tensors(std::forward<R>(outputs))); }
  // Computes d(loss)/d(params) itself (kiln::grad; p.grad() is neither read nor written) and
  // updates every parameter, running loss, gradients, updates and `outputs` as one plan. The
  // graph behind `loss` is consumed; loss.item() afterwards is free.
  void step(const Tensor& loss, std::initializer_list<Tensor> outputs = {}) {
    step_loss(loss, {outputs.begin(), outputs.end()});
  }
  template <TensorRange R> void step(const Tensor& loss, R&& outputs) {
    step_loss(loss, to_tensors(std::forward<R>(outputs)));
  }

  // The two halves of step(loss), for code that changes the gradients in between (GradScaler,
  // optim/grad_scaler.h). gradients(loss) is d(loss)/d(p) for each of parameters(), undefined
  // where p does not require grad (kiln::grad; p.grad() is neither read nor written).
  // apply_gradients updates parameter i from grads[i] (undefined: left alone) and realizes
  // `outputs` in the same plan, as step() does. With `skip` (a Bool scalar on the parameters'
  // device), every value the update assigns becomes where(skip, old, new): when skip is true the
  // parameters and their state (momentum, Adam moments) keep their values bit for bit, decided on
  // the device without a host read. Host-side counters (ParamState::step) advance either way.
  std::vector<Tensor> gradients(const Tensor& loss) const;
  void apply_gradients(std::vector<Tensor> grads, std::vector<Tensor> outputs, const Tensor& skip = {});

  // The learning rate: set_lr sets every group's; lr() reads group 0's.
  void set_lr(double lr);
  double lr() const { return group_lr(0); }
  virtual size_t group_count() const = 0;
  virtual double group_lr(size_t group) const = 0;
  virtual void set_group_lr(size_t group, double lr) = 0;
  virtual const std::vector<Tensor>& group_params(size_t group) const = 0;
  std::vector<Tensor> parameters() const;  // every group's, in order

  // Named state for checkpoints: "{group}.{index}.{name}" for each state tensor and
  // "{group}.{index}.step" (an int64 scalar) for the update count, for every parameter that has
  // state. load_state replaces the whole state (parameters absent from the map start fresh); an
  // unknown key, a shape that does not match, or a parameter with only part of its state (no
  // step, or a state tensor missing) throws kiln::Error and changes nothing.
  std::map<std::string, Tensor> state() const;
  void load_state(const std::map<std::string, Tensor>& state);

  // "SGD", "Adam", "AdamW": what a state file records, so it is not loaded into another kind.
  virtual std::string type_name() const = 0;
  // Every option of group `group` by name, and all groups' replaced at once: a missing, unknown
  // or invalid value throws kiln::Error and changes nothing.
  virtual Hyperparameters hyperparameters(size_t group) const = 0;
  virtual void set_hyperparameters(const std::vector<Hyperparameters>& groups) = 0;

  // Tensors realized in the same plan as every step, when they have a pending update: pass a
  // model's buffers, so BatchNorm's running statistics (lazy assigns recorded by forward) are
  // computed with the step instead of piling up as a pending graph that also keeps the
  // parameters from being updated in place. Replaces what an earlier call gave.
  void sync_with_step(std::vector<Tensor> tensors) { synced_with_step_ = std::move(tensors); }

  // Every later step clips the gradients it applies to a global norm of at most `max_norm` (0:
  // off), as optim::clip_grad_norm, but after a data-parallel wrapper averaged them: each rank
  // then scales by the same norm, where clip_grad_norm before step() sees the rank's own
  // gradients. The norm before clipping of the last step: last_grad_norm() (a float32 0-d
  // tensor, realized with the step). `across` (clip.h): when other processes hold the model's
  // other parameters (pipeline stages), sums their squared norms with this one's.
  void clip_grad_norm(double max_norm, NormCombiner across = {});
  Tensor last_grad_norm() const { return last_grad_norm_; }

 protected:
  // Records the update of parameter `index` of `group` from gradient `grad` (under NoGradGuard):
  // assign(param, ...) and, for state, assign(state.tensors[name], ...). `state.step` has already
  // been incremented. State tensors are created by init_state before the first update.
  virtual void update(size_t group, Tensor& param, const Tensor& grad, ParamState& state) = 0;
  // The numbers update() computes on the host for parameter state `state` of `group` (its step
  // count already advanced): learning rate, bias corrections, ... update() records each as
  // scalar(i, like), so that a step replayed without recording (optim/train_step.h) binds them
  // again from this function: an optimizer whose update() records other host numbers is
  // replayed only while they stay as they were captured (the hyperparameters other than lr).
  virtual std::vector<double> update_scalars(size_t /*group*/, const ParamState& /*state*/) const { return {}; }
  // In update(): update_scalars(group, state)[i] as a run-time constant of `like`'s type and
  // shape, as `like * value` records it: use it with `like`.
  Tensor scalar(size_t i, const Tensor& like);
  // What update() records each new value with: target.assign(value), or, in a step that may be
  // skipped on the device (apply_gradients with skip), target.assign(where(skip, target, value)),
  // so what update() reads back afterwards is the selected value. Calling Tensor::assign directly
  // in update() works for plain steps; a skippable step then throws kiln::Error.
  void assign(Tensor& target, const Tensor& value);
  // Names of the state tensors each parameter gets (created as realized zeros like the parameter).
  virtual std::vector<std::string> state_names(size_t group) const = 0;
  // Grows the state table to match the groups (called before it is used).
  void resize_state();

 private:
  template <TensorRange R> static std::vector<Tensor> to_tensors(R&& range) {
    std::vector<Tensor> out;
    for (auto&& t : range) out.push_back(Tensor(t));
    return out;
  }
  void step_outputs(std::vector<Tensor> outputs);
  void step_loss(const Tensor& loss, std::vector<Tensor> outputs);
  void apply(std::vector<Tensor> grads, std::vector<Tensor> extra, const Tensor& skip);
  bool reduce_gradients(std::vector<Tensor>& grads, const std::vector<Tensor>& extra,
                        std::vector<std::shared_ptr<GradientReducer>>& reducers) const;
  void update_unless(const Tensor& skip, size_t group, Tensor& param, const Tensor& grad, ParamState& state);
  std::vector<std::vector<ParamState>> state_;  // [group][index]
  std::vector<Tensor> synced_with_step_;
  double max_grad_norm_ = 0;
  NormCombiner norm_across_;
  Tensor last_grad_norm_;
  Tensor skip_;                     // set only while update_unless records an update
  std::vector<NodePtr> assigned_;   // the values assign() recorded under skip_
  std::vector<double> scalars_;     // update_scalars() of the parameter update() records now
  // While a TrainStep captures a step: every scalar() recorded, with its parameter (in
  // parameters() order) and index, and the first and last node ids of the updates.
  friend class TrainStep;
  struct ScalarUse {
    size_t param, index;
    NodePtr node;
  };
  struct Capture {
    std::vector<ScalarUse> scalars;
    uint64_t first_id = 0, last_id = 0;
  };
  Capture* capture_ = nullptr;
  // Every variable a step may read or write that a replay binds again: parameters and their
  // gradients, state tensors, sync_with_step tensors. (The last gradient norm is a new tensor
  // each step.)
  std::vector<std::shared_ptr<Var>> known_vars() const;
  size_t param_index_ = 0;          // of the parameter update() records now
};

// The value of `name` in `h`, or kiln::Error naming the optimizer and the key.
double hyperparameter(const Hyperparameters& h, const std::string& name, const std::string& optimizer);
// Throws kiln::Error when `h` has a key outside `names`.
void check_hyperparameter_names(const Hyperparameters& h, const std::vector<std::string>& names,
                                const std::string& optimizer);

// One group of parameters and the options they are updated with.
template <class Options>
struct ParamGroup {
  std::vector<Tensor> params;
  Options options;
};

// The group bookkeeping shared by every optimizer with an options struct of type Options (which
// has at least lr()). group(g) gives a group's options to read or change.
template <class Options>
class OptimizerWith : public Optimizer {
 public:
  explicit OptimizerWith(std::vector<ParamGroup<Options>> groups) : groups_(std::move(groups)) {}

  void add_param_group(std::vector<Tensor> params, Options options) {
    groups_.push_back({std::move(params), options});
  }
  ParamGroup<Options>& group(size_t g) { return groups_.at(g); }
  const ParamGroup<Options>& group(size_t g) const { return groups_.at(g); }

  size_t group_count() const override { return groups_.size(); }
  double group_lr(size_t g) const override { return groups_.at(g).options.lr(); }
  void set_group_lr(size_t g, double lr) override { groups_.at(g).options.lr(lr); }
  const std::vector<Tensor>& group_params(size_t g) const override { return groups_.at(g).params; }

  Hyperparameters hyperparameters(size_t g) const override { return to_hyperparameters(groups_.at(g).options); }
  void set_hyperparameters(const std::vector<Hyperparameters>& groups) override {
    KILN_CHECK(groups.size() == groups_.size(), "optim::set_hyperparameters",
               "got hyperparameters for {} parameter groups; this {} has {}", groups.size(), type_name(),
               groups_.size());
    std::vector<Options> options;
    for (const Hyperparameters& h : groups) options.push_back(from_hyperparameters(h));  // may throw
    for (size_t g = 0; g < groups_.size(); ++g) groups_[g].options = options[g];
  }

 protected:
  // Options to names and back; from_hyperparameters checks the values like the constructor.
  virtual Hyperparameters to_hyperparameters(const Options& options) const = 0;
  virtual Options from_hyperparameters(const Hyperparameters& h) const = 0;

  std::vector<ParamGroup<Options>> groups_;
};

}  // namespace kiln::optim
