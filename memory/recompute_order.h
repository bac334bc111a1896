// The order in which a pending graph's nodes run when it holds recomputed copies (checkpoint
// segments, KILN_MEMORY_BUDGET): memory policy, so it lives with recomputation; jit/collect.cc
// applies it to the canonical order before the graph is keyed.
#pragma once
#include <vector>

#include "core/node.h"

namespace kiln::memory {

// For each compute node of `nodes` (in order), calls visit(i, value) for every realized value it
// reads, directly or through views (which are fused into their readers).
template <typename Visit>
void for_each_realized_read(const std::vector<NodePtr>& nodes, Visit visit) {
  const int n = static_cast<int>(nodes.size());
  std::vector<const Node*> viewed(n, nullptr);  // the realized value under a view
  for (int i = 0; i < n; ++i) {
    const Node& node = *nodes[i];
    if (op_kind(node.op) == OpKind::Movement) {
      const Node* in = node.inputs[0].get();
      viewed[i] = in->realized() ? in : viewed[in->visit_index];
      continue;
    }
    for (const NodePtr& in : node.inputs) {
      const Node* value = in->realized() ? in.get() : viewed[in->visit_index];
      if (value) visit(i, value);
    }
  }
}

// Orders a graph holding recomputed copies (memory/recompute.h) for memory, not by the DFS alone:
// the DFS would compute a checkpoint segment's copies as soon as it first meets them and keep
// them, with the gradients, until the weight gradients at the very end.
//  - Lazy nodes are computed on demand, right before their first consumer: the copies, values
//    derived only from them (e.g. a relu mask in the backward), views and generators.
//  - Of the other nodes whose inputs are ready, one that is the last reader of a buffer goes first
//    (e.g. a weight gradient, freeing the activation it reads), and so does the compressed copy
//    of a saved value (memory/compress.h), so the full-width value dies with its last forward
//    reader; otherwise the DFS order holds.
//  - A parameter update still comes after every other reader of the old value.
// Graphs without copies (recomputed or compressed) keep the DFS order.
void order_for_recompute(std::vector<NodePtr>& nodes);

}  // namespace kiln::memory
