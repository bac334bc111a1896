#include "jit/schedule.h"

#include <algorithm>
#include <map>
#include <optional>
#include <unordered_map>

#include <fmt/format.h>

#include "core/error.h"

namespace kiln::jit {

// ---------------------------------------------------------------------------------------------
// Collecting the pending graph
// ---------------------------------------------------------------------------------------------

namespace {
bool is_cheap_view(Op op) {
  OpKind k = op_kind(op);
  return k == OpKind::Movement || op == Op::Full || op == Op::Iota;
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
  for (const NodePtr& t : targets) {
    if (t->realized() || seen(t.get())) continue;
    t->visit = walk;
    t->visit_index = kOnStack;
    stack.push_back({t.get(), 0});
    while (!stack.empty()) {
      auto& [node, next] = stack.back();
      if (next < node->inputs.size()) {
        Node* in = node->inputs[next++].get();
        if (seen(in)) continue;
        in->visit = walk;
        if (in->realized()) {
          in->visit_index = static_cast<int64_t>(g.externals.size());
          g.externals.push_back(in->shared_from_this());
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
    auto slot = s_.slot_of.find(node);
    if (slot != s_.slot_of.end()) {
      Expr e{Expr::Kind::Load};
      e.dtype = node->dtype;
      e.buffer = buffer(slot->second, node->dtype);
      e.index = linear(idx, node->shape);
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
          int inner = value(node->inputs[0].get(), in_idx);
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
  const int64_t last = in_shape.empty() ? 1 : in_shape.back();
  const bool last_reduced =
      std::find(node->ints.begin(), node->ints.end(), static_cast<int64_t>(in_shape.size()) - 1) != node->ints.end();
  if (k.out_numel > 1 && !in_shape.empty() && !last_reduced && last > 1) {
    // Reducing over outer axes of rows (e.g. a bias gradient [B, N] -> [1, N]): the contiguous
    // last axis becomes the vectorized inner loop, with one accumulator per element of it.
    k.column = true;
    int64_t outer = k.out_numel / last;
    IndexExpr o = k.ctx.var("o", outer), i = k.ctx.var("i", last);
    k.loops.push_back({"o", outer, Loop::Role::Parallel});
    Shape outer_shape(node->shape.begin(), node->shape.end() - 1);
    idx = unflatten(k.ctx, o, outer_shape);
    idx.push_back(i);
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
  const Node* node = in;
  while (!s.has_slot(node)) {
    const Shape& src = node->inputs[0]->shape;
    std::vector<IndexExpr> next(src.size(), ctx.constant(0));
    if (node->op == Op::Reshape) {
      IndexExpr lin = ctx.constant(0);
      auto st = contiguous_strides(node->shape);
      for (size_t d = 0; d < idx.size(); ++d) lin = ctx.add(lin, ctx.scale(idx[d], st[d]));
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
  IndexExpr lin = ctx.constant(0);
  auto st = contiguous_strides(node->shape);
  for (size_t d = 0; d < idx.size(); ++d) lin = ctx.add(lin, ctx.scale(idx[d], st[d]));
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
