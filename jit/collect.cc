#include "jit/collect.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <queue>
#include <unordered_map>

#include "core/flags.h"
#include "memory/recompute_order.h"

namespace kiln::jit {

namespace {

// Held nodes that are not worth keeping: recomputing them later is free. (A held reshape is
// kept: it usually shares the buffer under it, and dropping it would keep its whole history.)
bool is_cheap_view(Op op) {
  OpKind k = op_kind(op);
  return (k == OpKind::Movement && op != Op::Reshape) || op == Op::Full || op == Op::Iota;
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
  memory::for_each_realized_read(nodes, [&](int i, const Node* value) { last_reader[value] = i; });
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

// Moves everything that reads an all-reduce's result (directly or not) after everything that
// does not, keeping both groups in order: a collective starts as soon as its input is computed,
// and the kernels that need no result of it (the rest of a backward pass) run before the first
// wait. What stays in front reads nothing from behind, so the order remains topological.
void defer_collective_readers(std::vector<NodePtr>& nodes) {
  const size_t n = nodes.size();
  std::vector<char> reads(n, 0);
  for (size_t i = 0; i < n; ++i)
    for (const NodePtr& in : nodes[i]->inputs)
      if (!in->realized() && (in->op == Op::AllReduce || reads[in->visit_index])) reads[i] = 1;
  std::vector<NodePtr> order;
  order.reserve(n);
  for (int pass = 0; pass < 2; ++pass)
    for (size_t i = 0; i < n; ++i)
      if (reads[i] == pass) order.push_back(nodes[i]);
  nodes = std::move(order);
  for (size_t i = 0; i < n; ++i) nodes[i]->visit_index = static_cast<int64_t>(i);
}

// Puts the nodes in the order they were recorded (by id), as far as their dependencies allow. A
// graph with sends and receives (pipeline stages) must run them in the order the program issued
// them, which is the order every other rank expects: a schedule that is free of deadlocks when
// run op by op stays free of them as a plan.
// One exception: a node that becomes ready as the last reader of all its inputs, with an output
// no larger than they are, runs at once (a pipeline stage's gradient sums, recorded after a whole
// micro-batch's backward, would otherwise keep every weight gradient of that micro-batch alive).
// It is no send or receive and reads none, so the waits for messages keep their order. So does a
// compressed copy of a saved value (memory/compress.h), for the same reason: it lets the value go.
void order_as_recorded(std::vector<NodePtr>& nodes) {
  const size_t n = nodes.size();
  std::vector<int> missing(n, 0), unread(n, 0);
  std::vector<std::vector<int>> readers(n);
  for (size_t i = 0; i < n; ++i)
    for (const NodePtr& in : nodes[i]->inputs)
      if (!in->realized()) {
        missing[i]++;
        unread[in->visit_index]++;
        readers[in->visit_index].push_back(static_cast<int>(i));
      }
  auto is_message = [](Op op) { return op == Op::Send || op == Op::Recv; };
  auto frees_memory = [&](int i) {
    const Node& node = *nodes[i];
    if (is_message(node.op) || node.inputs.empty()) return false;
    size_t freed = 0;
    for (const NodePtr& in : node.inputs) {
      if (in->realized()) return false;
      if (is_message(in->op) || unread[in->visit_index] != 1 || in->held > 0) return false;
      freed += in->nbytes();
    }
    return node.nbytes() <= freed;
  };
  // Recording order, except that a value made for the backward after the fact (a recomputed copy,
  // the reading of a compressed value: memory/compress.h) takes its first reader's place, not
  // its own late id: otherwise the backward work that reads it would wait for every later
  // message of the step.
  std::vector<uint64_t> rank(n);
  for (size_t i = n; i-- > 0;) {
    rank[i] = nodes[i]->id;
    if (nodes[i]->recompute)
      for (int r : readers[i]) rank[i] = std::min(rank[i], rank[static_cast<size_t>(r)]);
  }
  auto later = [&](int a, int b) { return rank[a] > rank[b]; };
  std::priority_queue<int, std::vector<int>, decltype(later)> ready(later);
  std::vector<int> now;  // ready nodes that free memory: before anything else
  auto make_ready = [&](int i) {
    if (frees_memory(i) || nodes[i]->saved_copy) now.push_back(i);
    else ready.push(i);
  };
  for (size_t i = 0; i < n; ++i)
    if (missing[i] == 0) make_ready(static_cast<int>(i));
  std::vector<NodePtr> order;
  order.reserve(n);
  while (!now.empty() || !ready.empty()) {
    int i;
    if (!now.empty()) {
      i = now.back();
      now.pop_back();
    } else {
      i = ready.top();
      ready.pop();
    }
    order.push_back(nodes[i]);
    for (const NodePtr& in : nodes[i]->inputs)
      if (!in->realized()) unread[in->visit_index]--;
    for (int r : readers[i])
      if (--missing[r] == 0) make_ready(r);
  }
  nodes = std::move(order);
  for (size_t i = 0; i < n; ++i) nodes[i]->visit_index = static_cast<int64_t>(i);
}

// The plan cache's key: everything that changes the generated code (ops, dtypes, shapes,
// devices, attributes, wiring, which outputs replace which inputs), nothing that is data. Raw
// bytes, not text: this runs on every realize and must cost microseconds. Also fills
// g.replaced_external, which the key records.
std::string structural_key(PendingGraph& g, uint64_t walk) {
  // Words are stored straight into the string's buffer: std::string::append per word costs a
  // call and a capacity check, a third of a cached realize of a 50-op step.
  std::string key(64 * (g.nodes.size() + g.externals.size() + 1), '\0');
  size_t used = 0;
  auto put = [&key, &used](int64_t v) __attribute__((always_inline)) {
    if (used + sizeof v > key.size()) key.resize(2 * key.size());
    std::memcpy(key.data() + used, &v, sizeof v);
    used += sizeof v;
  };
  auto put_list = [&](const auto& values) __attribute__((always_inline)) {
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
  // Flags that change the program lowered from the same graph.
  put(flags().tiled_updates ? -3 : -4);
  put(flags().stream_bytes);  // the CPU renderer's non-temporal stores (backends/cpu/render_cpp.h)
  // Offload (jit/offload.h) changes a device plan: its mode, and under auto the budget it meets.
  if (!g.nodes.empty() && g.nodes.front()->device.is_cuda()) {
    put(flags().deterministic ? -8 : -9);  // scatter kernels rendered without atomics
    const std::string& mode = flags().offload;
    put(mode == "off" ? -5 : mode == "all" ? -6 : -7);
    if (mode == "auto") put(static_cast<int64_t>(std::hash<std::string>{}(flags().memory_budget)));
  }
  key.resize(used);
  return key;
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
  // (A cast of an update, autocast's copy of a new weight, goes with its update.)
  auto is_update = [](const NodePtr& t) {
    return !t->replaces.expired() || (t->op == Op::Cast && !t->inputs.empty() && !t->inputs[0]->replaces.expired());
  };
  bool has_collective = false, has_message = false;
  std::vector<NodePtr> ordered = targets;
  auto updates = std::stable_partition(ordered.begin(), ordered.end(), [&](const NodePtr& t) { return !is_update(t); });
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
      // Noted here: every realize collects, cached plan or not.
      has_collective |= node->op == Op::AllReduce;
      has_message |= node->op == Op::Send || node->op == Op::Recv;
      g.nodes.push_back(node->shared_from_this());
      stack.pop_back();
    }
  }
  if (has_message) {
    order_as_recorded(g.nodes);
  } else {
    if (std::any_of(g.nodes.begin(), g.nodes.end(), [](const NodePtr& n) { return n->recompute || n->saved_copy; }))
      memory::order_for_recompute(g.nodes);
    else
      defer_updates(g.nodes);
    if (has_collective) defer_collective_readers(g.nodes);
  }
  std::vector<bool> is_output(g.nodes.size(), false);
  for (const NodePtr& t : targets)
    if (!t->realized()) is_output[t->visit_index] = true;
  for (size_t i = 0; i < g.nodes.size(); ++i)
    if (g.nodes[i]->held > 0 && !is_cheap_view(g.nodes[i]->op) && op_kind(g.nodes[i]->op) != OpKind::Leaf)
      is_output[i] = true;
  for (size_t i = 0; i < g.nodes.size(); ++i)
    if (is_output[i]) g.outputs.push_back(static_cast<int>(i));

  g.key = structural_key(g, walk);
  return g;
}

}  // namespace kiln::jit
