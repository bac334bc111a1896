// Pipeline parallel training: the layers of an nn::Sequential split into stages, one stage per
// rank; a batch split into micro-batches that flow forward through the stages and their gradients
// back, in a GPipe or 1F1B (PipeDream-flush) order. Each rank records its whole step (every
// micro-batch's forward and backward, the activations and gradients it sends and receives, the
// optimizer's update) into one lazy graph that runs as one plan.
//
//   kiln::distributed::init();                                   // mpirun -np 2
//   nn::Sequential net(nn::Linear(784, 256), nn::ReLU(), nn::Linear(256, 10));
//   kiln::distributed::Pipeline pipe(net, kiln::distributed::PipelineOptions().micro_batches(8));
//   optim::SGD opt(pipe.parameters(), optim::SGDOptions(0.1));  // this stage's parameters only
//   auto ce = [](const Tensor& out, const Tensor& y) { return nn::cross_entropy(out, y); };
//   Tensor loss = pipe.train_step(opt, x, y, ce);                // defined on the last stage
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <tuple>
#include <vector>

#include "distributed/communicator.h"
#include "nn/sequential.h"
#include "optim/optimizer.h"

namespace kiln::distributed {

enum class PipelineSchedule : uint8_t {
  GPipe,     // every micro-batch's forward, then every backward: m micro-batches live per stage
  OneFOneB,  // after a warm-up, one forward then one backward: at most (stages - stage) live
};

struct PipelineOptions {
  // Layers per stage, in order; empty: contiguous stages of about equal parameter count.
  PipelineOptions& balance(std::vector<int64_t> layers) {
    balance_ = std::move(layers);
    return *this;
  }
  PipelineOptions& micro_batches(int64_t m) {
    micro_batches_ = m;
    return *this;
  }
  PipelineOptions& schedule(PipelineSchedule s) {
    schedule_ = s;
    return *this;
  }
  // The ranks that hold the stages, in stage order (default: every rank, stage r on rank r); with
  // DataParallel over a group on the other axis, a 2-D layout (distributed::new_group).
  PipelineOptions& group(Group g) {
    group_ = std::move(g);
    return *this;
  }
  std::vector<int64_t> balance_;
  Group group_;
  int64_t micro_batches_ = 1;
  PipelineSchedule schedule_ = PipelineSchedule::OneFOneB;
};

// One micro-batch's forward (F) or backward (B) on a stage, in the order a schedule runs them.
struct PipelineAction {
  bool forward = true;
  int64_t micro_batch = 0;
};
std::vector<PipelineAction> pipeline_order(PipelineSchedule schedule, int64_t stages, int64_t stage,
                                           int64_t micro_batches);
// The stage boundaries for `balance` (or by parameter count when empty): stage s holds layers
// [first[s], first[s + 1]). Throws kiln::Error when the numbers do not fit the model.
std::vector<int64_t> pipeline_stages(const nn::Sequential& model, const std::vector<int64_t>& balance,
                                     int64_t stages);

// The tag of micro-batch k's activations (sent forward) or gradients (sent back). Pipeline
// messages use tags from 16382 up: a program's own send()/recv() should use lower ones.
int64_t pipeline_tag(int64_t micro_batch, bool gradient);

// What the last train_step did on this rank.
struct PipelineStepStats {
  int64_t peak_live_micro_batches = 0;  // forwards whose backward had not run yet, at most
  int64_t arena_bytes = 0;              // the step plan's intermediates (activations, gradients)
  double step_seconds = 0;              // recording and running the step
  double recv_wait_seconds = 0;         // of which blocked waiting for another stage's message
};

class Pipeline : public nn::Module {
 public:
  using LossFn = std::function<Tensor(const Tensor& output, const Tensor& target)>;

  // Keeps the layers of this rank's stage (group rank r runs stage r; the stage count is the
  // group's size), registered under their index in `model`, so a stage's parameter names are the full
  // model's. The other layers are not referenced: they are freed with the caller's model.
  // Throws kiln::Error (naming the numbers) for a balance that does not sum to the model's layer
  // count, a stage without layers, or a world of one process.
  Pipeline(const nn::Sequential& model, PipelineOptions options = {});

  // One training step on a batch every rank passes (axis 0 splits into micro_batches equal
  // micro-batches; the first stage reads `input`, the last `target`): each micro-batch's loss is
  // loss_fn(output, target) / micro_batches, its gradients accumulate, and `opt` (holding this
  // stage's parameters) applies them once, all in one plan. Returns the batch's mean loss,
  // realized, on the last stage; an undefined tensor on the others.
  Tensor train_step(optim::Optimizer& opt, const Tensor& input, const Tensor& target, const LossFn& loss_fn);

  // The whole batch through the stages (use under NoGradGuard for evaluation): the output on the
  // last stage (realized), an undefined tensor on the others, which realize what they send.
  Tensor forward(const Tensor& x) override;

  int64_t stage() const { return stage_; }
  int64_t stages() const { return stages_; }
  bool is_first() const { return stage_ == 0; }
  bool is_last() const { return stage_ == stages_ - 1; }
  const std::vector<int64_t>& stage_bounds() const { return bounds_; }  // stage s: layers [s], [s + 1])
  const PipelineOptions& options() const { return options_; }
  const PipelineStepStats& last_step() const { return last_; }
  // The bubble of the schedule in theory: (p - 1) / (m + p - 1).
  double theoretical_bubble() const;

 private:
  Tensor run_stage(const Tensor& x);
  int64_t peer(int64_t offset) const;  // the world rank of the stage `offset` away
  Device device() const;               // where this stage's parameters are (messages arrive there)
  // This stage's input shape and dtype for a batch of `input`'s, learnt once per batch shape
  // from the previous stage (which computes it from its own without running anything).
  std::pair<Shape, DType> input_layout(const Tensor& input, int64_t micro_batches);

  PipelineOptions options_;
  int64_t stage_ = 0, stages_ = 1;
  std::vector<int64_t> bounds_;
  std::vector<nn::AnyModule> layers_;
  std::map<std::tuple<Shape, DType, int64_t>, std::pair<Shape, DType>> layouts_;
  PipelineStepStats last_;
};

}  // namespace kiln::distributed
