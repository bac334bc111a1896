#include "jit/schedule.h"

#include <algorithm>
#include <unordered_map>

namespace kiln::jit {

namespace {
// Elementwise work a fused node adds to each kernel that inlines it.
constexpr int kMaxDuplicatedCost = 4;
}  // namespace

Schedule schedule(const PendingGraph& graph) {
  Schedule out;
  std::vector<bool>& materialized = out.materialized;
  std::vector<int>& alias_base = out.alias_base;
  std::unordered_map<const Node*, int> position;  // pending node -> index
  size_t n = graph.nodes.size();
  for (size_t i = 0; i < n; ++i) position[graph.nodes[i].get()] = static_cast<int>(i);
  std::vector<int> consumers(n, 0);
  for (size_t i = 0; i < n; ++i) {
    std::vector<const Node*> seen;
    for (const NodePtr& in : graph.nodes[i]->inputs) {
      auto it = position.find(in.get());
      if (it == position.end() || std::find(seen.begin(), seen.end(), in.get()) != seen.end()) continue;
      seen.push_back(in.get());
      consumers[it->second]++;
    }
  }
  materialized.assign(n, false);
  for (int o : graph.outputs) materialized[o] = true;
  // A compressed copy of a saved value (memory/compress.h) is stored where the backward reads
  // it: that narrow buffer is what the step keeps, not the value it was computed from.
  for (size_t i = 0; i < n; ++i) {
    if (graph.nodes[i]->saved_copy) continue;
    for (const NodePtr& in : graph.nodes[i]->inputs)
      if (auto it = position.find(in.get()); in->saved_copy && it != position.end()) materialized[it->second] = true;
  }
  // A gather reads its source from memory, through reshapes (the same memory): the buffer under
  // them. Known before the costs below, so that what is computed from it is not priced as if the
  // source were recomputed everywhere.
  auto gather_source = [&](const Node* node) {
    const Node* base = node->inputs[0].get();
    for (auto it = position.find(base); base->op == Op::Reshape && it != position.end() && !materialized[it->second];
         it = position.find(base))
      base = base->inputs[0].get();
    return position.find(base);
  };
  for (size_t i = 0; i < n; ++i)
    if (graph.nodes[i]->op == Op::Gather)
      if (auto it = gather_source(graph.nodes[i].get()); it != position.end()) materialized[it->second] = true;
  std::vector<int> cost(n, 0);
  // From elementwise node i down the one input that carries its cost, through nodes read only
  // there: the first node of a narrower dtype that is itself too expensive to duplicate, or -1.
  auto narrower_source = [&](size_t i) {
    const size_t width = dtype_size(graph.nodes[i]->dtype);
    int at = static_cast<int>(i);
    for (int depth = 0; depth < 4; ++depth) {
      const Node* node = graph.nodes[static_cast<size_t>(at)].get();
      if (!is_elementwise(node->op)) return -1;
      int next = -1;
      for (const NodePtr& in : node->inputs) {
        auto it = position.find(in.get());
        if (it == position.end() || materialized[it->second] || cost[it->second] <= 1) continue;
        if (next >= 0 && next != it->second) return -1;  // two expensive inputs
        next = it->second;
      }
      if (next < 0 || consumers[next] != 1) return -1;
      const Node* source = graph.nodes[static_cast<size_t>(next)].get();
      if (dtype_size(source->dtype) < width && cost[next] > kMaxDuplicatedCost && is_elementwise(source->op)) return next;
      at = next;
    }
    return -1;
  };
  for (size_t i = 0; i < n; ++i) {
    const Node* node = graph.nodes[i].get();
    OpKind kind = op_kind(node->op);
    if (kind == OpKind::Reduce || kind == OpKind::Library || node->op == Op::ScatterAdd) materialized[i] = true;
    int c = kind == OpKind::Movement || node->op == Op::Full || node->op == Op::Iota ? 0
            : node->op == Op::RandUniform || node->op == Op::RandNormal             ? 3
                                                                                     : 1;
    for (const NodePtr& in : node->inputs) {
      auto it = position.find(in.get());
      if (it != position.end() && !materialized[it->second]) c += cost[it->second];
    }
    cost[i] = c;
    if (consumers[i] > 1 && c > kMaxDuplicatedCost) {
      // A shared value that is a cheap widening of a narrower expensive one (an int32 position
      // computed from an int8 offset): store the narrow one and recompute the rest where read.
      const int narrow = narrower_source(i);
      if (narrow >= 0 && c - cost[narrow] <= kMaxDuplicatedCost) {
        materialized[narrow] = true;
        cost[i] = c - cost[narrow];
      } else {
        materialized[i] = true;
      }
    }
  }
  // Library ops and gathers read their operands from memory.
  for (size_t i = 0; i < n; ++i) {
    const Node* node = graph.nodes[i].get();
    auto need_buffer = [&](const NodePtr& in) {
      auto it = position.find(in.get());
      if (it != position.end()) materialized[it->second] = true;
    };
    if (node->op == Op::Gather)
      if (auto it = gather_source(node); it != position.end()) materialized[it->second] = true;
    const bool strided_operands =
        node->op == Op::Matmul || node->op == Op::Attention || node->op == Op::AttentionBackward;
    if (op_kind(node->op) == OpKind::Library && !strided_operands) {
      // Convolutions read contiguous buffers; a reshape of one is the same memory.
      for (const NodePtr& in : node->inputs) {
        const Node* base = in.get();
        for (auto it = position.find(base); !base->realized() && base->op == Op::Reshape &&
                                            it != position.end() && !materialized[it->second];
             it = position.find(base))
          base = base->inputs[0].get();
        auto it = position.find(base);
        if (!base->realized() && it != position.end()) materialized[it->second] = true;
      }
    }
    if (strided_operands) {
      // Views (transpose, broadcast batch, slices) of a buffer are passed as strides instead.
      for (const NodePtr& in : node->inputs) {
        const Node* base = in.get();
        bool pure_view = true;
        while (!base->realized() && op_kind(base->op) == OpKind::Movement) {
          if (base->op == Op::Pad) pure_view = false;
          base = base->inputs[0].get();
          auto it = position.find(base);
          if (it != position.end() && materialized[it->second]) break;
        }
        auto it = position.find(base);
        bool base_is_buffer = base->realized() || (it != position.end() && materialized[it->second]);
        if (!pure_view) {
          need_buffer(in);
        } else if (!base_is_buffer) {
          // Store the value under the views, so its other consumers (e.g. the backward's
          // transposed matmul and an activation's gradient) read it instead of recomputing it.
          materialized[it->second] = true;
        }
      }
    }
  }
  // Outputs that only reshape a buffer (e.g. a scalar loss out of a [1, 1] sum) share it.
  alias_base.assign(n, -1);
  for (int o : graph.outputs) {
    const Node* base = graph.nodes[o].get();
    while (base->op == Op::Reshape && !base->realized()) {
      base = base->inputs[0].get();
      auto it = position.find(base);
      if (it == position.end() || materialized[it->second]) break;
    }
    auto it = position.find(base);
    if (base == graph.nodes[o].get() || it == position.end() || !materialized[it->second]) continue;
    materialized[o] = false;
    alias_base[o] = it->second;
  }
  return out;
}

}  // namespace kiln::jit
