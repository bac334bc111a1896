#include "memory/recompute_order.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <unordered_map>

#include "core/error.h"

namespace kiln::memory {

namespace {
// A set of positions that hands out its smallest: a heap with lazy deletion (std::set's node per
// insert cost a third of a replayed step's realize).
class PositionSet {
 public:
  explicit PositionSet(int n) : in_(n, 0) {}
  void insert(int i) {
    if (in_[i]) return;
    in_[i] = 1;
    heap_.push(i);
  }
  void erase(int i) { in_[i] = 0; }
  bool count(int i) const { return in_[i] != 0; }
  bool empty() {
    while (!heap_.empty() && !in_[heap_.top()]) heap_.pop();
    return heap_.empty();
  }
  int smallest() { return empty() ? -1 : heap_.top(); }

 private:
  std::vector<char> in_;
  std::priority_queue<int, std::vector<int>, std::greater<int>> heap_;
};
// Whether `from` depends on `target` (through pending inputs).
bool depends_on(int from, int target, const std::vector<std::vector<int>>& ins, std::vector<int>& stamp, int mark) {
  std::vector<int> stack{from};
  while (!stack.empty()) {
    const int i = stack.back();
    stack.pop_back();
    if (i == target) return true;
    if (i < target || stamp[i] == mark) continue;  // inputs come before their readers
    stamp[i] = mark;
    for (int p : ins[i]) stack.push_back(p);
  }
  return false;
}

// A recomputed copy whose work a backward elementwise node of its shape also does from the same
// saved values (the GELU's output, recomputed beside the GELU's backward, which reads the same
// pre-activation) is made by that node's kernel (jit/lower.cc add_sibling_output), which only
// looks back: the copy's readers (the next layer's weight gradient) wait for that node.
void wait_for_siblings(const std::vector<NodePtr>& nodes, const std::vector<std::vector<int>>& ins,
                       const std::vector<std::vector<int>>& consumers, const std::vector<char>& lazy,
                       std::vector<std::vector<int>>& unblocks, std::vector<int>& unsatisfied) {
  const int n = static_cast<int>(nodes.size());
  std::vector<int> stamp(n, -1), frontier, next;
  int marks = 0;
  for (int x = 0; x < n; ++x) {
    const Node& copy = *nodes[x];
    if (!copy.recompute || !is_elementwise(copy.op)) continue;
    // The non-lazy values the copy's chain reads (its sources), through other copies.
    std::vector<int> sources, stack(ins[x].begin(), ins[x].end());
    for (const int mark = marks++; !stack.empty();) {
      const int p = stack.back();
      stack.pop_back();
      if (stamp[p] == mark) continue;
      stamp[p] = mark;
      if (nodes[p]->recompute) stack.insert(stack.end(), ins[p].begin(), ins[p].end());
      else if (!lazy[p] && nodes[p]->numel() == copy.numel()) sources.push_back(p);
    }
    // A backward elementwise reader of a source, directly or through forward values of its size.
    int sibling = -1;
    frontier = sources;
    for (int depth = 0; depth < 4 && sibling < 0 && !frontier.empty(); ++depth) {
      next.clear();
      for (int q : frontier)
        for (int c : consumers[q]) {
          const Node& reader = *nodes[c];
          if (lazy[c] || !is_elementwise(reader.op) || reader.numel() != copy.numel()) continue;
          if (!reader.requires_grad) {
            sibling = c;
            break;
          }
          next.push_back(c);
        }
      frontier.swap(next);
    }
    if (sibling < 0) continue;
    // Up to the value the kernel stores: the reader's chain of backward elementwise values of the
    // copy's size, each the one reader of the one before (what the scheduler fuses into one kernel).
    for (;;) {
      const std::vector<int>& readers = consumers[sibling];
      if (readers.size() != 1) break;
      const Node& reader = *nodes[readers[0]];
      if (lazy[readers[0]] || !is_elementwise(reader.op) || reader.requires_grad || reader.numel() != copy.numel()) break;
      sibling = readers[0];
    }
    // The copy's readers, through views of it (a weight gradient's matmul reads it transposed).
    std::vector<int> readers, views{x};
    while (!views.empty()) {
      const int v = views.back();
      views.pop_back();
      for (int c : consumers[v]) {
        if (op_kind(nodes[c]->op) == OpKind::Movement) views.push_back(c);
        else if (!lazy[c]) readers.push_back(c);
      }
    }
    for (int c : readers) {
      if (c == sibling || depends_on(sibling, c, ins, stamp, marks++)) continue;
      unblocks[sibling].push_back(c);
      unsatisfied[c]++;
    }
  }
}

}  // namespace

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
  // executor can still write it in place (jit/plan.cc).
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
  wait_for_siblings(nodes, ins, consumers, lazy, unblocks, unsatisfied);
  std::vector<char> emitted(n, 0);
  // By DFS position. urgent: compressed copies of saved values (memory/compress.h), which let
  // the full-width value go once its forward readers are done.
  PositionSet ready(n), freeing(n), urgent(n);
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
      if (nodes[c]->saved_copy) urgent.insert(c);
      else if (frees(c)) freeing.insert(c);
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
    urgent.erase(j);
    for (int b : reads[j])
      if (--remaining[b] == 1)
        for (int r : readers[b])
          if (!emitted[r] && ready.count(r) && !urgent.count(r)) freeing.insert(r);
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
  while (!ready.empty())
    emit(!urgent.empty() ? urgent.smallest() : !freeing.empty() ? freeing.smallest() : ready.smallest());
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

}  // namespace kiln::memory
