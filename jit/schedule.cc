#include "jit/schedule.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>

#include <fmt/format.h>

#include "core/error.h"
#include "ops/primitive.h"

namespace kiln::jit {

// ---------------------------------------------------------------------------------------------
// Collecting the pending graph
// ---------------------------------------------------------------------------------------------

namespace {
// Held nodes that are not worth keeping: recomputing them later is free. (A held reshape is
// kept: it usually shares the buffer under it, and dropping it would keep its whole history.)
bool is_cheap_view(Op op) {
  OpKind k = op_kind(op);
  return (k == OpKind::Movement && op != Op::Reshape) || op == Op::Full || op == Op::Iota;
}

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

// Moves each parameter update (a node that replaces a realized value) to just after the last
// other kernel reading the old value, so the executor can write the update in place, while its
// gradient still dies early. Positions in `nodes` (visit_index) are renumbered.
void defer_updates(std::vector<NodePtr>& nodes) {
  const int n = static_cast<int>(nodes.size());
  std::vector<int> updates;
  for (int i = 0; i < n; ++i) {
    NodePtr old = nodes[i]->replaces.lock();
    if (old && old->realized()) updates.push_back(i);
  }
  if (updates.empty()) return;
  // The last compute node reading each realized value, and each node's first consumer.
  std::unordered_map<const Node*, int> last_reader;
  for_each_realized_read(nodes, [&](int i, const Node* value) { last_reader[value] = i; });
  std::vector<int> first_consumer(n, n);
  for (int i = 0; i < n; ++i)
    for (const NodePtr& in : nodes[i]->inputs)
      if (!in->realized()) first_consumer[in->visit_index] = std::min(first_consumer[in->visit_index], i);
  std::vector<std::vector<int>> after(n);  // updates to emit right after node i
  std::vector<char> moved(n, 0);
  for (int u : updates) {
    const Node* old = nodes[u]->replaces.lock().get();
    auto it = last_reader.find(old);
    int target = it == last_reader.end() ? u : it->second;
    if (target <= u || target >= first_consumer[u]) continue;  // already late enough, or needed earlier
    after[target].push_back(u);
    moved[u] = 1;
  }
  std::vector<NodePtr> order;
  order.reserve(n);
  for (int i = 0; i < n; ++i) {
    if (!moved[i]) order.push_back(nodes[i]);
    for (int u : after[i]) order.push_back(nodes[u]);
  }
  nodes = std::move(order);
  for (int i = 0; i < n; ++i) nodes[i]->visit_index = i;
}

// Orders a graph holding recomputed copies (memory/recompute.h) for memory, not by the DFS alone:
// the DFS would compute a checkpoint segment's copies as soon as it first meets them and keep
// them, with the gradients, until the weight gradients at the very end.
//  - Lazy nodes are computed on demand, right before their first consumer: the copies, values
//    derived only from them (e.g. a relu mask in the backward), views and generators.
//  - Of the other nodes whose inputs are ready, one that is the last reader of a buffer goes first
//    (e.g. a weight gradient, freeing the activation it reads); otherwise the DFS order holds.
//  - A parameter update still comes after every other reader of the old value.
// Graphs without copies keep the DFS order.
void order_for_recompute(std::vector<NodePtr>& nodes) {
  const int n = static_cast<int>(nodes.size());
  // Pending inputs (distinct) and consumers, by position.
  std::vector<std::vector<int>> ins(n), consumers(n);
  for (int i = 0; i < n; ++i)
    for (const NodePtr& in : nodes[i]->inputs) {
      if (in->realized()) continue;
      int p = static_cast<int>(in->visit_index);
      if (std::find(ins[i].begin(), ins[i].end(), p) != ins[i].end()) continue;
      ins[i].push_back(p);
      consumers[p].push_back(i);
    }
  // derived: computed from copies and constants only. anchored: a lazy node that (not through a
  // copy) reads a value computed in order, e.g. a view of a gradient; it stops `derived`.
  std::vector<char> derived(n), lazy(n), anchored(n);
  std::vector<int> base(n, -1);  // the buffer a node's value lives in (views: their source's)
  for (int i = 0; i < n; ++i) {
    const Node& node = *nodes[i];
    bool reads_anchor = false, any_derived = false;
    for (int p : ins[i]) {
      reads_anchor |= !lazy[p] || anchored[p];
      any_derived |= derived[p] != 0;
    }
    derived[i] = node.recompute || (any_derived && !reads_anchor);
    lazy[i] = derived[i] || op_kind(node.op) == OpKind::Movement || op_kind(node.op) == OpKind::Leaf;
    anchored[i] = lazy[i] && !node.recompute && reads_anchor;
    if (op_kind(node.op) == OpKind::Movement) {
      const Node& source = *node.inputs[0];
      base[i] = source.realized() ? -1 : base[source.visit_index];
    } else if (op_kind(node.op) != OpKind::Leaf) {
      base[i] = i;
    }
  }
  // Buffers each non-view node reads, and how many readers each buffer has left.
  std::vector<std::vector<int>> reads(n), readers(n);
  std::vector<int> remaining(n, 0);
  for (int i = 0; i < n; ++i) {
    if (base[i] != i) continue;
    for (int p : ins[i]) {
      int b = base[p];
      if (b < 0 || std::find(reads[i].begin(), reads[i].end(), b) != reads[i].end()) continue;
      reads[i].push_back(b);
      readers[b].push_back(i);
      remaining[b]++;
    }
  }

  std::vector<int> unsatisfied(n), order;
  // A parameter update (assign) waits for every other reader of the value it replaces, so the
  // executor can still write it in place (jit/executor.cc find_in_place_updates).
  std::unordered_map<const Node*, int> update_of;
  for (int i = 0; i < n; ++i)
    if (NodePtr old = nodes[i]->replaces.lock(); old && old->realized()) update_of[old.get()] = i;
  std::vector<std::vector<int>> unblocks(n);
  if (!update_of.empty())
    for_each_realized_read(nodes, [&](int i, const Node* value) {
      auto it = update_of.find(value);
      if (it == update_of.end() || it->second == i) return;
      unblocks[i].push_back(it->second);
      unsatisfied[it->second]++;
    });
  std::vector<char> emitted(n, 0);
  std::set<int> ready, freeing;  // by DFS position
  auto frees = [&](int i) {
    for (int b : reads[i])
      if (emitted[b] && remaining[b] == 1) return true;
    return false;
  };
  // A node is satisfied once its value can be had: emitted, or lazy with satisfied inputs.
  std::vector<int> work;
  auto release = [&](int c) {  // one more of c's inputs (or blockers) is done
    if (--unsatisfied[c] != 0) return;
    if (lazy[c]) {
      work.push_back(c);
    } else {
      ready.insert(c);
      if (frees(c)) freeing.insert(c);
    }
  };
  auto drain = [&] {  // lazy nodes whose inputs are all satisfied are satisfied too
    while (!work.empty()) {
      int j = work.back();
      work.pop_back();
      for (int c : consumers[j]) release(c);
    }
  };
  auto satisfy = [&](int start) {
    work.push_back(start);
    drain();
  };
  auto emit_one = [&](int j) {
    emitted[j] = 1;
    order.push_back(j);
    ready.erase(j);
    freeing.erase(j);
    for (int b : reads[j])
      if (--remaining[b] == 1)
        for (int r : readers[b])
          if (!emitted[r] && ready.count(r)) freeing.insert(r);
    if (!lazy[j]) satisfy(j);
    for (int u : unblocks[j]) release(u);
    drain();
  };
  // Emits `i` after the lazy inputs it still needs, depth first.
  std::vector<std::pair<int, size_t>> stack;
  auto emit = [&](int i) {
    stack.push_back({i, 0});
    while (!stack.empty()) {
      auto& [j, next] = stack.back();
      if (next < ins[j].size()) {
        int p = ins[j][next++];
        if (!emitted[p]) stack.push_back({p, 0});
        continue;
      }
      int done = j;
      stack.pop_back();
      emit_one(done);
    }
  };
  std::vector<int> roots;
  for (int i = 0; i < n; ++i) {
    unsatisfied[i] += static_cast<int>(ins[i].size());
    if (unsatisfied[i] == 0) roots.push_back(i);
  }
  for (int i : roots) {
    if (lazy[i]) satisfy(i);
    else ready.insert(i);
  }
  while (!ready.empty()) emit(!freeing.empty() ? *freeing.begin() : *ready.begin());
  for (int i = 0; i < n; ++i)
    if (!emitted[i]) emit(i);  // lazy outputs nothing else reads
  KILN_CHECK(static_cast<int>(order.size()) == n, "jit", "internal: reordering lost {} of {} nodes",
             n - static_cast<int>(order.size()), n);

  std::vector<NodePtr> reordered(n);
  for (int k = 0; k < n; ++k) {
    reordered[k] = std::move(nodes[order[k]]);
    reordered[k]->visit_index = k;
  }
  nodes = std::move(reordered);
}
}  // namespace

PendingGraph collect_pending(const std::vector<NodePtr>& targets) {
  // Callers serialize walks (the executor's lock), so one epoch counter suffices.
  static uint64_t epoch = 0;
  const uint64_t walk = ++epoch;
  constexpr int64_t kOnStack = -1;
  auto seen = [walk](const Node* n) { return n->visit == walk; };
  PendingGraph g;
  std::vector<std::pair<Node*, size_t>> stack;
  // Parameter updates last: everything else (the loss, checks that may fail) runs before any
  // parameter is overwritten in place. And updates in reverse: parameters come in layer order,
  // so the last layer's update goes first and each layer's weight gradient is computed right
  // after the backward reaches it, instead of every layer's delta waiting for the first layer.
  std::vector<NodePtr> ordered = targets;
  auto updates = std::stable_partition(ordered.begin(), ordered.end(), [](const NodePtr& t) { return t->replaces.expired(); });
  std::reverse(updates, ordered.end());
  for (const NodePtr& t : ordered) {
    if (t->realized() || seen(t.get())) continue;
    t->visit = walk;
    t->visit_index = kOnStack;
    stack.push_back({t.get(), 0});
    while (!stack.empty()) {
      auto& [node, next] = stack.back();
      if (next < node->inputs.size()) {
        Node* in = node->inputs[next++].get();
        if (seen(in)) {
          if (in->realized()) g.external_edges[in->visit_index]++;
          continue;
        }
        in->visit = walk;
        if (in->realized()) {
          in->visit_index = static_cast<int64_t>(g.externals.size());
          g.externals.push_back(in->shared_from_this());
          g.external_edges.push_back(1);
        } else {
          in->visit_index = kOnStack;
          stack.push_back({in, 0});
        }
        continue;
      }
      node->visit_index = static_cast<int64_t>(g.nodes.size());
      g.nodes.push_back(node->shared_from_this());
      stack.pop_back();
    }
  }
  if (std::any_of(g.nodes.begin(), g.nodes.end(), [](const NodePtr& n) { return n->recompute; }))
    order_for_recompute(g.nodes);
  else
    defer_updates(g.nodes);
  std::vector<bool> is_output(g.nodes.size(), false);
  for (const NodePtr& t : targets)
    if (!t->realized()) is_output[t->visit_index] = true;
  for (size_t i = 0; i < g.nodes.size(); ++i)
    if (g.nodes[i]->held > 0 && !is_cheap_view(g.nodes[i]->op) && op_kind(g.nodes[i]->op) != OpKind::Leaf)
      is_output[i] = true;
  for (size_t i = 0; i < g.nodes.size(); ++i)
    if (is_output[i]) g.outputs.push_back(static_cast<int>(i));

  // The structural key: everything that changes the generated code, nothing that is data.
  // Raw bytes, not text: this runs on every realize and must cost microseconds.
  std::string& key = g.key;
  key.reserve(64 * (g.nodes.size() + g.externals.size()));
  auto put = [&key](int64_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof v); };
  auto put_list = [&](const std::vector<int64_t>& values) {
    put(static_cast<int64_t>(values.size()));
    for (int64_t v : values) put(v);
  };
  for (const NodePtr& e : g.externals) {
    put(static_cast<int64_t>(e->dtype) | static_cast<int64_t>(e->device.kind) << 8 | int64_t{e->device.index} << 16);
    put_list(e->shape);
  }
  for (const NodePtr& n : g.nodes) {
    put(static_cast<int64_t>(n->op) | static_cast<int64_t>(n->dtype) << 8 | static_cast<int64_t>(n->device.kind) << 16 |
        int64_t{n->device.index} << 24);
    put_list(n->shape);
    put_list(n->ints);
    put(static_cast<int64_t>(n->inputs.size()));
    for (const NodePtr& in : n->inputs)
      put(in->realized() ? -1 - in->visit_index : in->visit_index);
  }
  put(-1);
  for (int o : g.outputs) put(o);
  // Which external an output replaces (a parameter update): its buffer may be reused in place.
  put(-2);
  g.replaced_external.assign(g.outputs.size(), -1);
  for (size_t i = 0; i < g.outputs.size(); ++i) {
    NodePtr previous = g.nodes[g.outputs[i]]->replaces.lock();
    if (previous && previous->visit == walk && previous->realized())
      g.replaced_external[i] = static_cast<int>(previous->visit_index);
    put(g.replaced_external[i]);
  }
  return g;
}

// ---------------------------------------------------------------------------------------------
// Scheduling
// ---------------------------------------------------------------------------------------------

namespace {

// Elementwise work a fused node adds to each kernel that inlines it.
constexpr int kMaxDuplicatedCost = 4;

struct Scheduler {
  const PendingGraph& graph;
  Schedule out;
  std::unordered_map<const Node*, int> position;  // pending node -> index
  std::unordered_map<const Node*, int> slot_of;   // materialized or external node -> plan slot
  std::vector<bool> materialized;
  std::vector<int> alias_base;  // per node: the node whose buffer an alias output shares, or -1
  std::unordered_map<const Node*, int> scalar_slot, rand_slot;

  explicit Scheduler(const PendingGraph& g) : graph(g) {}

  bool has_slot(const Node* n) const { return slot_of.count(n) > 0; }

  void decide_materialization();
  void assign_slots();
  void build_kernels();
};

// ---- fusion decisions ----

void Scheduler::decide_materialization() {
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
  std::vector<int> cost(n, 0);
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
    if (consumers[i] > 1 && c > kMaxDuplicatedCost) materialized[i] = true;
  }
  // Library ops and gathers read their operands from memory.
  for (size_t i = 0; i < n; ++i) {
    const Node* node = graph.nodes[i].get();
    auto need_buffer = [&](const NodePtr& in) {
      auto it = position.find(in.get());
      if (it != position.end()) materialized[it->second] = true;
    };
    if (node->op == Op::Gather) need_buffer(node->inputs[0]);
    if (op_kind(node->op) == OpKind::Library && node->op != Op::Matmul) {
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
    if (node->op == Op::Matmul) {
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
}

void Scheduler::assign_slots() {
  for (size_t e = 0; e < graph.externals.size(); ++e) {
    const Node* node = graph.externals[e].get();
    slot_of[node] = static_cast<int>(out.slots.size());
    out.slots.push_back({static_cast<int>(e), -1, node->dtype, node->numel(), false});
  }
  std::vector<bool> is_output(graph.nodes.size(), false);
  for (int o : graph.outputs) is_output[o] = true;
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    const Node* node = graph.nodes[i].get();
    if (node->op == Op::Full) {
      scalar_slot[node] = static_cast<int>(out.scalar_nodes.size());
      out.scalar_nodes.push_back(static_cast<int>(i));
    }
    if (node->op == Op::RandUniform || node->op == Op::RandNormal) {
      rand_slot[node] = static_cast<int>(out.rand_nodes.size()) * 2;
      out.rand_nodes.push_back(static_cast<int>(i));
    }
    if (!materialized[i]) continue;
    slot_of[node] = static_cast<int>(out.slots.size());
    out.slots.push_back({-1, static_cast<int>(i), node->dtype, node->numel(), is_output[i], is_output[i]});
  }
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    if (alias_base[i] < 0) continue;
    int slot = slot_of.at(graph.nodes[alias_base[i]].get());
    out.slots[slot].keep = true;
    out.aliases.push_back({static_cast<int>(i), slot});
  }
}

// ---- building one kernel's IR ----

class KernelBuilder {
 public:
  KernelBuilder(const Scheduler& s, Kernel& k) : s_(s), k_(k) {}

  // Index of `node`'s value at multi-index `idx`, fused down to buffers, constants and generators.
  int value(const Node* node, const std::vector<IndexExpr>& idx, bool is_root = false);
  int buffer(int slot, DType dtype, bool written = false);
  IndexExpr linear(const std::vector<IndexExpr>& idx, const Shape& shape) {
    IndexExpr r = k_.ctx.constant(0);
    auto strides = contiguous_strides(shape);
    for (size_t d = 0; d < idx.size(); ++d) r = k_.ctx.add(r, k_.ctx.scale(idx[d], strides[d]));
    return r;
  }
  void note(Op op) {
    if (ops_seen_ < 6) k_.summary += fmt::format("{} ", op_name(op));
    ops_seen_++;
  }

 private:
  std::vector<Guard> pad_guards_;  // of the pads enclosing the value being built

  int push(Expr e) {
    std::string key = fmt::format("{}:{}:{}:{}:{}:{}:{}:{}", static_cast<int>(e.kind), static_cast<int>(e.op),
                                  static_cast<int>(e.dtype), fmt::join(e.args, ","), e.buffer, e.slot,
                                  k_.ctx.render(e.index), e.stride);
    for (const Guard& g : e.guards) key += fmt::format("|{}:{}:{}", k_.ctx.render(g.expr), g.lo, g.hi);
    auto it = memo_.find(key);
    if (it != memo_.end()) return it->second;
    k_.exprs.push_back(std::move(e));
    int id = static_cast<int>(k_.exprs.size() - 1);
    memo_[key] = id;
    return id;
  }

  const Scheduler& s_;
  Kernel& k_;
  std::map<std::string, int> memo_;
  int ops_seen_ = 0;
};

int KernelBuilder::buffer(int slot, DType dtype, bool written) {
  for (size_t i = 0; i < k_.buffers.size(); ++i)
    if (k_.buffers[i].slot == slot) return static_cast<int>(i);
  k_.buffers.push_back({slot, dtype, written});
  return static_cast<int>(k_.buffers.size() - 1);
}

int KernelBuilder::value(const Node* node, const std::vector<IndexExpr>& idx, bool is_root) {
  IndexContext& ctx = k_.ctx;
  if (!is_root) {
    // Reshapes of a buffer keep its linear index: load there directly rather than through the
    // div/mod decomposition, which the simplifier cannot always fold back.
    const Node* base = node;
    while (!s_.slot_of.count(base) && base->op == Op::Reshape && !base->realized()) base = base->inputs[0].get();
    auto slot = s_.slot_of.find(base);
    if (slot != s_.slot_of.end()) {
      Expr e{Expr::Kind::Load};
      e.dtype = base->dtype;
      e.buffer = buffer(slot->second, base->dtype);
      e.index = linear(idx, node->shape);
      // Under a pad the index may point outside the buffer where the pad's guard fails (the
      // value is then discarded); such a load must not touch memory at that index.
      if (ctx.min(e.index) < 0 || ctx.max(e.index) >= base->numel()) e.guards = pad_guards_;
      return push(std::move(e));
    }
  }
  const Shape& in_shape = node->inputs.empty() ? node->shape : node->inputs[0]->shape;
  switch (op_kind(node->op)) {
    case OpKind::Leaf: {
      Expr e{Expr::Kind::Scalar};
      e.dtype = node->dtype;
      if (node->op == Op::Full) {
        e.slot = s_.scalar_slot.at(node);
      } else if (node->op == Op::Iota) {
        e.kind = Expr::Kind::Iota;
        e.index = idx[node->ints[0]];
      } else if (node->op == Op::RandUniform || node->op == Op::RandNormal) {
        e.kind = Expr::Kind::Rand;
        e.op = node->op;
        e.slot = s_.rand_slot.at(node);
        e.index = linear(idx, node->shape);
      } else {
        KILN_FAIL("jit", "input node without data in the pending graph");
      }
      return push(std::move(e));
    }
    case OpKind::Unary:
    case OpKind::Binary:
    case OpKind::Ternary: {
      note(node->op);
      Expr e{Expr::Kind::Compute};
      e.op = node->op;
      e.dtype = node->dtype;
      for (const NodePtr& in : node->inputs) e.args.push_back(value(in.get(), idx));
      return push(std::move(e));
    }
    case OpKind::Movement: {
      std::vector<IndexExpr> in_idx(in_shape.size(), ctx.constant(0));
      switch (node->op) {
        case Op::Reshape: {
          IndexExpr lin = linear(idx, node->shape);
          auto strides = contiguous_strides(in_shape);
          for (size_t d = 0; d < in_shape.size(); ++d)
            in_idx[d] = d == 0 ? ctx.div(lin, strides[0]) : ctx.mod(ctx.div(lin, strides[d]), in_shape[d]);
          if (!in_shape.empty() && ctx.max(in_idx[0]) >= in_shape[0]) in_idx[0] = ctx.mod(in_idx[0], in_shape[0]);
          break;
        }
        case Op::Permute:
          for (size_t d = 0; d < idx.size(); ++d) in_idx[node->ints[d]] = idx[d];
          break;
        case Op::Expand:
          for (size_t d = 0; d < idx.size(); ++d) in_idx[d] = in_shape[d] == 1 ? ctx.constant(0) : idx[d];
          break;
        case Op::Slice: {
          size_t r = in_shape.size();
          for (size_t d = 0; d < r; ++d)
            in_idx[d] = ctx.add(ctx.scale(idx[d], node->ints[r + d]), ctx.constant(node->ints[d]));
          break;
        }
        case Op::Pad: {
          size_t r = in_shape.size();
          std::vector<Guard> guards;
          for (size_t d = 0; d < r; ++d) {
            in_idx[d] = ctx.add(idx[d], ctx.constant(-node->ints[d]));
            if (node->ints[d] != 0 || node->ints[r + d] != 0) guards.push_back({in_idx[d], 0, in_shape[d]});
          }
          pad_guards_.insert(pad_guards_.end(), guards.begin(), guards.end());
          int inner = value(node->inputs[0].get(), in_idx);
          pad_guards_.resize(pad_guards_.size() - guards.size());
          if (guards.empty()) return inner;
          Expr e{Expr::Kind::Select};
          e.dtype = node->dtype;
          e.args = {inner};
          e.guards = std::move(guards);
          return push(std::move(e));
        }
        default: break;
      }
      return value(node->inputs[0].get(), in_idx);
    }
    case OpKind::Index: {
      // Gather: the source is a buffer; the index is fused.
      note(node->op);
      const Node* src = node->inputs[0].get();
      int axis = static_cast<int>(node->ints[0]);
      auto strides = contiguous_strides(src->shape);
      Expr e{Expr::Kind::GatherLoad};
      e.dtype = node->dtype;
      e.buffer = buffer(s_.slot_of.at(src), src->dtype);
      e.args = {value(node->inputs[1].get(), idx)};
      IndexExpr offset = ctx.constant(0);
      for (size_t d = 0; d < idx.size(); ++d)
        if (static_cast<int>(d) != axis) offset = ctx.add(offset, ctx.scale(idx[d], strides[d]));
      e.index = offset;
      e.stride = strides[axis];
      e.extent = src->shape[axis];
      return push(std::move(e));
    }
    default: KILN_FAIL("jit", "op {} cannot be fused", op_name(node->op));
  }
}

// Whether every address the kernel computes is affine in its loop variables (so a flat loop
// over all elements vectorizes).
bool all_affine(const Kernel& k) {
  for (const Expr& e : k.exprs) {
    if (!k.ctx.is_affine(e.index)) return false;
    for (const Guard& g : e.guards)
      if (!k.ctx.is_affine(g.expr)) return false;
  }
  return k.ctx.is_affine(k.store_index);
}

// Output multi-index over `shape` from one flat variable.
std::vector<IndexExpr> unflatten(IndexContext& ctx, const IndexExpr& flat, const Shape& shape) {
  std::vector<IndexExpr> idx(shape.size());
  auto strides = contiguous_strides(shape);
  for (size_t d = 0; d < shape.size(); ++d)
    idx[d] = d == 0 ? ctx.div(flat, strides[0]) : ctx.mod(ctx.div(flat, strides[d]), shape[d]);
  return idx;
}

Kernel build_elementwise(const Scheduler& s, const Node* node, int slot, bool flat) {
  Kernel k;
  k.kind = KernelKind::Elementwise;
  KernelBuilder b(s, k);
  b.buffer(slot, node->dtype, true);
  const Shape& shape = node->shape;
  int64_t n = node->numel();
  k.out_numel = n;
  std::vector<IndexExpr> idx;
  if (flat || shape.size() <= 1) {
    IndexExpr i = k.ctx.var("i", n);
    k.loops = {{"i", n, Loop::Role::Parallel}};
    idx = unflatten(k.ctx, i, shape);
    k.store_index = i;
  } else {
    int64_t inner = shape.back(), outer = n / std::max<int64_t>(inner, 1);
    IndexExpr o = k.ctx.var("o", outer), i = k.ctx.var("i", inner);
    k.loops = {{"o", outer, Loop::Role::Parallel}, {"i", inner, Loop::Role::Inner}};
    Shape outer_shape(shape.begin(), shape.end() - 1);
    idx = unflatten(k.ctx, o, outer_shape);
    idx.push_back(i);
    k.store_index = k.ctx.add(k.ctx.scale(o, inner), i);
  }
  k.value = b.value(node, idx, true);
  k.summary += shape_str(shape);
  return k;
}

Kernel build_reduce(const Scheduler& s, const Node* node, int slot, bool flat) {
  Kernel k;
  k.kind = KernelKind::Reduce;
  k.reduce_op = node->op;
  KernelBuilder b(s, k);
  b.buffer(slot, node->dtype, true);
  const Node* in = node->inputs[0].get();
  const Shape& in_shape = in->shape;
  k.out_numel = node->numel();
  std::vector<IndexExpr> idx;
  auto reduced = [&](int64_t ax) { return std::find(node->ints.begin(), node->ints.end(), ax) != node->ints.end(); };
  // The inner output axis: the last kept one, behind which only a few reduced elements may
  // follow (a pooling window's columns), so that consecutive outputs read nearby inputs.
  int64_t inner_axis = static_cast<int64_t>(in_shape.size()) - 1, trailing = 1;
  while (inner_axis >= 0 && reduced(inner_axis)) trailing *= in_shape[inner_axis--];
  const int64_t last = inner_axis >= 0 ? in_shape[inner_axis] : 1;
  if (k.out_numel > 1 && inner_axis >= 0 && last > 1 && trailing <= 16) {
    // Reducing over outer axes of rows (e.g. a bias gradient [B, N] -> [1, N]) or over small
    // windows: the inner output axis becomes the vectorized inner loop, with one accumulator per
    // element of it.
    k.column = true;
    int64_t outer = k.out_numel / last;
    IndexExpr o = k.ctx.var("o", outer), i = k.ctx.var("i", last);
    k.loops.push_back({"o", outer, Loop::Role::Parallel});
    Shape outer_shape(node->shape.begin(), node->shape.begin() + inner_axis);
    idx = unflatten(k.ctx, o, outer_shape);
    idx.push_back(i);
    idx.resize(in_shape.size(), k.ctx.constant(0));  // the trailing reduced axes, set below
    for (int64_t ax : node->ints) {
      std::string name = fmt::format("r{}", ax);
      idx[ax] = k.ctx.var(name, in_shape[ax]);
      k.loops.push_back({name, in_shape[ax], Loop::Role::Reduce});
    }
    k.loops.push_back({"i", last, Loop::Role::Inner});
    k.store_index = k.ctx.add(k.ctx.scale(o, last), i);
  } else if (k.out_numel == 1 && flat) {
    IndexExpr r = k.ctx.var("r", in->numel());
    k.loops = {{"r", in->numel(), Loop::Role::Reduce}};
    idx = unflatten(k.ctx, r, in_shape);
    k.store_index = k.ctx.constant(0);
  } else {
    IndexExpr o = k.ctx.var("o", k.out_numel);
    if (k.out_numel > 1) k.loops.push_back({"o", k.out_numel, Loop::Role::Parallel});
    idx = unflatten(k.ctx, o, node->shape);
    for (int64_t ax : node->ints) {
      std::string name = fmt::format("r{}", ax);
      idx[ax] = k.ctx.var(name, in_shape[ax]);
      k.loops.push_back({name, in_shape[ax], Loop::Role::Reduce});
    }
    k.store_index = o;
  }
  k.value = b.value(in, idx);
  b.note(node->op);
  k.summary += shape_str(in_shape) + "->" + shape_str(node->shape);
  return k;
}

Kernel build_scatter(const Scheduler& s, const Node* node, int slot) {
  Kernel k;
  k.kind = KernelKind::Scatter;
  KernelBuilder b(s, k);
  b.buffer(slot, node->dtype, true);
  const Node* index = node->inputs[0].get();
  const Node* src = node->inputs[1].get();
  int axis = static_cast<int>(node->ints[0]);
  const Shape& ishape = index->shape;
  Shape outer_shape;
  for (size_t d = 0; d < ishape.size(); ++d)
    if (static_cast<int>(d) != axis) outer_shape.push_back(ishape[d]);
  int64_t outer = numel(outer_shape);
  IndexExpr o = k.ctx.var("o", outer), a = k.ctx.var("a", ishape[axis]);
  k.loops = {{"o", outer, Loop::Role::Parallel}, {"a", ishape[axis], Loop::Role::Inner}};
  std::vector<IndexExpr> outer_idx = unflatten(k.ctx, o, outer_shape), idx;
  auto out_strides = contiguous_strides(node->shape);
  k.store_index = k.ctx.constant(0);
  for (size_t d = 0, j = 0; d < ishape.size(); ++d) {
    if (static_cast<int>(d) == axis) {
      idx.push_back(a);
    } else {
      idx.push_back(outer_idx[j++]);
      k.store_index = k.ctx.add(k.store_index, k.ctx.scale(idx.back(), out_strides[d]));
    }
  }
  k.scatter_stride = out_strides[axis];
  k.scatter_extent = node->shape[axis];
  k.out_numel = node->numel();
  k.scatter_index = b.value(index, idx);
  k.value = b.value(src, idx);
  b.note(node->op);
  k.summary += shape_str(ishape) + "->" + shape_str(node->shape);
  return k;
}

// The buffer and strides a matmul operand reads: a chain of views over a buffer.
void matmul_operand(Scheduler& s, Kernel& k, const Node* in, int& buffer_out, int64_t strides[3], int64_t& offset) {
  IndexContext ctx;  // its own variables: the operands have different extents
  std::vector<IndexExpr> idx = {ctx.var("b", in->shape[0]), ctx.var("m", in->shape[1]), ctx.var("n", in->shape[2])};
  auto linearize = [&](const std::vector<IndexExpr>& at, const Shape& shape) {
    IndexExpr lin = ctx.constant(0);
    auto st = contiguous_strides(shape);
    for (size_t d = 0; d < at.size(); ++d) lin = ctx.add(lin, ctx.scale(at[d], st[d]));
    return lin;
  };
  const Node* node = in;
  std::optional<IndexExpr> reshaped;  // set when reshapes lead straight to the buffer
  while (!s.has_slot(node)) {
    const Shape& src = node->inputs[0]->shape;
    std::vector<IndexExpr> next(src.size(), ctx.constant(0));
    if (node->op == Op::Reshape) {
      IndexExpr lin = linearize(idx, node->shape);
      const Node* base = node;
      while (!s.has_slot(base) && base->op == Op::Reshape) base = base->inputs[0].get();
      if (s.has_slot(base)) {  // the buffer's own linear index: no div/mod to fold back
        reshaped = lin;
        node = base;
        break;
      }
      auto sst = contiguous_strides(src);
      for (size_t d = 0; d < src.size(); ++d) next[d] = d == 0 ? ctx.div(lin, sst[0]) : ctx.mod(ctx.div(lin, sst[d]), src[d]);
    } else if (node->op == Op::Permute) {
      for (size_t d = 0; d < idx.size(); ++d) next[node->ints[d]] = idx[d];
    } else if (node->op == Op::Expand) {
      for (size_t d = 0; d < idx.size(); ++d) next[d] = src[d] == 1 ? ctx.constant(0) : idx[d];
    } else if (node->op == Op::Slice) {
      size_t r = src.size();
      for (size_t d = 0; d < r; ++d) next[d] = ctx.add(ctx.scale(idx[d], node->ints[r + d]), ctx.constant(node->ints[d]));
    } else {
      KILN_FAIL("jit", "matmul operand through {} is not a view", op_name(node->op));
    }
    idx = std::move(next);
    node = node->inputs[0].get();
  }
  IndexExpr lin = reshaped ? *reshaped : linearize(idx, node->shape);
  if (!ctx.is_affine(lin)) {
    // A reshape that mixes dims: copy the operand into a buffer of its own first.
    s.materialized[s.position.at(in)] = true;
    KILN_FAIL("jit-internal-retry", "operand needs a copy");
  }
  const char* names[3] = {"b", "m", "n"};
  for (int d = 0; d < 3; ++d) strides[d] = ctx.coefficient(lin, names[d]);
  offset = lin.constant;
  buffer_out = KernelBuilder(s, k).buffer(s.slot_of.at(node), node->dtype);
}

// The buffer under a convolution operand: decide_materialization gave it one, maybe under reshapes.
int contiguous_operand(Scheduler& s, Kernel& k, const Node* in) {
  const Node* node = in;
  while (!s.has_slot(node)) {
    KILN_CHECK(node->op == Op::Reshape, "jit", "convolution operand {} has no buffer", op_name(node->op));
    node = node->inputs[0].get();
  }
  return KernelBuilder(s, k).buffer(s.slot_of.at(node), node->dtype);
}

Kernel build_conv(Scheduler& s, const Node* node, int slot) {
  Kernel k;
  k.kind = KernelKind::Conv;
  KernelBuilder(s, k).buffer(slot, node->dtype, true);
  ConvCall& c = k.conv;
  c.pass = node->op == Op::Conv2d               ? ConvPass::Forward
           : node->op == Op::Conv2dBackwardData ? ConvPass::BackwardData
                                                : ConvPass::BackwardWeight;
  c.a_buffer = contiguous_operand(s, k, node->inputs[0].get());
  c.b_buffer = contiguous_operand(s, k, node->inputs[1].get());
  c.geometry = prim::conv_geometry(*node);
  k.out_numel = node->numel();
  k.summary = fmt::format("{} {} * {} -> {}", op_name(node->op), shape_str(node->inputs[0]->shape),
                          shape_str(node->inputs[1]->shape), shape_str(node->shape));
  return k;
}

void Scheduler::build_kernels() {
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    if (!materialized[i]) continue;
    const Node* node = graph.nodes[i].get();
    int slot = slot_of.at(node);
    Kernel k;
    switch (op_kind(node->op)) {
      case OpKind::Reduce:
        k = build_reduce(*this, node, slot, true);
        if (k.out_numel == 1 && !all_affine(k)) k = build_reduce(*this, node, slot, false);
        break;
      case OpKind::Library: {
        if (node->op != Op::Matmul) {
          k = build_conv(*this, node, slot);
          break;
        }
        k.kind = KernelKind::Matmul;
        KernelBuilder(*this, k).buffer(slot, node->dtype, true);
        MatmulCall& mm = k.matmul;
        matmul_operand(*this, k, node->inputs[0].get(), mm.a_buffer, mm.a_strides, mm.a_offset);
        matmul_operand(*this, k, node->inputs[1].get(), mm.b_buffer, mm.b_strides, mm.b_offset);
        mm.batch = node->shape[0];
        mm.M = node->shape[1];
        mm.K = node->inputs[0]->shape[2];
        mm.N = node->shape[2];
        k.out_numel = node->numel();
        k.summary = fmt::format("Matmul [{}, {}, {}, {}]", mm.batch, mm.M, mm.K, mm.N);
        break;
      }
      default:
        if (node->op == Op::ScatterAdd) {
          k = build_scatter(*this, node, slot);
        } else {
          k = build_elementwise(*this, node, slot, true);
          if (!all_affine(k)) k = build_elementwise(*this, node, slot, false);
        }
    }
    k.name = fmt::format("kiln_k{}", out.kernels.size());
    out.kernels.push_back(std::move(k));
  }
}

}  // namespace

Schedule schedule(const PendingGraph& graph) {
  Scheduler s(graph);
  s.decide_materialization();
  for (int attempt = 0;; ++attempt) {
    s.out = Schedule{};
    s.slot_of.clear();
    s.scalar_slot.clear();
    s.rand_slot.clear();
    s.assign_slots();
    try {
      s.build_kernels();
      return std::move(s.out);
    } catch (const Error& e) {
      // A matmul operand that is not a strided view got marked for materialization: redo.
      if (attempt > static_cast<int>(graph.nodes.size()) ||
          std::string_view(e.what()).find("jit-internal-retry") == std::string_view::npos)
        throw;
    }
  }
}

}  // namespace kiln::jit
