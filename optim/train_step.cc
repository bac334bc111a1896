// TrainStep: see train_step.h. A step is recorded inside a jit::CaptureScope; each of the run's
// bindings is then traced to where a replay finds it (the batch, a variable the optimizer knows,
// its autocast copy, a constant) and each result to where it goes.
#include "optim/train_step.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "core/autograd.h"
#include "core/error.h"
#include "core/node.h"
#include "jit/executor.h"
#include "ops/ops.h"

namespace kiln::optim {

namespace {

using ValueType = std::tuple<Shape, DType, Device>;

ValueType type_of(const Tensor& t) { return {t.shape(), t.dtype(), t.device()}; }

// Per entry of `batch`, the first entry holding the same tensor: a step recorded on {x, x} reads
// one value where one on {x, t} reads two.
std::vector<size_t> first_of_each(const std::vector<Tensor>& batch) {
  std::vector<size_t> first(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    first[i] = i;
    for (size_t j = 0; j < i; ++j)
      if (batch[j].node() == batch[i].node()) {
        first[i] = j;
        break;
      }
  }
  return first;
}

bool same_but_lr(const Hyperparameters& a, const Hyperparameters& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, value] : a) {
    auto it = b.find(name);
    if (it == b.end() || (name != "lr" && it->second != value)) return false;
  }
  return true;
}

}  // namespace

struct TrainStep::Recording {
  std::vector<ValueType> batch;
  std::vector<size_t> batch_first;  // per batch entry: the first entry holding the same tensor
  std::vector<Hyperparameters> hyperparameters;
  double max_grad_norm = 0;
  std::vector<Var*> vars;  // the optimizer's variables when recorded (Optimizer::known_vars order)
  std::vector<std::pair<size_t, size_t>> param_at;  // per parameter (flat): group and index
  std::vector<size_t> advanced;                     // parameters whose step count a step advances
  jit::CapturedRun run;
  enum class From { Batch, Value, Low, Constant };
  struct Read {
    From from;
    size_t index;
    NodePtr constant;
  };
  std::vector<Read> reads;  // per external
  enum class To { Output, Value, Low, GradNorm };
  struct Write {
    size_t result;  // of the run's outputs
    To to;
    size_t index;
  };
  std::vector<Write> writes;                          // a run's output may go to several places
  std::vector<std::pair<int64_t, size_t>> scalar_from;  // per scalar: {parameter, update_scalars index}, or {-1, 0}
  // The step's draws: offsets relative to the generator's at the step's start (a recomputed copy
  // shares its original's key), and the span it advanced by (draws the plan does not need too).
  std::vector<uint64_t> random_offset;
  uint64_t random_span = 0;
  size_t outputs = 0;                                 // fn's
};

TrainStep::TrainStep(Optimizer& optimizer, Function fn) : opt_(optimizer), fn_(std::move(fn)) {
  KILN_CHECK(fn_ != nullptr, "optim::TrainStep", "no step function given");
}

TrainStep::~TrainStep() = default;

std::vector<Tensor> TrainStep::run_eagerly(const std::vector<Tensor>& batch) {
  std::vector<Tensor> outputs = fn_(batch);
  KILN_CHECK(!outputs.empty() && outputs[0].defined(), "optim::TrainStep", "the step function returned no loss");
  opt_.step(outputs[0], std::vector<Tensor>(outputs.begin() + 1, outputs.end()));
  return outputs;
}

std::vector<Tensor> TrainStep::operator()(const std::vector<Tensor>& batch) {
  ++calls_;
  std::vector<Tensor> pending;
  for (const Tensor& t : batch)
    if (t.defined() && !t.is_realized()) pending.push_back(t);
  if (!pending.empty()) sync(pending);
  if (!why_not_.empty()) return run_eagerly(batch);
  // The first step creates the optimizer's state (and SGD's first step differs from the others).
  if (calls_ == 1) return run_eagerly(batch);
  const std::vector<std::shared_ptr<Var>> vars = opt_.known_vars();
  if (Recording* r = find(batch, vars)) return replay(*r, batch, vars);
  return record(batch);
}

TrainStep::Recording* TrainStep::find(const std::vector<Tensor>& batch, const std::vector<std::shared_ptr<Var>>& vars) {
  for (size_t k = 0; k < recordings_kept_.size(); ++k) {
    Recording& r = *recordings_kept_[k];
    if (r.batch.size() != batch.size() || r.vars.size() != vars.size() || r.max_grad_norm != opt_.max_grad_norm_)
      continue;
    bool same = true;
    for (size_t i = 0; same && i < batch.size(); ++i) same = type_of(batch[i]) == r.batch[i];
    same = same && first_of_each(batch) == r.batch_first;
    for (size_t i = 0; same && i < vars.size(); ++i) same = vars[i].get() == r.vars[i];
    for (size_t g = 0; same && g < r.hyperparameters.size(); ++g)
      same = g < opt_.group_count() && same_but_lr(opt_.hyperparameters(g), r.hyperparameters[g]);
    same = same && r.hyperparameters.size() == opt_.group_count() && r.run.generation == jit::plan_cache_generation();
    if (!same) continue;
    if (k > 0) std::rotate(recordings_kept_.begin(), recordings_kept_.begin() + static_cast<std::ptrdiff_t>(k),
                           recordings_kept_.begin() + static_cast<std::ptrdiff_t>(k) + 1);
    return recordings_kept_.front().get();
  }
  return nullptr;
}

std::vector<Tensor> TrainStep::record(const std::vector<Tensor>& batch) {
  // The optimizer's values realized first: the recorded step then starts from realized values.
  std::vector<std::shared_ptr<Var>> vars = opt_.known_vars();
  std::vector<Tensor> pending;
  for (const auto& v : vars)
    if (!v->node->realized()) pending.push_back(TensorAccess::from_var(v));
  if (!pending.empty()) sync(pending);
  auto recording = std::make_unique<Recording>();
  Recording& r = *recording;
  for (const Tensor& t : batch) r.batch.push_back(type_of(t));
  r.batch_first = first_of_each(batch);
  for (size_t g = 0; g < opt_.group_count(); ++g) {
    r.hyperparameters.push_back(opt_.hyperparameters(g));
    for (size_t i = 0; i < opt_.group_params(g).size(); ++i) r.param_at.emplace_back(g, i);
  }
  r.max_grad_norm = opt_.max_grad_norm_;
  for (const auto& v : vars) r.vars.push_back(v.get());
  // What each variable holds before the step, by buffer: a forward reads an autocast copy through
  // a node of its own that shares the copy's buffer.
  std::vector<const void*> value_data, low_data;
  for (const auto& v : vars) {
    value_data.push_back(v->node->storage->data);
    const bool low = v->low_copy && v->low_copy->realized() && v->low_copy_of.lock() == v->node;
    low_data.push_back(low ? v->low_copy->storage->data : nullptr);
  }
  std::vector<int64_t> steps_before;
  opt_.resize_state();
  for (const auto& group : opt_.state_)
    for (const ParamState& s : group) steps_before.push_back(s.step);

  const auto [seed, random_start] = random_key(0);
  Optimizer::Capture capture;
  std::vector<Tensor> outputs;
  std::vector<jit::CapturedRun> runs;
  std::vector<std::string> why_not;
  std::string unknown_assign;  // a variable fn assigned that the optimizer does not know
  {
    struct Attach {
      Optimizer& opt;
      Attach(Optimizer& o, Optimizer::Capture* c) : opt(o) { opt.capture_ = c; }
      ~Attach() { opt.capture_ = nullptr; }
    } attach(opt_, &capture);
    AssignRecorder assigns;
    jit::CaptureScope scope;
    outputs = run_eagerly(batch);
    runs = scope.runs();
    why_not = scope.why_not();
    for (const std::weak_ptr<Var>& assigned : assigns.assigned())
      if (std::shared_ptr<Var> v = assigned.lock())
        if (std::none_of(vars.begin(), vars.end(), [&](const std::shared_ptr<Var>& k) { return k == v; }))
          unknown_assign = fmt::format("{} {}", dtype_name(v->node->dtype), shape_str(v->node->shape));
  }
  ++recordings_;
  r.random_span = random_key(0).second - random_start;
  auto give_up = [&](std::string why) {
    why_not_ = std::move(why);
    recordings_kept_.clear();
    return outputs;
  };
  if (!why_not.empty()) return give_up("the step could not be kept for replay: " + why_not.front());
  if (!unknown_assign.empty())
    return give_up(fmt::format("the step assigned a {} the optimizer does not know (a module buffer: pass it to "
                               "opt.sync_with_step)", unknown_assign));
  if (runs.size() != 1)
    return give_up(fmt::format("the step ran {} plans, not one: fn or the optimizer realized values within the step "
                               "(item(), to_vector(), sync(), GradScaler; KILN_LAZY=0 realizes every op)",
                               runs.size()));
  for (const Tensor& p : opt_.parameters())
    if (gradient_reducer(p)) return give_up("a DataParallel reduces the gradients (its host bookkeeping runs per step)");
  r.run = std::move(runs[0]);
  const jit::CapturedRun& run = r.run;

  size_t flat = 0;
  for (const auto& group : opt_.state_)
    for (const ParamState& s : group) {
      if (s.step != steps_before[flat]) r.advanced.push_back(flat);
      ++flat;
    }
  // Reads: the batch, a variable's value or autocast copy (same type), else a constant.
  for (size_t e = 0; e < run.externals.size(); ++e) {
    const jit::CapturedRun::Value& x = run.externals[e];
    auto matches = [&](const NodePtr& n) { return n && n->shape == x.shape && n->dtype == x.dtype; };
    size_t b = 0;
    while (b < batch.size() && batch[b].node().get() != x.node) ++b;
    size_t v = 0;
    while (v < vars.size() && !(value_data[v] == x.data && matches(vars[v]->node))) ++v;
    size_t l = 0;
    while (l < vars.size() && !(low_data[l] == x.data && matches(vars[l]->low_copy))) ++l;
    if (b < batch.size()) r.reads.push_back({Recording::From::Batch, b, nullptr});
    else if (v < vars.size()) r.reads.push_back({Recording::From::Value, v, nullptr});
    else if (l < vars.size()) r.reads.push_back({Recording::From::Low, l, nullptr});
    else if (run.held_externals[e]) r.reads.push_back({Recording::From::Constant, 0, run.held_externals[e]});
    else return give_up(fmt::format("the step read a {} {} that nothing holds after it", dtype_name(x.dtype),
                                    shape_str(x.shape)));
  }
  // Constants are kept in reads; the run's other values (the batch, old values still held) are not.
  r.run.held_externals.clear();
  // Writes: fn's outputs, variables' new values or autocast copies, the gradient norm; a result
  // that none of them holds must be held by nobody.
  const NodePtr& norm = opt_.last_grad_norm_.defined() ? opt_.last_grad_norm_.node() : nullptr;
  for (size_t k = 0; k < run.outputs.size(); ++k) {
    const Node* o = run.outputs[k];
    const size_t before = r.writes.size();
    for (size_t out = 0; out < outputs.size(); ++out)
      if (outputs[out].node().get() == o) r.writes.push_back({k, Recording::To::Output, out});
    for (size_t v = 0; v < vars.size(); ++v) {
      if (vars[v]->node.get() == o) r.writes.push_back({k, Recording::To::Value, v});
      if (vars[v]->low_copy.get() == o) r.writes.push_back({k, Recording::To::Low, v});
    }
    if (o == norm.get()) r.writes.push_back({k, Recording::To::GradNorm, 0});
    // Held by no handle the replay updates: a handle fn kept, or a variable it assigned.
    size_t handles = 0;
    for (size_t w = before; w < r.writes.size(); ++w) handles += r.writes[w].to == Recording::To::Value ||
                                                                 r.writes[w].to == Recording::To::GradNorm;
    if (o->held > static_cast<int>(handles + std::count_if(outputs.begin(), outputs.end(),
                                                            [&](const Tensor& t) { return t.node().get() == o; })))
      return give_up(fmt::format("a {} {} computed by the step is held by a handle the optimizer does not know (a "
                                 "tensor fn keeps, or a module buffer: pass buffers to opt.sync_with_step)",
                                 dtype_name(o->dtype), shape_str(o->shape)));
  }
  r.outputs = outputs.size();
  for (size_t i = 0; i < outputs.size(); ++i)
    if (std::none_of(r.writes.begin(), r.writes.end(),
                     [&](const Recording::Write& w) { return w.to == Recording::To::Output && w.index == i; }))
      return give_up(fmt::format("output {} of the step function is not computed by the step", i));
  // Scalars: the optimizer's update_scalars, else constants of the step (outside the updates).
  std::map<const Node*, std::pair<int64_t, size_t>> from_update;
  for (const auto& use : capture.scalars)
    from_update[use.node.get()] = {static_cast<int64_t>(use.param), use.index};
  for (size_t k = 0; k < run.scalar_nodes.size(); ++k) {
    if (auto it = from_update.find(run.scalar_nodes[k]); it != from_update.end()) {
      r.scalar_from.push_back(it->second);
      continue;
    }
    if (run.scalar_ids[k] > capture.first_id && run.scalar_ids[k] < capture.last_id)
      return give_up(fmt::format("{}::update() records a number that update_scalars() does not give",
                                 opt_.type_name()));
    r.scalar_from.emplace_back(-1, 0);
  }
  for (auto [draw_seed, offset] : run.random) {
    if (draw_seed != seed || offset < random_start || offset >= random_start + r.random_span)
      return give_up("the step's random numbers were not drawn within it from the global generator");
    r.random_offset.push_back(offset - random_start);
  }

  constexpr size_t kKept = 4;  // an epoch's full and last batches, train and a second shape
  recordings_kept_.insert(recordings_kept_.begin(), std::move(recording));
  if (recordings_kept_.size() > kKept) recordings_kept_.pop_back();
  return outputs;
}

std::vector<Tensor> TrainStep::replay(Recording& r, const std::vector<Tensor>& batch,
                                      const std::vector<std::shared_ptr<Var>>& vars) {
  std::vector<Tensor> pending;
  for (const auto& v : vars)
    if (!v->node->realized()) pending.push_back(TensorAccess::from_var(v));
  if (!pending.empty()) sync(pending);
  const jit::CapturedRun& run = r.run;
  jit::ReplayBindings bindings;
  for (const Recording::Read& read : r.reads) {
    if (read.from == Recording::From::Low) {
      const Var& v = *vars[read.index];
      // A copy made for another value (the parameter was assigned outside the step): recorded anew.
      if (!v.low_copy || !v.low_copy->realized() || v.low_copy_of.lock() != v.node) {
        recordings_kept_.clear();
        return record(batch);
      }
    }
    bindings.externals.push_back(read.from == Recording::From::Batch   ? batch[read.index].node()
                                 : read.from == Recording::From::Value ? vars[read.index]->node
                                 : read.from == Recording::From::Low   ? vars[read.index]->low_copy
                                                                       : read.constant);
  }
  // The host half of Optimizer::step: step counts advance, the update's scalars follow them.
  for (size_t p : r.advanced) opt_.state_[r.param_at[p].first][r.param_at[p].second].step++;
  struct Undo {
    Optimizer& opt;
    const Recording& r;
    bool done = false;
    ~Undo() {
      if (!done)
        for (size_t p : r.advanced) opt.state_[r.param_at[p].first][r.param_at[p].second].step--;
    }
  } undo{opt_, r};
  std::vector<std::vector<double>> scalars(r.param_at.size());
  bindings.scalars = run.scalars;
  for (size_t k = 0; k < r.scalar_from.size(); ++k) {
    auto [param, index] = r.scalar_from[k];
    if (param < 0) continue;
    std::vector<double>& s = scalars[static_cast<size_t>(param)];
    if (s.empty()) {
      auto [g, i] = r.param_at[static_cast<size_t>(param)];
      s = opt_.update_scalars(g, opt_.state_[g][i]);
    }
    bindings.scalars[k] = s.at(index);
  }
  // The generator advances as the recorded step advanced it; each draw keeps its place.
  const auto [seed, start] = random_key(static_cast<int64_t>(r.random_span));
  for (uint64_t offset : r.random_offset) bindings.random.emplace_back(seed, start + offset);
  std::vector<NodePtr> results = jit::replay(run, std::move(bindings));
  undo.done = true;
  ++replays_;
  std::vector<Tensor> outputs(r.outputs);
  for (const Recording::Write& w : r.writes) {
    const NodePtr& result = results[w.result];
    if (w.to == Recording::To::Output) outputs[w.index] = Tensor(result);
    else if (w.to == Recording::To::Value) vars[w.index]->set(result);
    else if (w.to == Recording::To::GradNorm) opt_.last_grad_norm_ = Tensor(result);
  }
  for (const Recording::Write& w : r.writes)
    if (w.to == Recording::To::Low) {
      // As the optimizer's update leaves it: a copy of the new value that no forward read yet.
      Var& v = *vars[w.index];
      v.low_copy = results[w.result];
      v.low_copy_of = v.node;
      v.low_copy_used = false;
    }
  return outputs;
}

}  // namespace kiln::optim
