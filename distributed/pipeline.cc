// Pipeline: stage assignment, the GPipe and 1F1B orders, and the recording of one step. See
// pipeline.h.
#include "distributed/pipeline.h"

#include <algorithm>
#include <chrono>
#include <numeric>

#include "core/autograd.h"
#include "core/error.h"
#include "core/trace_label.h"
#include "distributed/communicator.h"
#include "jit/stats.h"
#include "memory/profile.h"
#include "ops/ops.h"
#include "ops/primitive.h"

namespace kiln::distributed {

namespace {

// Pipeline messages use tags of their own, above those a program is likely to pick for send():
// activations 2k, gradients 2k + 1 (micro-batch k), the layout exchange one more.
constexpr int64_t kTagBase = 16384;
constexpr int64_t kMaxMicroBatches = 8000;
constexpr int64_t kLayoutTag = kTagBase - 1;
constexpr int64_t kForwardTag = kTagBase - 2;  // Pipeline::forward's activations
constexpr size_t kMaxDims = 8;

int64_t activation_tag(int64_t micro_batch) { return pipeline_tag(micro_batch, false); }
int64_t gradient_tag(int64_t micro_batch) { return pipeline_tag(micro_batch, true); }

void send_layout(const Tensor& y, int64_t to) {
  KILN_CHECK(y.dim() <= static_cast<int64_t>(kMaxDims), "Pipeline", "a stage's output has {} axes; at most {} cross stages",
             y.dim(), kMaxDims);
  std::vector<int64_t> layout(kMaxDims + 2, 0);
  layout[0] = static_cast<int64_t>(y.dtype());
  layout[1] = y.dim();
  for (size_t d = 0; d < y.dim(); ++d) layout[d + 2] = y.shape()[d];
  send(from_vector<int64_t>(layout, {static_cast<int64_t>(layout.size())}), static_cast<int>(to), kLayoutTag);
}

std::pair<Shape, DType> recv_layout(int64_t from) {
  std::vector<int64_t> layout =
      recv({static_cast<int64_t>(kMaxDims) + 2}, DType::Int64, static_cast<int>(from), kLayoutTag).to_vector<int64_t>();
  Shape shape(layout.begin() + 2, layout.begin() + 2 + layout[1]);
  return {shape, static_cast<DType>(layout[0])};
}

// sum + g as a kernel of its own: a reduction over a unit axis always gets one. Left to fusion,
// the chain of additions over the micro-batches would fold into the update kernel, and every
// micro-batch's gradients would stay in memory until then.
Tensor accumulate(const Tensor& sum, const Tensor& g) {
  if (!sum.defined()) return g;
  Tensor s = sum + g;
  Shape unit = s.shape();
  unit.insert(unit.begin(), 1);
  return prim::reduce(Op::ReduceSum, s.reshape(unit), {0}).reshape(s.shape());
}

}  // namespace

int64_t pipeline_tag(int64_t micro_batch, bool gradient) { return kTagBase + 2 * micro_batch + (gradient ? 1 : 0); }

std::vector<PipelineAction> pipeline_order(PipelineSchedule schedule, int64_t stages, int64_t stage,
                                           int64_t micro_batches) {
  std::vector<PipelineAction> order;
  const int64_t m = micro_batches;
  if (schedule == PipelineSchedule::GPipe) {
    for (int64_t k = 0; k < m; ++k) order.push_back({true, k});
    for (int64_t k = 0; k < m; ++k) order.push_back({false, k});
    return order;
  }
  // 1F1B: stage s runs (stages - 1 - s) forwards ahead, then alternates one forward and one
  // backward, then drains: the last stage alternates from the start, and no stage holds more
  // than stages - s micro-batches.
  const int64_t warm = std::min(stages - 1 - stage, m);
  for (int64_t k = 0; k < warm; ++k) order.push_back({true, k});
  for (int64_t k = 0; k < m - warm; ++k) {
    order.push_back({true, warm + k});
    order.push_back({false, k});
  }
  for (int64_t k = m - warm; k < m; ++k) order.push_back({false, k});
  return order;
}

std::vector<int64_t> pipeline_stages(const nn::Sequential& model, const std::vector<int64_t>& balance, int64_t stages) {
  const auto layers = static_cast<int64_t>(model.size());
  KILN_CHECK(stages >= 1 && layers >= stages, "Pipeline", "{} stages need at least one layer each; the model has {} layers",
             stages, layers);
  std::vector<int64_t> first{0};
  if (!balance.empty()) {
    KILN_CHECK(static_cast<int64_t>(balance.size()) == stages, "Pipeline",
               "balance gives {} stages but the world has {} processes (one stage per rank)", balance.size(), stages);
    for (int64_t b : balance) {
      KILN_CHECK(b >= 1, "Pipeline", "every stage needs at least one layer; balance has {}", b);
      first.push_back(first.back() + b);
    }
    KILN_CHECK(first.back() == layers, "Pipeline", "balance sums to {} layers but the model has {}", first.back(), layers);
    return first;
  }
  // Contiguous stages of about equal parameter count: cut when a stage reaches its share, before
  // the next layer with parameters (an activation stays with the layer before it), as long as
  // every later stage still gets a layer.
  std::vector<int64_t> count(static_cast<size_t>(layers));
  for (int64_t i = 0; i < layers; ++i) count[static_cast<size_t>(i)] = model[static_cast<size_t>(i)].parameter_count();
  const double total = static_cast<double>(std::accumulate(count.begin(), count.end(), int64_t{0}));
  double filled = 0;
  for (int64_t i = 0; i < layers && static_cast<int64_t>(first.size()) < stages; ++i) {
    filled += static_cast<double>(count[static_cast<size_t>(i)]);
    const auto s = static_cast<double>(first.size());
    const bool share = total > 0 ? filled >= total * s / static_cast<double>(stages)
                                 : i + 1 >= layers * static_cast<int64_t>(first.size()) / stages;
    const int64_t left = layers - (i + 1), stages_left = stages - static_cast<int64_t>(first.size());
    const bool next_has_parameters = left > 0 && count[static_cast<size_t>(i) + 1] > 0;
    if ((share && next_has_parameters && left >= stages_left) || left == stages_left) first.push_back(i + 1);
  }
  first.push_back(layers);
  return first;
}

Pipeline::Pipeline(const nn::Sequential& model, PipelineOptions options)
    : nn::Module("Pipeline"), options_(std::move(options)) {
  init();
  const Group& group = options_.group_;
  group.require_me("Pipeline");
  stages_ = group.size();
  stage_ = group.rank();
  const int64_t m = options_.micro_batches_;
  KILN_CHECK(m >= 1 && m <= kMaxMicroBatches, "Pipeline", "micro_batches must lie in [1, {}], got {}", kMaxMicroBatches, m);
  bounds_ = pipeline_stages(model, options_.balance_, stages_);
  for (int64_t i = bounds_[static_cast<size_t>(stage_)]; i < bounds_[static_cast<size_t>(stage_) + 1]; ++i)
    layers_.push_back(register_module(std::to_string(i), model[static_cast<size_t>(i)]));
  memory::set_trace_process_name(fmt::format("kiln rank {}: stage {} of {}", rank(), stage_, stages_));
}

Device Pipeline::device() const {
  for (const Tensor& p : parameters()) return p.device();
  return Device::cpu();
}

int64_t Pipeline::peer(int64_t offset) const {
  return options_.group_.world_rank(static_cast<int>(stage_ + offset));
}

double Pipeline::theoretical_bubble() const {
  const auto p = static_cast<double>(stages_), m = static_cast<double>(options_.micro_batches_);
  return (p - 1) / (m + p - 1);
}

Tensor Pipeline::run_stage(const Tensor& x) {
  Tensor h = x;
  for (nn::AnyModule& layer : layers_) h = layer.forward(h);
  return h;
}

Tensor Pipeline::train_step(optim::Optimizer& opt, const Tensor& input, const Tensor& target, const LossFn& loss_fn) {
  const auto start = std::chrono::steady_clock::now();
  const double waited_before = jit::stats().recv_wait_seconds;
  const int64_t m = options_.micro_batches_;
  KILN_CHECK(input.dim() >= 1 && target.dim() >= 1 && input.size(0) == target.size(0) && input.size(0) % m == 0,
             "Pipeline::train_step", "the batch ({} input, {} target) must split along axis 0 into {} equal micro-batches",
             input.str(), target.str(), m);
  const int64_t per = input.size(0) / m;
  const auto key = std::make_tuple(input.shape(), input.dtype(), m);
  const bool known = layouts_.count(key) > 0;
  if (!known) {
    Shape micro = input.shape();
    micro[0] = per;
    layouts_[key] = is_first() ? std::make_pair(micro, input.dtype()) : recv_layout(peer(-1));
  }

  const std::vector<Tensor> params = opt.parameters();
  std::vector<Tensor> xs(static_cast<size_t>(m)), ys(static_cast<size_t>(m)), losses(static_cast<size_t>(m));
  std::vector<Tensor> sums(params.size()), outputs;
  Tensor loss;
  int64_t live = 0;
  last_.peak_live_micro_batches = 0;
  for (const PipelineAction& a : pipeline_order(options_.schedule_, stages_, stage_, m)) {
    const auto k = static_cast<size_t>(a.micro_batch);
    TraceLabel label(fmt::format("{} {}", a.forward ? "forward" : "backward", a.micro_batch));
    if (a.forward) {
      if (is_first()) {
        xs[k] = input.slice(0, a.micro_batch * per, (a.micro_batch + 1) * per);
      } else {
        const auto& [shape, dtype] = layouts_.at(key);
        xs[k] = prim::recv(shape, dtype, peer(-1), activation_tag(a.micro_batch), device());
        xs[k].requires_grad_();
      }
      ys[k] = run_stage(xs[k]);
      if (is_last()) {
        losses[k] = loss_fn(ys[k], target.slice(0, a.micro_batch * per, (a.micro_batch + 1) * per)) /
                    static_cast<double>(m);
      } else {
        if (!known && a.micro_batch == 0) send_layout(ys[k], peer(1));
        NoGradGuard no_grad;
        outputs.push_back(prim::send(ys[k].detach(), peer(1), activation_tag(a.micro_batch)));
      }
      last_.peak_live_micro_batches = std::max(last_.peak_live_micro_batches, ++live);
      continue;
    }
    std::vector<Tensor> wrt = params;
    if (!is_first()) wrt.push_back(xs[k]);
    std::vector<Tensor> grads;
    if (is_last()) {
      grads = grad(losses[k], wrt);
      NoGradGuard no_grad;
      loss = loss.defined() ? loss + losses[k].detach() : losses[k].detach();
    } else {
      Tensor g = prim::recv(ys[k].shape(), ys[k].dtype(), peer(1), gradient_tag(a.micro_batch), ys[k].device());
      grads = grad(ys[k], wrt, g);
    }
    NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) sums[i] = accumulate(sums[i], grads[i]);
    if (!is_first()) outputs.push_back(prim::send(grads.back(), peer(-1), gradient_tag(a.micro_batch)));
    xs[k] = ys[k] = losses[k] = Tensor();
    --live;
  }
  if (loss.defined()) outputs.push_back(loss);
  TraceLabel label("update");
  opt.apply_gradients(std::move(sums), std::move(outputs));
  if (auto plan = memory::last_plan()) last_.arena_bytes = plan->arena_bytes;
  last_.step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  last_.recv_wait_seconds = jit::stats().recv_wait_seconds - waited_before;
  return loss;
}

Tensor Pipeline::forward(const Tensor& x) {
  const auto key = std::make_tuple(x.shape(), x.dtype(), int64_t{0});
  const bool known = layouts_.count(key) > 0;
  if (!known) layouts_[key] = is_first() ? std::make_pair(x.shape(), x.dtype()) : recv_layout(peer(-1));
  Tensor in = x;
  if (!is_first()) {
    const auto& [shape, dtype] = layouts_.at(key);
    in = prim::recv(shape, dtype, peer(-1), kForwardTag, device());
  }
  Tensor y = run_stage(in);
  // Realized at once: a receive left pending would keep the stage before waiting for it.
  if (is_last()) return y.realize();
  if (!known) send_layout(y, peer(1));
  Tensor token = prim::send(y.detach(), peer(1), kForwardTag);
  sync({token});
  return {};
}

}  // namespace kiln::distributed
