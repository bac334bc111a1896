// Recomputation: checkpoint segments (recomputed by autograd, core/autograd.cc) and the automatic
// pass that rewrites a pending graph to fit KILN_MEMORY_BUDGET (called by jit/executor.cc).
#include "memory/recompute.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <unordered_set>

#include "core/autograd.h"
#include "core/flags.h"
#include "memory/allocator.h"

namespace kiln {

std::vector<Tensor> checkpoint(const SegmentFn& fn, const std::vector<Tensor>& inputs) {
  if (!grad_enabled()) return fn(inputs);
  auto segment = std::make_shared<CheckpointSegment>();
  for (const Tensor& t : inputs) segment->inputs.push_back(t.node());
  // Node ids grow as nodes are made: the inside of the segment is what fn records.
  segment->first_id = Node::next_id();
  std::vector<Tensor> outputs = fn(inputs);
  segment->last_id = Node::next_id();
  for (const Tensor& out : outputs) {
    if (!out.defined()) continue;
    const NodePtr& n = out.node();
    if (n->id <= segment->first_id || n->id >= segment->last_id || n->realized() || !n->requires_grad) continue;
    segment->outputs.push_back(n);
  }
  for (const std::weak_ptr<Node>& out : segment->outputs) out.lock()->segment = segment;
  return outputs;
}

Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& input) {
  auto wrapped = [&fn](const std::vector<Tensor>& in) { return std::vector<Tensor>{fn(in[0])}; };
  return checkpoint(wrapped, std::vector<Tensor>{input})[0];
}

namespace memory {

NodePtr recompute_copy(const Node& node, NodeInputs inputs) {
  auto copy = new_node();
  copy->op = node.op;
  copy->dtype = node.dtype;
  copy->device = node.device;
  copy->shape = node.shape;
  copy->ints = node.ints;
  copy->scalar = node.scalar;
  copy->seed = node.seed;  // random ops draw the same Philox numbers as the original
  copy->offset = node.offset;
  copy->inputs = std::move(inputs);
  copy->recompute = true;
  return copy;
}

void recompute_segment(const CheckpointSegment& segment, std::unordered_map<Node*, NodePtr>& copies) {
  std::unordered_set<const Node*> inputs;
  for (const NodePtr& in : segment.inputs) inputs.insert(in.get());
  // Inside: recorded by the segment's function, not realized (a realized value is reused as is),
  // not a gradient leaf, not one of the segment's inputs.
  auto inside = [&](const Node* n) {
    return n->id > segment.first_id && n->id < segment.last_id && !n->realized() && !n->grad_leaf &&
           !inputs.count(n);
  };
  // The inside, inputs before consumers.
  std::vector<Node*> order;
  std::unordered_set<Node*> seen;
  std::vector<std::pair<Node*, size_t>> stack;
  for (const std::weak_ptr<Node>& weak : segment.outputs) {
    NodePtr out = weak.lock();
    if (!out || !inside(out.get()) || copies.count(out.get()) || !seen.insert(out.get()).second) continue;
    stack.push_back({out.get(), 0});
    while (!stack.empty()) {
      auto& [node, next] = stack.back();
      if (next < node->inputs.size()) {
        Node* in = node->inputs[next++].get();
        if (inside(in) && !copies.count(in) && seen.insert(in).second) stack.push_back({in, 0});
        continue;
      }
      order.push_back(node);
      stack.pop_back();
    }
  }
  for (Node* node : order) {
    NodeInputs inputs_of_copy;
    for (const NodePtr& in : node->inputs) inputs_of_copy.push_back(inside(in.get()) ? copies.at(in.get()) : in);
    copies[node] = recompute_copy(*node, std::move(inputs_of_copy));
  }
}

// ---- automatic recomputation ----

namespace {
// As flags validate it: a number with a decimal point is a fraction, anything else a size.
bool is_fraction(const std::string& budget) {
  char* end = nullptr;
  std::strtod(budget.c_str(), &end);
  return !budget.empty() && *end == '\0' && budget.find('.') != std::string::npos;
}
}  // namespace

int64_t budget_bytes(const std::string& budget, int64_t unconstrained_arena) {
  if (budget.empty()) return 0;
  if (is_fraction(budget)) {
    double fraction = std::strtod(budget.c_str(), nullptr);
    // As flags validation requires: a fraction past 1 (or "66666666666661.") would overflow int64.
    KILN_CHECK(fraction > 0 && fraction <= 1, "memory_budget", "budget '{}' is not a fraction in (0, 1] or a size",
               budget);
    return std::max<int64_t>(1, static_cast<int64_t>(std::floor(fraction * static_cast<double>(unconstrained_arena))));
  }
  return std::max<int64_t>(1, parse_size(budget, "memory_budget"));
}

void RecomputeRewrite::undo() {
  for (auto it = edits.rbegin(); it != edits.rend(); ++it) it->consumer->inputs[it->input] = it->original;
  edits.clear();
}

namespace {

// Values without gradient tracking that the forward computes by elementwise work from inputs,
// constants and random generators alone: a normalized input batch, one-hot labels, a dropout
// mask. The backward can recompute them from what it holds anyway, as it can activations; a
// train_mnist step otherwise holds its float batch (made from the uint8 one) from the first
// layer's forward to its weight gradient.
std::vector<char> input_derived(const std::vector<NodePtr>& nodes, const GraphIndex& index) {
  std::vector<char> derived(nodes.size(), 0);
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = *nodes[i];
    if (n.requires_grad || n.backward || n.recompute || n.saved_copy || !n.replaces.expired() ||
        !(is_elementwise(n.op) || op_kind(n.op) == OpKind::Movement))
      continue;
    derived[i] = std::all_of(n.inputs.begin(), n.inputs.end(), [&](const NodePtr& in) {
      const int p = index.of(in.get());
      return p < 0 || op_kind(nodes[p]->op) == OpKind::Leaf || derived[p];
    });
  }
  return derived;
}

// Whether `consumer`, which has no gradient tracking and is not input_derived itself, reads a
// value for the backward: any such reader of an activation; of an input_derived value, only the
// backward's own readers (forward work without gradients, a metric say, or an update reads it
// where it stands).
bool backward_read(const Node& consumer, bool value_derived) {
  return !value_derived || consumer.backward || consumer.recompute;
}

// Saved activations: forward values (recorded with gradient tracking, or input_derived) that the
// backward also reads, directly or through views. Inputs before consumers.
std::vector<int> saved_activations(const std::vector<NodePtr>& nodes, const GraphIndex& index,
                                   const std::vector<char>& derived) {
  std::vector<bool> forward_use(nodes.size(), false), backward_use(nodes.size(), false);
  for (size_t c = 0; c < nodes.size(); ++c) {
    const Node& consumer = *nodes[c];
    const bool forward = consumer.requires_grad || derived[c];
    if (op_kind(consumer.op) == OpKind::Movement && forward) continue;  // a view, not a use
    for (const NodePtr& in : consumer.inputs) {
      int p = index.of(in.get());
      if (p < 0 || index.base[p] < 0) continue;
      const int b = index.base[p];
      if (forward) forward_use[b] = true;
      else if (backward_read(consumer, derived[b] != 0)) backward_use[b] = true;
    }
  }
  std::vector<int> saved;
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = *nodes[i];
    // (A compressed copy, memory/compress.h, is what the backward keeps instead: not recomputed.)
    if (index.base[i] == static_cast<int>(i) && ((n.requires_grad && !n.grad_leaf) || derived[i]) && !n.recompute &&
        !n.saved_copy && n.held == 0 && forward_use[i] && backward_use[i])
      saved.push_back(static_cast<int>(i));
  }
  return saved;
}

}  // namespace

int64_t node_flops(const Node& n) {
  auto dim = [](const Shape& shape, int64_t from_end) { return shape[shape.size() - from_end]; };
  switch (n.op) {
    case Op::Matmul:  // (..., M, K) x (..., K, N)
      return 2 * n.numel() * dim(n.inputs[0]->shape, 1);
    case Op::Conv2d:  // each output element: a dot product over a (C/groups, kh, kw) window
      return 2 * n.numel() * (n.inputs[1]->numel() / std::max<int64_t>(1, n.inputs[1]->shape[0]));
    case Op::Attention:  // q (B, H, T, D), k (B, H, S, D): Q·Kᵀ and P·V
      return 4 * n.inputs[0]->numel() * dim(n.inputs[1]->shape, 2);
    default: {
      int64_t elements = n.numel();
      for (const NodePtr& in : n.inputs) elements = std::max(elements, in->numel());
      return elements;
    }
  }
}

namespace {

// Forward values no forward edge jumps over: every forward computation after such a value reads
// forward values made at or after it (weights and constants aside), so recomputing what follows
// can start from it alone. By position; views count as their buffer.
std::vector<char> forward_cuts(const std::vector<NodePtr>& nodes, const GraphIndex& index) {
  const int n = static_cast<int>(nodes.size());
  std::vector<int> cover(n + 1, 0);
  auto forward_value = [&](int p) { return nodes[p]->requires_grad && !nodes[p]->grad_leaf; };
  for (int c = 0; c < n; ++c) {
    const Node& consumer = *nodes[c];
    if (!consumer.requires_grad || op_kind(consumer.op) == OpKind::Movement) continue;
    for (const NodePtr& in : consumer.inputs) {
      const int p = index.of(in.get());
      if (p < 0 || index.base[p] < 0 || !forward_value(index.base[p])) continue;
      const int b = index.base[p];
      if (b + 1 < c) {  // positions strictly between the value and its reader
        cover[b + 1]++;
        cover[c]--;
      }
    }
  }
  std::vector<char> cut(n, 0);
  for (int i = 0, running = 0; i < n; ++i) {
    running += cover[i];
    cut[i] = running == 0 && index.base[i] == i && forward_value(i);
  }
  return cut;
}

}  // namespace

RecomputeRewrite apply_recompute(const std::vector<NodePtr>& nodes, const std::vector<int>& dropped,
                                 const std::vector<int>& checkpoints, bool chain_per_value) {
  const size_t n = nodes.size();
  GraphIndex index(nodes);
  const std::vector<char> derived = input_derived(nodes, index);
  std::vector<bool> is_saved(n, false), needs_copy(n, false);
  for (int p : saved_activations(nodes, index, derived)) is_saved[p] = true;
  for (int p : checkpoints) is_saved[p] = true;
  // The copies are made group by group: all dropped values in one group, whose copies share
  // their chains, or each in a group of its own.
  std::vector<int> group(n, -1);
  for (size_t g = 0; g < dropped.size(); ++g) group[dropped[g]] = chain_per_value ? static_cast<int>(g) : 0;
  const int groups = dropped.empty() ? 0 : chain_per_value ? static_cast<int>(dropped.size()) : 1;
  // The backward (recorded without gradient tracking; backward_read) reads dropped values, or
  // views of them: input `slot` of `consumer` is position `p`, of group `g`.
  struct BackwardRead {
    NodePtr consumer;
    size_t slot;
    int p, g;
  };
  std::vector<BackwardRead> reads;
  for (size_t c = 0; c < n; ++c) {
    const NodePtr& consumer = nodes[c];
    if (consumer->requires_grad || derived[c]) continue;
    for (size_t s = 0; s < consumer->inputs.size(); ++s)
      if (int p = index.of(consumer->inputs[s].get()); p >= 0 && index.base[p] >= 0 && group[index.base[p]] >= 0 &&
                                                        backward_read(*consumer, derived[index.base[p]] != 0))
        reads.push_back({consumer, s, p, group[index.base[p]]});
  }
  // A copy reads kept values as they are: saved activations not dropped, gradient leaves and
  // values without gradient tracking but not input_derived (realized values, backward values);
  // forward values in between are recomputed too.
  auto kept = [&](int p) {
    const Node& node = *nodes[p];
    if (derived[p]) return is_saved[p] && group[p] < 0;
    return !node.requires_grad || node.grad_leaf || (is_saved[p] && group[p] < 0);
  };
  RecomputeRewrite rewrite;
  for (int p : dropped) rewrite.dropped_bytes += static_cast<int64_t>(nodes[p]->nbytes());
  std::vector<NodePtr> copy(n);
  for (int g = 0; g < groups; ++g) {
    std::fill(needs_copy.begin(), needs_copy.end(), false);
    size_t last = 0;
    for (const BackwardRead& r : reads)
      if (r.g == g) {
        needs_copy[r.p] = true;
        last = std::max(last, static_cast<size_t>(r.p) + 1);
      }
    for (size_t i = last; i-- > 0;) {
      if (!needs_copy[i]) continue;
      for (const NodePtr& in : nodes[i]->inputs) {
        int p = index.of(in.get());
        if (p >= 0 && !kept(p)) needs_copy[p] = true;
      }
    }
    for (size_t i = 0; i < last; ++i) {
      if (!needs_copy[i]) continue;
      NodeInputs inputs;
      for (const NodePtr& in : nodes[i]->inputs) {
        int p = index.of(in.get());
        inputs.push_back(p >= 0 && needs_copy[p] ? copy[p] : in);
      }
      copy[i] = recompute_copy(*nodes[i], std::move(inputs));
      rewrite.copied_from.emplace_back(copy[i].get(), nodes[i].get());
      if (op_kind(nodes[i]->op) != OpKind::Movement) {
        rewrite.copied_elements += nodes[i]->numel();
        rewrite.copied_flops += node_flops(*nodes[i]);
      }
    }
    for (const BackwardRead& r : reads)
      if (r.g == g) {
        rewrite.edits.push_back({r.consumer, r.slot, r.consumer->inputs[r.slot]});
        r.consumer->inputs[r.slot] = copy[r.p];
      }
  }
  return rewrite;
}

RecomputeChoice choose_recompute(const std::vector<NodePtr>& nodes, int64_t budget, int64_t unconstrained_arena,
                                 const std::string& budget_text,
                                 const std::function<int64_t()>& arena_of_current_graph) {
  GraphIndex index(nodes);
  std::vector<int> saved = saved_activations(nodes, index, input_derived(nodes, index));
  const int count = static_cast<int>(saved.size());
  // A fraction budgets what a backward pass keeps; a plan without one is left as it is.
  if (count == 0 && is_fraction(budget_text)) return {{}, {}, unconstrained_arena, {}, {}};
  KILN_CHECK(count > 0, "memory_budget",
             "KILN_MEMORY_BUDGET={} allows a {} arena but this plan needs {} and keeps no forward activation for a "
             "backward pass, so recomputation cannot help; raise the budget or make the batch smaller",
             budget_text, format_bytes(budget), format_bytes(unconstrained_arena));
  // Cheapest first. Tier 1: the values elementwise work gives back from what the backward keeps
  // anyway (choose_cheap_recompute: a few operations per element, no matmul). Tier 2: those, plus
  // every other saved value (matmul, attention and convolution outputs, whose copies cost their
  // FLOPs again) except checkpoints: saved values no forward edge jumps over (the residual
  // stream between a transformer's sub-blocks, a chain's activations), every k-th of them kept
  // from k = 1 up, so each recomputed stretch starts from a kept checkpoint and runs only where
  // its backward needs it. Tier 3, for graphs with few such cuts: every k-th of the other saved
  // values kept, in forward order. The first choice that fits is taken (the least recomputation).
  const std::vector<int> cheap = choose_cheap_recompute(nodes, true);
  std::vector<char> is_cheap(nodes.size(), 0);
  for (int p : cheap) is_cheap[p] = 1;
  std::vector<int> costly;
  for (int p : saved)
    if (!is_cheap[p]) costly.push_back(p);
  const std::vector<char> cut = forward_cuts(nodes, index);
  std::vector<int> cuts;
  for (int p = 0; p < static_cast<int>(nodes.size()); ++p)
    if (cut[p]) cuts.push_back(p);
  const int n_costly = static_cast<int>(costly.size());
  const int n_cuts = static_cast<int>(cuts.size());
  const int max_k = std::min(n_costly + 1, 2 * static_cast<int>(std::ceil(std::sqrt(std::max(n_costly, 1)))) + 4);
  RecomputeChoice best{{}, {}, unconstrained_arena, {}, {}};
  // Weighs dropping the cheap values and the costly ones `keep` does not keep, copies starting
  // from `checkpoints`.
  // (With `bound_only`: whether the copies stay within kMaxCopiesPerNode, nothing planned.)
  auto weigh = [&](const std::function<bool(int)>& keep, std::vector<int> checkpoints, const std::string& policy,
                   bool chain_per_value = false, bool bound_only = false) {
    RecomputeChoice choice;
    choice.dropped = cheap;
    for (int j = 0; j < n_costly; ++j)
      if (!keep(j)) choice.dropped.push_back(costly[j]);
    std::sort(choice.dropped.begin(), choice.dropped.end());
    if (choice.dropped.empty()) return false;
    choice.checkpoints = std::move(checkpoints);
    choice.chain_per_value = chain_per_value;
    RecomputeRewrite rewrite = apply_recompute(nodes, choice.dropped, choice.checkpoints, chain_per_value);
    // (Chains per value copy a stretch once per value in it: beyond a few copies per node,
    // planning the graph costs seconds; such a choice is left out.)
    const bool within_bound =
        static_cast<int64_t>(rewrite.copied_from.size()) <= kMaxCopiesPerNode * static_cast<int64_t>(nodes.size());
    if (bound_only || !within_bound) {
      rewrite.undo();
      return within_bound;
    }
    try {
      choice.arena_bytes = arena_of_current_graph();
    } catch (...) {
      rewrite.undo();
      throw;
    }
    rewrite.undo();
    const bool fits = choice.arena_bytes <= budget;
    // (A choice that misses is worth its work only if it saves more than a few percent: a plan
    // that recomputed two thirds of a step's FLOPs to save 0.4% of its arena ran 1.7x slower.)
    if (fits || choice.arena_bytes < best.arena_bytes - unconstrained_arena / kWorthwhileSaving) {
      best = std::move(choice);
      best.policy = policy;
    }
    return fits;
  };
  if (weigh([](int) { return true; }, {}, "recomputing the values elementwise work gives back")) return best;
  // Tier 2 begins with the stretches between consecutive checkpoints (all kept) whose saved bytes
  // cost the fewest FLOPs to recompute: the smallest number of them that fits (binary search;
  // the arena falls as stretches are added), then all of them with every k-th checkpoint kept.
  const int n_stretches = n_cuts + 1;
  auto stretch_of = [&](int p) { return static_cast<int>(std::upper_bound(cuts.begin(), cuts.end(), p) - cuts.begin()); };
  std::vector<double> stretch_bytes(n_stretches, 0), stretch_flops(n_stretches, 0);
  for (int p : costly)
    if (!cut[p]) stretch_bytes[stretch_of(p)] += static_cast<double>(nodes[p]->nbytes());
  for (int p = 0; p < static_cast<int>(nodes.size()); ++p)
    if (index.base[p] == p && nodes[p]->requires_grad && !nodes[p]->grad_leaf)
      stretch_flops[stretch_of(p)] += static_cast<double>(node_flops(*nodes[p]));
  std::vector<int> by_worth;
  for (int t = 0; t < n_stretches; ++t)
    if (stretch_bytes[t] > 0) by_worth.push_back(t);
  std::stable_sort(by_worth.begin(), by_worth.end(), [&](int a, int b) {
    return stretch_bytes[a] * stretch_flops[b] > stretch_bytes[b] * stretch_flops[a];
  });
  std::vector<char> in_dropped_stretch(n_stretches, 0);
  auto weigh_stretches = [&](int m) {
    std::fill(in_dropped_stretch.begin(), in_dropped_stretch.end(), 0);
    for (int i = 0; i < m; ++i) in_dropped_stretch[by_worth[i]] = 1;
    return weigh([&](int j) { return cut[costly[j]] || !in_dropped_stretch[stretch_of(costly[j])]; }, cuts,
                 fmt::format("keeping {} of {} checkpoints, recomputing {} of {} stretches between them", n_cuts, n_cuts, m,
                             by_worth.size()));
  };
  const int n_worth = static_cast<int>(by_worth.size());
  if (n_worth > 0 && weigh_stretches(n_worth)) {
    for (int lo = 1, hi = n_worth; lo < hi;) {
      const int mid = (lo + hi) / 2;
      if (weigh_stretches(mid)) hi = mid;
      else lo = mid + 1;
    }
    return best;
  }
  std::vector<char> is_checkpoint(nodes.size(), 0);
  // Every k-th checkpoint kept (k > n_cuts: none), the copies shared or each value's own.
  auto weigh_every_kth = [&](int k, bool chain_per_value, bool bound_only = false) {
    std::vector<int> checkpoints;
    std::fill(is_checkpoint.begin(), is_checkpoint.end(), 0);
    for (int c = 0; c < n_cuts; ++c)
      if (c % k == k - 1) {
        checkpoints.push_back(cuts[c]);
        is_checkpoint[cuts[c]] = 1;
      }
    const std::string kept_text = k > n_cuts ? fmt::format("keeping none of {} checkpoints", n_cuts)
                                             : fmt::format("keeping every {} of {} checkpoints", k, n_cuts);
    return weigh([&](int j) { return is_checkpoint[costly[j]] != 0; }, std::move(checkpoints),
                 chain_per_value ? kept_text + ", each value recomputed on its own" : kept_text, chain_per_value,
                 bound_only);
  };
  const int max_k_cuts = std::min(n_cuts, 2 * static_cast<int>(std::ceil(std::sqrt(std::max(n_cuts, 1)))) + 4);
  for (int k = 2; k <= max_k_cuts; ++k)
    if (weigh_every_kth(k, false)) return best;
  for (int k = 2; k <= max_k; ++k)
    if (weigh([k](int j) { return j % k == k - 1; }, {}, fmt::format("keeping every {} in forward order", k))) return best;
  // Tier 4: a chain of copies per value. Fewer checkpoints (a larger k) hold fewer bytes, cost
  // more work and make more copies: the largest k within the copy bound (k = n_cuts + 1: none at
  // all), then the smallest k that fits (binary searches).
  if (n_cuts > 0) {
    int lo = 1, hi = n_cuts + 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (weigh_every_kth(mid, true, true)) lo = mid;
      else hi = mid - 1;
    }
    if (lo > 1 && weigh_every_kth(lo, true)) {
      for (hi = lo, lo = 1; lo < hi;) {
        const int mid = (lo + hi) / 2;
        if (weigh_every_kth(mid, true)) hi = mid;
        else lo = mid + 1;
      }
      return best;
    }
  }
  best.missed = fmt::format(
      "KILN_MEMORY_BUDGET={} allows a {} arena but this plan needs {}; recomputing forward activations "
      "(the {} elementwise work gives back, and of the other {} saved for the backward all but every k-th of {} "
      "checkpoints, k = 1..{}, or all but every k-th, k = 2..{}, or all of them, each on its own) gets it down to {} "
      "at best{}. Raise the budget, make the batch smaller, or mark segments by hand with kiln::checkpoint",
      budget_text, format_bytes(budget), format_bytes(unconstrained_arena), cheap.size(), n_costly, n_cuts,
      max_k_cuts, max_k,
      format_bytes(best.arena_bytes), best.policy.empty() ? "" : fmt::format(" ({})", best.policy));
  return best;
}

namespace {

// Exp, log, erf and the like: tens of operations per element, and a kernel that would only
// stream memory becomes compute-bound.
bool is_transcendental(Op op) {
  switch (op) {
    case Op::Exp: case Op::Log: case Op::Sin: case Op::Cos: case Op::Tanh: case Op::Erf: case Op::Pow:
      return true;
    default:
      return false;
  }
}

}  // namespace

std::vector<int> choose_cheap_recompute(const std::vector<NodePtr>& nodes, bool transcendental) {
  GraphIndex index(nodes);
  const std::vector<char> derived = input_derived(nodes, index);
  const std::vector<int> saved = saved_activations(nodes, index, derived);
  std::vector<char> is_saved(nodes.size(), 0), dropped(nodes.size(), 0);
  for (int p : saved) is_saved[p] = 1;
  // Buffers a backward matmul, convolution, gather or scatter reads from memory: a copy of such a
  // value is a kernel of its own. Elementwise and reduction kernels recompute a copy inside.
  std::vector<char> read_from_memory(nodes.size(), 0);
  for (const NodePtr& consumer : nodes) {
    const OpKind kind = op_kind(consumer->op);
    if (consumer->requires_grad || (kind != OpKind::Library && kind != OpKind::Index)) continue;
    for (const NodePtr& in : consumer->inputs)
      if (int p = index.of(in.get()); p >= 0 && index.base[p] >= 0) read_from_memory[index.base[p]] = 1;
  }
  // Whether the backward's elementwise work evaluates forward value t itself: a backward
  // elementwise kernel reads t, or a forward elementwise value of t's size computed from it other
  // than `top` (whose readers will read the copy instead). A GELU's erf is: its backward reads
  // 1 + erf(x/√2). A copy whose exp or erf is shared so joins that kernel (jit/lower.cc
  // add_sibling_output) and costs a store, not its transcendental work again.
  std::vector<std::vector<int>> consumers(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i)
    for (const NodePtr& in : nodes[i]->inputs)
      if (int q = index.of(in.get()); q >= 0) consumers[q].push_back(static_cast<int>(i));
  std::vector<int> frontier, next;
  auto evaluated_by_backward = [&](int t, int top) {
    frontier.assign(1, t);
    for (int depth = 0; depth < 4 && !frontier.empty(); ++depth) {
      next.clear();
      for (int q : frontier)
        for (int c : consumers[q]) {
          const Node& reader = *nodes[c];
          if (!is_elementwise(reader.op) || reader.numel() != nodes[t]->numel() || c == top) continue;
          if (!reader.requires_grad && !derived[c]) return true;
          next.push_back(c);
        }
      frontier.swap(next);
    }
    return false;
  };
  std::vector<int> chosen;
  std::vector<char> visited(nodes.size(), 0);
  std::vector<int> touched;
  struct Step {
    int position;
    bool via_copy;  // reached through copied values only
    int kept_depth; // kept elementwise values walked through since the last copied one
  };
  std::vector<Step> stack;
  for (int s : saved) {
    const Node& value = *nodes[s];
    if (!is_elementwise(value.op)) continue;
    // Walks what recomputing `value` reads, as apply_recompute would copy it: through views and
    // unkept elementwise values, up to kept ones. Kept elementwise values are walked through too
    // (not copied, not counted): the scheduler fuses most of them into their readers, so their
    // work is redone in the copy's kernel all the same.
    bool cheap = true;
    int chain = 0;
    for (int p : touched) visited[p] = 0;
    touched.clear();
    stack.assign(1, {s, true, 0});
    while (cheap && !stack.empty()) {
      const auto [p, via_copy, kept_depth] = stack.back();
      stack.pop_back();
      // The scheduler stores what costs more than a few ops to duplicate: deeper kept work is
      // not redone by the copy's kernel (and the walk stays short on long residual chains).
      if (kept_depth > kMaxKeptWalk) continue;
      // 1: walked as kept; 2: walked as copied (which re-walks what was walked as kept).
      const char mark = via_copy ? 2 : 1;
      if (visited[p] >= mark) continue;
      if (!visited[p]) touched.push_back(p);
      visited[p] = mark;
      const Node& n = *nodes[p];
      const bool copied =
          via_copy && (p == s || dropped[p] || (!is_saved[p] && ((n.requires_grad && !n.grad_leaf) || derived[p])));
      const bool walk = op_kind(n.op) == OpKind::Movement || (is_elementwise(n.op) && (n.requires_grad || derived[p]));
      // Not walked and copied: a reduction, matmul, gather, ... would be recomputed too. Not
      // walked and kept: saved anyway (or read through a kept value the backward reads), a
      // weight, or a value without gradient tracking, which must then be free to hold (a
      // constant or generator is fused into its reader).
      if (!walk) {
        if (copied || (via_copy && !n.requires_grad && !n.grad_leaf && op_kind(n.op) != OpKind::Leaf)) cheap = false;
        continue;
      }
      if (copied && op_kind(n.op) != OpKind::Movement && ++chain > kMaxCheapChain) {
        cheap = false;
        break;
      }
      // Transcendental work is cheap on a few values (the rsqrt of a layer norm's variances), or
      // where the backward's own kernels compute it anyway: inside themselves, or beside the copy.
      if (!transcendental && read_from_memory[s] && is_transcendental(n.op) && n.numel() * 8 > value.numel() &&
          (p == s || !evaluated_by_backward(p, s))) {
        cheap = false;
        break;
      }
      const bool next_via_copy = copied || (via_copy && op_kind(n.op) == OpKind::Movement);
      const int next_depth = next_via_copy ? 0 : kept_depth + (op_kind(n.op) == OpKind::Movement ? 0 : 1);
      for (const NodePtr& in : n.inputs)
        if (int q = index.of(in.get()); q >= 0) stack.push_back({q, next_via_copy, next_depth});
    }
    if (!cheap) continue;
    dropped[s] = 1;
    chosen.push_back(s);
  }
  return chosen;
}

}  // namespace memory
}  // namespace kiln
