#include "core/autograd.h"

#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "core/autocast.h"
#include "core/flags.h"
#include "memory/recompute.h"
#include "ops/ops.h"

namespace kiln {

namespace {
thread_local bool g_grad_enabled = true;
thread_local int g_compress = -1;  // CompressActivationsGuard: -1 none, 0 off, 1 on
thread_local bool g_recording_backward = false;

struct RecordingBackward {
  bool previous = g_recording_backward;
  RecordingBackward() { g_recording_backward = true; }
  ~RecordingBackward() { g_recording_backward = previous; }
};

// Nodes between `root` and the gradient leaves, inputs before consumers. Owning pointers: the
// sweep may free the history of realized nodes while the caller still reads the results.
std::vector<NodePtr> autograd_order(Node* root) {
  std::vector<NodePtr> order;
  std::unordered_set<Node*> seen;
  std::vector<std::pair<Node*, size_t>> stack{{root, 0}};
  seen.insert(root);
  while (!stack.empty()) {
    auto& [node, next] = stack.back();
    if (!node->grad_leaf && next < node->inputs.size()) {
      Node* in = node->inputs[next++].get();
      if (in->requires_grad && seen.insert(in).second) stack.push_back({in, 0});
      continue;
    }
    order.push_back(node->shared_from_this());
    stack.pop_back();
  }
  return order;
}

struct Backward {
  std::vector<NodePtr> order;                 // keeps every visited node alive
  std::unordered_map<Node*, Tensor> grads;    // the gradient reaching each of them
};

// Runs the backward sweep and returns the gradient reaching every visited node.
Backward backpropagate(const Tensor& output, const Tensor& grad_output, bool retain_graph) {
  const NodePtr& root = output.node();
  KILN_CHECK(!(root->backward_done && root->inputs.empty() && !root->grad_leaf), "grad",
             "the graph behind {} was already used by a backward pass and freed; compute every gradient "
             "you need before realizing, or pass retain_graph = true to the first grad()/backward()",
             output.str());
  KILN_CHECK(output.requires_grad(), "grad",
             "the output {} does not depend on any tensor with requires_grad; mark parameters with "
             "requires_grad_() before computing the output",
             output.str());
  Tensor seed = grad_output;
  if (!seed.defined()) {
    KILN_CHECK(output.numel() == 1, "grad",
               "output {} has {} elements; pass grad_output or reduce it (e.g. .sum()) first",
               shape_str(output.shape()), output.numel());
    seed = ones_like(output);
  }
  KILN_CHECK(seed.shape() == output.shape(), "grad", "grad_output shape {} differs from output shape {}",
             shape_str(seed.shape()), shape_str(output.shape()));
  NoGradGuard no_grad;
  RecordingBackward recording;
  Backward result;
  auto& grads = result.grads;
  // Gradients run in the dtype of each forward value (PyTorch: autocast never applies to the
  // backward); a rule's sum or exp must not widen them.
  AutocastGuard no_autocast(false);
  grads[output.node().get()] = cast(seed, output.dtype());
  result.order = autograd_order(output.node().get());
  // Inside checkpoint segments the rules read recomputed copies (memory/recompute.h), so the
  // forward originals serve only the forward and die early.
  std::unordered_map<Node*, NodePtr> recomputed;
  for (auto it = result.order.rbegin(); it != result.order.rend(); ++it) {
    Node* node = it->get();
    if (node->grad_leaf || node->inputs.empty()) continue;
    auto found = grads.find(node);
    if (found == grads.end()) continue;
    if (node->segment && !recomputed.count(node)) memory::recompute_segment(*node->segment, recomputed);
    auto copy = recomputed.find(node);
    NodePtr rule_node = copy != recomputed.end() ? copy->second : node->shared_from_this();
    std::vector<Tensor> in_grads = grad_rule(node->op)(rule_node, found->second);
    for (size_t i = 0; i < node->inputs.size() && i < in_grads.size(); ++i) {
      Node* in = node->inputs[i].get();
      if (!in->requires_grad || !in_grads[i].defined()) continue;
      auto [slot, inserted] = grads.try_emplace(in, in_grads[i]);
      if (!inserted) slot->second = add(slot->second, in_grads[i]);
    }
  }
  if (!retain_graph)
    for (const NodePtr& node : result.order) {
      if (node->grad_leaf) continue;
      node->backward_done = true;
      if (node->realized()) node->inputs.clear();  // its value is all the backward graph reads
    }
  return result;
}
}  // namespace

bool grad_enabled() { return g_grad_enabled; }
bool recording_backward() { return g_recording_backward; }
// Runs for every node recorded: the flag's only accepted values are "" and "int8".
bool compressing_activations() { return g_compress >= 0 ? g_compress == 1 : !flags().compress_activations.empty(); }
CompressActivationsGuard::CompressActivationsGuard(bool on) : previous_(g_compress) { g_compress = on ? 1 : 0; }
CompressActivationsGuard::~CompressActivationsGuard() { g_compress = previous_; }
NoGradGuard::NoGradGuard() : previous_(g_grad_enabled) { g_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { g_grad_enabled = previous_; }

std::vector<Tensor> grad(const Tensor& output, const std::vector<Tensor>& inputs, const Tensor& grad_output,
                         bool retain_graph) {
  Backward backward = backpropagate(output, grad_output, retain_graph);
  auto& grads = backward.grads;
  std::vector<Tensor> result;
  NoGradGuard no_grad;
  AutocastGuard no_autocast(false);
  for (const Tensor& in : inputs) {
    auto it = grads.find(in.node().get());
    result.push_back(it != grads.end() ? it->second : zeros(in.shape(), in.dtype()));
  }
  return result;
}

void Tensor::backward(bool retain_graph) const {
  Backward backward = backpropagate(*this, {}, retain_graph);
  NoGradGuard no_grad;
  AutocastGuard no_autocast(false);
  // Threads may call backward() through the parameters of one model at once (docs/guide.md, "What
  // kiln guarantees"): each addition to a .grad is then one at a time, in the order they come.
  static std::mutex accumulate;
  std::lock_guard<std::mutex> lock(accumulate);
  for (auto& [node, g] : backward.grads) {
    if (!node->grad_leaf) continue;
    std::shared_ptr<Var> v = node->var.lock();
    if (!v || v->node.get() != node) continue;
    v->grad = v->grad ? TensorAccess::var(add(TensorAccess::from_var(v->grad), g)) : TensorAccess::var(g);
  }
}

void set_gradient_reducer(const Tensor& param, const std::shared_ptr<GradientReducer>& reducer) {
  KILN_CHECK(param.defined(), "set_gradient_reducer", "the parameter is an undefined tensor");
  TensorAccess::var(param)->reducer = reducer;
}

std::shared_ptr<GradientReducer> gradient_reducer(const Tensor& param) {
  return param.defined() ? TensorAccess::var(param)->reducer.lock() : nullptr;
}

}  // namespace kiln
