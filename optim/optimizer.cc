// The optimizer base: gradients in, one sync of every update out. See optimizer.h.
#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "core/autograd.h"
#include "core/error.h"
#include "ops/autocast.h"
#include "ops/ops.h"
#include "ops/primitive.h"
#include "optim/clip.h"

namespace kiln::optim {

void Optimizer::zero_grad() {
  for (size_t g = 0; g < group_count(); ++g)
    for (Tensor p : group_params(g)) p.zero_grad();
}

void Optimizer::set_lr(double lr) {
  for (size_t g = 0; g < group_count(); ++g) set_group_lr(g, lr);
}

std::vector<Tensor> Optimizer::parameters() const {
  std::vector<Tensor> all;
  for (size_t g = 0; g < group_count(); ++g)
    for (const Tensor& p : group_params(g)) all.push_back(p);
  return all;
}

void Optimizer::resize_state() {
  state_.resize(group_count());
  for (size_t g = 0; g < group_count(); ++g) state_[g].resize(group_params(g).size());
}

void Optimizer::step_outputs(std::vector<Tensor> outputs) {
  std::vector<Tensor> grads;
  for (const Tensor& p : parameters()) grads.push_back(p.grad());
  apply(std::move(grads), std::move(outputs), {});
}

void Optimizer::step_loss(const Tensor& loss, std::vector<Tensor> outputs) {
  std::vector<Tensor> grads = gradients(loss);
  std::vector<Tensor> extra{loss};
  extra.insert(extra.end(), outputs.begin(), outputs.end());
  apply(std::move(grads), std::move(extra), {});
}

std::vector<Tensor> Optimizer::gradients(const Tensor& loss) const {
  KILN_CHECK(loss.defined() && loss.numel() == 1, "optim::step", "the loss must be a single value, got {}",
             loss.defined() ? loss.str() : std::string("an undefined tensor"));
  std::vector<Tensor> params = parameters();
  std::vector<Tensor> trainable;
  for (const Tensor& p : params)
    if (p.requires_grad()) trainable.push_back(p);
  std::vector<Tensor> found = grad(loss, trainable);
  std::vector<Tensor> grads;
  size_t next = 0;
  for (const Tensor& p : params) grads.push_back(p.requires_grad() ? std::move(found[next++]) : Tensor());
  return grads;
}

void Optimizer::apply_gradients(std::vector<Tensor> grads, std::vector<Tensor> outputs, const Tensor& skip) {
  std::vector<Tensor> params = parameters();
  KILN_CHECK(grads.size() == params.size(), "optim::apply_gradients", "got {} gradients for {} parameters",
             grads.size(), params.size());
  if (skip.defined()) {
    KILN_CHECK(skip.numel() == 1 && skip.dtype() == DType::Bool, "optim::apply_gradients",
               "skip must be a single Bool, got {}", skip.str());
    for (const Tensor& p : params)
      KILN_CHECK(p.device() == skip.device(), "optim::apply_gradients",
                 "skip is on {} but a parameter {} is on {}; keep skip with the parameters", skip.device().str(),
                 p.str(), p.device().str());
  }
  apply(std::move(grads), std::move(outputs), skip);
}

// Records every update, then runs them (with `extra`, the tensors synced with every step, and
// any gradient a user still holds through p.grad()) as one plan, in parameter order. With
// `skip`, each update keeps the old values where skip is true (update_unless).
// Hands each gradient reducer (distributed::DataParallel) the gradients of its parameters, in
// parameter order, with the tensors this step realizes anyway. False when a reducer keeps them
// for a later step (accumulation): then this call updates nothing.
bool Optimizer::reduce_gradients(std::vector<Tensor>& grads, const std::vector<Tensor>& extra,
                                 std::vector<std::shared_ptr<GradientReducer>>& reducers) const {
  std::vector<Tensor> params = parameters();
  for (const Tensor& p : params)
    if (auto r = gradient_reducer(p); r && std::find(reducers.begin(), reducers.end(), r) == reducers.end())
      reducers.push_back(std::move(r));
  if (reducers.empty()) return true;
  std::vector<Tensor> along = extra;
  for (const Tensor& p : params)
    if (p.grad().defined()) along.push_back(p.grad());
  for (const Tensor& t : synced_with_step_)
    if (t.defined() && !t.is_realized()) along.push_back(t);
  for (const auto& reducer : reducers) {
    std::vector<Tensor> mine, their_grads;
    std::vector<size_t> at;
    for (size_t i = 0; i < params.size(); ++i)
      if (gradient_reducer(params[i]) == reducer) mine.push_back(params[i]), their_grads.push_back(grads[i]), at.push_back(i);
    const bool now = reducer->reduce(mine, their_grads, along);
    for (size_t j = 0; j < at.size(); ++j) grads[at[j]] = std::move(their_grads[j]);
    KILN_CHECK(now || reducers.size() == 1, "optim::step",
               "one optimizer holds the parameters of several DataParallel wrappers and one of them accumulates; "
               "give each wrapper its own optimizer");
    if (!now) return false;
  }
  return true;
}

void Optimizer::apply(std::vector<Tensor> grads, std::vector<Tensor> extra, const Tensor& skip) {
  resize_state();
  NoGradGuard no_grad;
  AutocastGuard no_autocast(false);  // updates run in the parameters' type
  std::vector<std::shared_ptr<GradientReducer>> reducers;
  if (!reduce_gradients(grads, extra, reducers)) return;  // accumulated for a later step
  if (max_grad_norm_ > 0) {
    last_grad_norm_ = clip_by_global_norm(grads, max_grad_norm_, norm_across_);
    extra.push_back(last_grad_norm_);
  }
  // State tensors start as realized zeros, so the first step's graph is the same as every
  // later one's and the plan cache serves all of them.
  std::vector<Tensor> fresh;
  size_t flat = 0;
  for (size_t g = 0; g < group_count(); ++g) {
    for (size_t i = 0; i < group_params(g).size(); ++i, ++flat) {
      if (!grads[flat].defined()) continue;
      for (const std::string& name : state_names(g)) {
        auto& slot = state_[g][i].tensors[name];
        if (slot.defined()) continue;  // loaded from a checkpoint
        const Tensor& p = group_params(g)[i];
        slot = zeros_like(p);  // on p's device
        fresh.push_back(slot);
      }
    }
  }
  if (!fresh.empty()) sync(fresh);

  std::vector<Tensor> outputs;
  // A step is applied whole or not at all: an update that fails while it is recorded (a skipped
  // step's check, GradScaler) or a run that fails (out of memory) puts back every parameter,
  // state tensor and step count as they were before this step.
  struct Recorded {
    std::shared_ptr<Var> var;
    NodePtr value;             // while a step that may be skipped is recorded
    std::weak_ptr<Node> weak;
  };
  std::vector<Recorded> recorded;
  std::vector<std::pair<int64_t*, int64_t>> steps;
  auto put_back = [&] {
    for (const Recorded& r : recorded)
      if (NodePtr old = r.value ? r.value : r.weak.lock()) r.var->set(old);
    for (auto [step, value] : steps) *step = value;
  };
  flat = 0;
  if (capture_) capture_->first_id = Node::next_id();
  try {
    for (size_t g = 0; g < group_count(); ++g) {
      for (size_t i = 0; i < group_params(g).size(); ++i, ++flat) {
        if (!grads[flat].defined()) continue;
        Tensor p = group_params(g)[i];
        // Not a handle: in eager mode an extra reference to the old value would keep the
        // update from writing over it.
        const Node* before = p.node().get();
        ParamState& state = state_[g][i];
        // Held only for a step that may be skipped: in eager mode a handle to the old value would
        // keep the update from writing over it; otherwise the updates read the old values.
        const bool hold = skip.defined();
        recorded.push_back({TensorAccess::var(p), hold ? p.node() : nullptr, p.node()});
        for (const auto& [name, t] : state.tensors)
          recorded.push_back({TensorAccess::var(t), hold ? t.node() : nullptr, t.node()});
        steps.push_back({&state.step, state.step});
        state.step++;
        scalars_ = update_scalars(g, state);
        param_index_ = flat;
        if (skip.defined()) update_unless(skip, g, p, grads[flat], state);
        else update(g, p, grads[flat], state);
        outputs.push_back(p);
        for (auto& [name, t] : state.tensors) outputs.push_back(t);
        // Autocast's low-precision copy of the new value, written by the update's own kernel.
        if (Tensor copy = refresh_autocast_copy(p, before); copy.defined()) outputs.push_back(std::move(copy));
      }
    }
  } catch (...) {
    put_back();
    throw;
  }
  if (capture_) capture_->last_id = Node::next_id();
  // No old value may be held while the step runs: it would keep the executor from updating it in
  // place. The pending updates read the old values, so those live on until the run succeeds.
  for (Recorded& r : recorded) r.value.reset();
  // A gradient handle held here would count as a user's pending value that reads the old
  // parameters, and keep the executor from updating them in place.
  grads.clear();
  // A gradient left in p.grad() is realized with the step (PyTorch keeps .grad after step() as
  // well): a pending gradient would still read the old parameter values and so keep the executor
  // from updating the parameters in place. Last parameter first: the step's graph is ordered
  // depth first from its outputs, so each layer's weight gradients then come as soon as the
  // backward reaches the layer, and its deltas die there, instead of all after the first layer's
  // gradient, which needs the whole backward.
  const std::vector<Tensor> params = parameters();
  for (auto it = params.rbegin(); it != params.rend(); ++it)
    if (it->grad().defined()) outputs.push_back(it->grad());
  for (const Tensor& t : synced_with_step_)
    if (t.defined() && !t.is_realized()) outputs.push_back(t);
  for (const Tensor& t : extra)
    if (t.defined()) outputs.push_back(t);
  for (const auto& reducer : reducers)
    for (Tensor& t : reducer->realized_with_step()) outputs.push_back(std::move(t));
  // The executor allocates every buffer of the run before its first kernel, so a run that fails
  // (out of memory) has written nothing: putting the handles back is the whole undo.
  try {
    if (!outputs.empty()) sync(outputs);
  } catch (...) {
    put_back();
    throw;
  }
  for (const auto& reducer : reducers) reducer->after_step();
}

std::vector<std::shared_ptr<Var>> Optimizer::known_vars() const {
  std::vector<std::shared_ptr<Var>> vars;
  auto add = [&](const Tensor& t) {
    if (t.defined()) vars.push_back(TensorAccess::var(t));
  };
  for (const Tensor& p : parameters()) {
    add(p);
    if (const auto& grad = TensorAccess::var(p)->grad) vars.push_back(grad);
  }
  for (const auto& group : state_)
    for (const ParamState& s : group)
      for (const auto& [name, t] : s.tensors) add(t);
  for (const Tensor& t : synced_with_step_) add(t);
  return vars;
}

Tensor Optimizer::scalar(size_t i, const Tensor& like) {
  KILN_CHECK(i < scalars_.size(), "optim::step", "{}::update() asked for scalar {}, but update_scalars() gave {}",
             type_name(), i, scalars_.size());
  // Of like's shape: the one Full node `like * value` records (broadcast_to makes a constant of
  // the wanted shape), and so the node a plan binds.
  // On like's device too: a constant met on another device is remade there (prim::follow), and
  // that copy is the node the plan binds.
  Tensor s = prim::follow(broadcast_to(scalar_like(scalars_[i], like), like.shape()), like.device());
  if (capture_) capture_->scalars.push_back({param_index_, i, s.node()});
  return s;
}

void Optimizer::clip_grad_norm(double max_norm, NormCombiner across) {
  KILN_CHECK(max_norm >= 0 && std::isfinite(max_norm), "optim::clip_grad_norm",
             "max_norm must be a finite non-negative number (0: off), got {}", max_norm);
  max_grad_norm_ = max_norm;
  norm_across_ = std::move(across);
}

void Optimizer::assign(Tensor& target, const Tensor& value) {
  if (!skip_.defined()) return target.assign(value);
  target.assign(where(skip_, target, value));
  assigned_.push_back(target.node());
}

// update() with skip_ set, so that each assign() keeps the old value where `skip` is true. An
// update that called Tensor::assign itself could not be skipped: that is an Error, not a step
// silently taken with an inf in it.
void Optimizer::update_unless(const Tensor& skip, size_t group, Tensor& param, const Tensor& grad, ParamState& state) {
  std::vector<std::pair<const Tensor*, NodePtr>> before{{&param, param.node()}};
  for (const auto& [name, t] : state.tensors) before.push_back({&t, t.node()});
  skip_ = skip;
  try {
    update(group, param, grad, state);
  } catch (...) {
    skip_ = Tensor();
    assigned_.clear();
    throw;
  }
  skip_ = Tensor();
  for (const auto& [t, old] : before)
    KILN_CHECK(t->node() == old || std::find(assigned_.begin(), assigned_.end(), t->node()) != assigned_.end(),
               "optim::apply_gradients",
               "{}::update assigned {} with Tensor::assign, which a skipped step (GradScaler) cannot undo; record "
               "updates with Optimizer::assign(target, value)", type_name(), t->str());
  assigned_.clear();  // node references only, but none should outlive the recording
}

std::map<std::string, Tensor> Optimizer::state() const {
  std::map<std::string, Tensor> out;
  for (size_t g = 0; g < state_.size(); ++g) {
    for (size_t i = 0; i < state_[g].size(); ++i) {
      const ParamState& s = state_[g][i];
      if (s.step == 0 && s.tensors.empty()) continue;
      std::string prefix = fmt::format("{}.{}.", g, i);
      for (const auto& [name, t] : s.tensors) out[prefix + name] = t;
      out[prefix + "step"] = full({}, static_cast<double>(s.step), DType::Int64);
    }
  }
  return out;
}

void Optimizer::load_state(const std::map<std::string, Tensor>& state) {
  resize_state();
  std::vector<std::vector<ParamState>> loaded(state_.size());
  for (size_t g = 0; g < state_.size(); ++g) loaded[g].resize(state_[g].size());
  for (const auto& [key, value] : state) {
    size_t g = 0, i = 0;
    int used = 0;
    bool parsed = std::sscanf(key.c_str(), "%zu.%zu.%n", &g, &i, &used) == 2 && used > 0;
    KILN_CHECK(parsed && g < loaded.size() && i < loaded[g].size(), "optim::load_state",
               "unknown state key `{}`: this optimizer has {} parameter groups", key, loaded.size());
    std::string name = key.substr(static_cast<size_t>(used));
    if (name == "step") {
      KILN_CHECK(value.numel() == 1, "optim::load_state", "`{}` must be a single number, got {}", key, value.str());
      loaded[g][i].step = static_cast<int64_t>(value.item());
      continue;
    }
    std::vector<std::string> names = state_names(g);
    KILN_CHECK(std::set<std::string>(names.begin(), names.end()).count(name), "optim::load_state",
               "unknown state key `{}`: parameters of group {} have no state `{}`", key, g, name);
    const Tensor& p = group_params(g)[i];
    KILN_CHECK(value.shape() == p.shape(), "optim::load_state", "`{}` is {} but its parameter is {}", key,
               value.str(), p.str());
    Tensor v = value.dtype() == p.dtype() ? value.detach() : value.cast(p.dtype()).detach();
    loaded[g][i].tensors[name] = v.to(p.device());  // state lives with its parameter
  }
  // A parameter's state comes whole: its update count and every state tensor, or nothing.
  std::set<std::pair<size_t, size_t>> with_step;
  for (const auto& [key, value] : state) {
    size_t g = 0, i = 0;
    int used = 0;
    std::sscanf(key.c_str(), "%zu.%zu.%n", &g, &i, &used);
    if (key.substr(static_cast<size_t>(used)) == "step") with_step.insert({g, i});
  }
  for (size_t g = 0; g < loaded.size(); ++g) {
    std::vector<std::string> names = state_names(g);
    for (size_t i = 0; i < loaded[g].size(); ++i) {
      const ParamState& s = loaded[g][i];
      bool has_step = with_step.count({g, i}) > 0;
      if (!has_step && s.tensors.empty()) continue;
      KILN_CHECK(has_step, "optim::load_state", "parameter {}.{} has state but no `{}.{}.step`", g, i, g, i);
      for (const std::string& name : names)
        KILN_CHECK(s.tensors.count(name), "optim::load_state", "parameter {}.{} lacks its state `{}.{}.{}`", g, i, g,
                   i, name);
    }
  }
  state_ = std::move(loaded);
}

double hyperparameter(const Hyperparameters& h, const std::string& name, const std::string& optimizer) {
  auto it = h.find(name);
  KILN_CHECK(it != h.end(), "optim::set_hyperparameters", "{} needs hyperparameter `{}`, which is missing",
             optimizer, name);
  return it->second;
}

void check_hyperparameter_names(const Hyperparameters& h, const std::vector<std::string>& names,
                                const std::string& optimizer) {
  for (const auto& [key, _] : h) {
    bool known = false;
    for (const std::string& n : names) known = known || n == key;
    KILN_CHECK(known, "optim::set_hyperparameters", "{} has no hyperparameter `{}`", optimizer, key);
  }
}

}  // namespace kiln::optim
