// saved_for_backward (jit/stats.h): which forward buffers the scheduled backward reads.
#include <unordered_map>
#include <unordered_set>

#include "core/autograd.h"
#include "jit/executor.h"
#include "jit/stats.h"

namespace kiln::jit {

namespace {
// A parameter, or autocast's copy of one (a Cast whose input is a parameter).
bool is_weight(const Node& n) {
  if (n.grad_leaf) return true;
  return n.op == Op::Cast && !n.inputs.empty() && n.inputs[0]->grad_leaf;
}
}  // namespace

SavedForBackward saved_for_backward(const Tensor& loss, const std::vector<Tensor>& params) {
  std::vector<Tensor> grads = grad(loss, params, {}, /*retain_graph=*/true);
  // The loss too, as a training step realizes it with the gradients: what the forward shares with
  // the backward is decided on the whole step.
  std::vector<NodePtr> targets;
  if (!loss.is_realized()) targets.push_back(loss.node());
  for (const Tensor& g : grads)
    if (!g.is_realized()) targets.push_back(g.node());
  SavedForBackward out;
  if (targets.empty()) return out;
  const ScheduledGraph scheduled = schedule_for(targets);
  const PendingGraph& graph = scheduled.graph;
  std::unordered_map<const Node*, size_t> position;  // (not visit_index: another walk may reuse it)
  for (size_t i = 0; i < graph.nodes.size(); ++i) position[graph.nodes[i].get()] = i;
  // Nodes are numbered in recording order: the backward's come after the loss, and so do
  // compressed copies of saved values (memory/compress.h), which are forward work.
  const uint64_t turn = loss.node()->id;
  std::unordered_set<const Node*> saved, seen;
  std::vector<const Node*> stack;
  for (const NodePtr& node : graph.nodes) {
    if (node->id <= turn || node->saved_copy) continue;
    for (const NodePtr& in : node->inputs) stack.push_back(in.get());
    while (!stack.empty()) {
      const Node* n = stack.back();
      stack.pop_back();
      if ((n->id > turn && !n->saved_copy) || !seen.insert(n).second) continue;
      if (n->realized() || scheduled.schedule.materialized[position.at(n)]) {
        saved.insert(n);
        continue;
      }
      for (const NodePtr& in : n->inputs) stack.push_back(in.get());  // fused: read what it reads
    }
  }
  std::unordered_set<const Storage*> counted;  // nodes that share one buffer (a tied weight's copy)
  for (const Node* n : saved) {
    if (op_kind(n->op) == OpKind::Leaf && !n->realized()) continue;  // constants and generators
    if (n->realized() && !counted.insert(n->storage.get()).second) continue;
    (is_weight(*n) ? out.weights : n->realized() ? out.inputs : out.activations) += static_cast<int64_t>(n->nbytes());
  }
  return out;
}

}  // namespace kiln::jit
