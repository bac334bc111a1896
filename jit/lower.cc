#include "jit/lower.h"

#include <algorithm>
#include <map>
#include <optional>
#include <unordered_map>

#include <fmt/format.h>

#include "core/error.h"
#include "core/flags.h"
#include "jit/tile_matmul.h"
#include "ops/primitive.h"

namespace kiln::jit {

namespace {

// A further output of an elementwise kernel: `node`, of the kernel's shape, into `slot`.
struct SiblingOutput {
  const Node* node = nullptr;
  int slot = -1;
};

struct Lowerer {
  const PendingGraph& graph;
  Schedule& schedule;
  Program out;
  std::unordered_map<const Node*, int> position;  // pending node -> index
  std::unordered_map<const Node*, int> slot_of;   // materialized or external node -> plan slot
  std::unordered_map<const Node*, int> scalar_slot, rand_slot;
  int needs_buffer = -1;  // a node found to need a buffer of its own: lowering starts over

  Lowerer(const PendingGraph& g, Schedule& s) : graph(g), schedule(s) {
    for (size_t i = 0; i < g.nodes.size(); ++i) position[g.nodes[i].get()] = static_cast<int>(i);
  }

  bool has_slot(const Node* n) const { return slot_of.count(n) > 0; }

  void assign_slots();
  bool build_kernels();
  bool add_side_output(const Node* node, const std::vector<int>& kernel_of);
  int add_sibling_output(const Node* node, int slot, const std::vector<int>& writer_of_slot);
  int add_update_output(const Node* node, int slot, const std::vector<int>& writer_of_slot);
  bool join_outputs(int kk, std::vector<SiblingOutput> outputs, int read_only_in_place = -1);
  int tileable_product_read(const Node* node, const std::vector<int>& writer_of_slot) const;
  int replaced_external(const Node* node) const;
  bool replaces_shared_external(const Node* node) const;

  std::vector<int> kernel_node_;  // per kernel built: the node it was built for
  // Per kernel that joined further outputs (add_sibling_output, add_update_output): all of them,
  // so that another can join it too.
  std::unordered_map<int, std::vector<SiblingOutput>> more_of_kernel_;
  // How many kernels back a recomputed copy looks for a sibling kernel to join.
  static constexpr int kSiblingWindow = 64;
};

void Lowerer::assign_slots() {
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
    if (!schedule.materialized[i]) continue;
    slot_of[node] = static_cast<int>(out.slots.size());
    out.slots.push_back({-1, static_cast<int>(i), node->dtype, node->numel(), is_output[i], is_output[i]});
  }
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    if (schedule.alias_base[i] < 0) continue;
    int slot = slot_of.at(graph.nodes[schedule.alias_base[i]].get());
    out.slots[slot].keep = true;
    out.aliases.push_back({static_cast<int>(i), slot});
  }
}

// ---- building one kernel's IR ----

class KernelBuilder {
 public:
  KernelBuilder(const Lowerer& s, Kernel& k) : s_(s), k_(k) {}

  // Index of `node`'s value at multi-index `idx`, fused down to buffers, constants and generators.
  int value(const Node* node, const std::vector<IndexExpr>& idx, bool is_root = false);
  int buffer(int slot, DType dtype, bool written = false);
  // op(args) as one more value of the kernel.
  int compute(Op op, DType dtype, std::vector<int> args) {
    Expr e{Expr::Kind::Compute};
    e.op = op;
    e.dtype = dtype;
    e.args = std::move(args);
    return push(std::move(e));
  }
  IndexExpr linear(const std::vector<IndexExpr>& idx, const Shape& shape) { return linear_index(k_.ctx, idx, shape); }
  // `node`, a value this kernel stores (its output or a side store), is expr `id` at multi-index
  // `idx`: a later root reading that node at that element takes the value, not a load of what this
  // kernel is about to overwrite.
  // (Not for float16/bfloat16: a value stored there is rounded to the type, which a bare scalar
  // of the kernel may not be yet.)
  void note_root(const Node* node, int id, const std::vector<IndexExpr>& idx) {
    if (node->dtype == DType::Float16 || node->dtype == DType::BFloat16) return;
    roots_[node] = {id, k_.ctx.render(linear(idx, node->shape))};
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

  const Lowerer& s_;
  Kernel& k_;
  std::map<std::string, int> memo_;
  std::unordered_map<const Node*, std::pair<int, std::string>> roots_;  // note_root: expr, linear index
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
      if (auto root = roots_.find(base);
          root != roots_.end() && root->second.second == ctx.render(linear(idx, node->shape)))
        return root->second.first;
      Expr e{Expr::Kind::Load};
      e.dtype = base->dtype;
      e.buffer = buffer(slot->second, base->dtype);
      e.index = linear(idx, node->shape);
      // Under a pad the index may point outside the buffer where the pad's guard fails (the
      // value is then discarded); such a load must not touch memory at that index.
      if (ctx.whole_min(e.index) < 0 || ctx.whole_max(e.index) >= base->numel()) e.guards = pad_guards_;
      return push(std::move(e));
    }
  }
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
      if (node->op != Op::Pad) return value(node->inputs[0].get(), view_source_index(ctx, *node, idx));
      std::vector<Guard> guards;
      std::vector<IndexExpr> in_idx = view_source_index(ctx, *node, idx, &guards);
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
    case OpKind::Index: {
      // Gather: the source is a buffer, maybe under reshapes (same memory, same linear index);
      // the index is fused.
      note(node->op);
      const Node* src = node->inputs[0].get();
      const Node* base = src;
      while (!s_.slot_of.count(base) && base->op == Op::Reshape) base = base->inputs[0].get();
      int axis = static_cast<int>(node->ints[0]);
      auto strides = contiguous_strides(src->shape);
      Expr e{Expr::Kind::GatherLoad};
      e.dtype = node->dtype;
      e.buffer = buffer(s_.slot_of.at(base), base->dtype);
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

// Whether every address the kernel computes walks with a constant stride along loop variable
// `var` (so a loop over it vectorizes); div/mod atoms of the other loop variables are fine.
bool affine_in(const Kernel& k, const std::string& var) {
  for (const Expr& e : k.exprs) {
    if (!k.ctx.affine_in(e.index, var)) return false;
    for (const Guard& g : e.guards)
      if (!k.ctx.affine_in(g.expr, var)) return false;
  }
  return k.ctx.affine_in(k.store_index, var);
}

// An elementwise kernel over `shape` as a parallel loop "o" over its first `outer_dims` axes and an
// inner loop "i" over the rest (outer_dims 0: one flat parallel loop "i"). `more`: values of the
// same shape stored alongside (one builder, so loads and operations they share are done once).
Kernel build_elementwise(const Lowerer& s, const Node* node, int slot, size_t outer_dims,
                         const std::vector<SiblingOutput>& more = {}) {
  Kernel k;
  k.kind = KernelKind::Elementwise;
  KernelBuilder b(s, k);
  b.buffer(slot, node->dtype, true);
  const Shape& shape = node->shape;
  int64_t n = node->numel();
  k.out_numel = n;
  std::vector<IndexExpr> idx;
  if (outer_dims == 0 || shape.size() <= 1) {
    IndexExpr i = k.ctx.var("i", n);
    k.loops = {{"i", n, Loop::Role::Parallel}};
    idx = unflatten(k.ctx, i, shape);
    k.store_index = i;
  } else {
    const Shape outer_shape(shape.begin(), shape.begin() + static_cast<std::ptrdiff_t>(outer_dims));
    const Shape inner_shape(shape.begin() + static_cast<std::ptrdiff_t>(outer_dims), shape.end());
    const int64_t inner = numel(inner_shape), outer = numel(outer_shape);
    IndexExpr o = k.ctx.var("o", outer), i = k.ctx.var("i", inner);
    k.loops = {{"o", outer, Loop::Role::Parallel}, {"i", inner, Loop::Role::Inner}};
    idx = unflatten(k.ctx, o, outer_shape);
    for (IndexExpr& e : unflatten(k.ctx, i, inner_shape)) idx.push_back(std::move(e));
    k.store_index = k.ctx.add(k.ctx.scale(o, inner), i);
  }
  k.value = b.value(node, idx, true);
  b.note_root(node, k.value, idx);
  for (const SiblingOutput& m : more) {
    SideStore store;
    store.buffer = b.buffer(m.slot, m.node->dtype, true);
    store.value = b.value(m.node, idx, true);
    b.note_root(m.node, store.value, idx);
    k.side_stores.push_back(store);
  }
  k.summary += shape_str(shape);
  const auto copies = std::count_if(more.begin(), more.end(), [](const SiblingOutput& m) { return m.node->recompute; });
  if (copies > 0) k.summary += fmt::format(" +{} recomputed", copies);
  if (more.size() > static_cast<size_t>(copies)) k.summary += fmt::format(" +{} more", more.size() - static_cast<size_t>(copies));
  return k;
}

// The elementwise kernel with the longest inner loop along which every address is affine: one flat
// loop when possible; else, e.g. for a per-channel bias over (N, C, H, W), o over (N, C) and i
// over H*W (not just W: a short inner loop of half-precision values runs at half speed).
Kernel build_elementwise(const Lowerer& s, const Node* node, int slot, const std::vector<SiblingOutput>& more = {}) {
  const size_t dims = node->shape.size();
  for (size_t outer_dims = 0; outer_dims + 1 < dims; ++outer_dims) {
    Kernel k = build_elementwise(s, node, slot, outer_dims, more);
    if (affine_in(k, "i")) return k;
  }
  return build_elementwise(s, node, slot, dims == 0 ? 0 : dims - 1, more);
}

Kernel build_reduce(const Lowerer& s, const Node* node, int slot, bool flat) {
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

Kernel build_scatter(const Lowerer& s, const Node* node, int slot) {
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

// The buffer and strides a library operand (matmul, attention) reads: a chain of views over a
// buffer, one stride per dim of `in`. False when the views are not strided (a reshape that mixes
// dimensions): the operand then needs a buffer of its own, noted in s.needs_buffer.
bool strided_operand(Lowerer& s, Kernel& k, const Node* in, int& buffer_out, int64_t* strides, int64_t& offset) {
  IndexContext ctx;  // its own variables: the operands have different extents
  std::vector<IndexExpr> idx;
  std::vector<std::string> names;
  for (size_t d = 0; d < in->shape.size(); ++d) {
    names.push_back(fmt::format("d{}", d));
    idx.push_back(ctx.var(names.back(), in->shape[d]));
  }
  const Node* node = in;
  std::optional<IndexExpr> reshaped;  // set when reshapes lead straight to the buffer
  while (!s.has_slot(node)) {
    if (node->op == Op::Reshape) {
      const Node* base = node;
      while (!s.has_slot(base) && base->op == Op::Reshape) base = base->inputs[0].get();
      if (s.has_slot(base)) {  // the buffer's own linear index: no div/mod to fold back
        reshaped = linear_index(ctx, idx, node->shape);
        node = base;
        break;
      }
    }
    KILN_CHECK(op_kind(node->op) == OpKind::Movement && node->op != Op::Pad, "jit",
               "library operand through {} is not a view", op_name(node->op));
    idx = view_source_index(ctx, *node, idx);
    node = node->inputs[0].get();
  }
  IndexExpr lin = reshaped ? *reshaped : linear_index(ctx, idx, node->shape);
  if (!ctx.is_affine(lin)) {
    s.needs_buffer = s.position.at(in);
    return false;
  }
  for (size_t d = 0; d < names.size(); ++d) strides[d] = ctx.coefficient(lin, names[d]);
  offset = ctx.offset(lin);
  buffer_out = KernelBuilder(s, k).buffer(s.slot_of.at(node), node->dtype);
  return true;
}

// The buffer under a library operand: decide_materialization gave it one, maybe under reshapes.
int contiguous_operand(Lowerer& s, Kernel& k, const Node* in) {
  const Node* node = in;
  while (!s.has_slot(node)) {
    KILN_CHECK(node->op == Op::Reshape, "jit", "library operand {} has no buffer", op_name(node->op));
    node = node->inputs[0].get();
  }
  return KernelBuilder(s, k).buffer(s.slot_of.at(node), node->dtype);
}

// A library kernel writing `node` into `slot`: its kind, output buffer and size; the caller adds
// the operands and the call.
Kernel library_kernel(Lowerer& s, KernelKind kind, const Node* node, int slot) {
  Kernel k;
  k.kind = kind;
  KernelBuilder(s, k).buffer(slot, node->dtype, true);
  k.out_numel = node->numel();
  return k;
}

Kernel build_collective(Lowerer& s, const Node* node, int slot) {
  Kernel k = library_kernel(s, KernelKind::Collective, node, slot);
  for (const NodePtr& in : node->inputs) {
    k.collective.in_buffers.push_back(contiguous_operand(s, k, in.get()));
    k.collective.counts.push_back(in->numel());
  }
  CollectiveCall& c = k.collective;
  if (node->op == Op::AllReduce) {
    c.op = node->ints[0];
    c.group = node->ints[3];
    k.summary = fmt::format("AllReduce {} [{}]", node->ints[0] == 0 ? "sum" : "max", node->numel());
  } else {
    c.kind = node->op == Op::Send ? CollectiveKind::Send : CollectiveKind::Recv;
    c.peer = node->ints[0];
    c.tag = node->ints[1];
    k.summary = node->op == Op::Send
                    ? fmt::format("Send {} to rank {} tag {}", shape_str(node->inputs[0]->shape), c.peer, c.tag)
                    : fmt::format("Recv {} from rank {} tag {}", shape_str(node->shape), c.peer, c.tag);
  }
  return k;
}

Kernel build_quantized_matmul(Lowerer& s, const Node* node, int slot) {
  Kernel k = library_kernel(s, KernelKind::QuantizedMatmul, node, slot);
  QuantizedMatmulCall& q = k.quantized;
  q.a_buffer = contiguous_operand(s, k, node->inputs[0].get());
  q.b_buffer = contiguous_operand(s, k, node->inputs[1].get());
  q.M = node->shape[0];
  q.K = node->inputs[0]->shape[1];
  q.N = node->shape[1];
  q.b_packed = !node->ints.empty();  // prim::quantized_matmul_packed
  k.summary = fmt::format("QuantizedMatmul int8 [{}, {}, {}]{}", q.M, q.K, q.N, q.b_packed ? " packed" : "");
  return k;
}

Kernel build_conv(Lowerer& s, const Node* node, int slot) {
  Kernel k = library_kernel(s, KernelKind::Conv, node, slot);
  ConvCall& c = k.conv;
  c.pass = node->op == Op::Conv2d               ? ConvPass::Forward
           : node->op == Op::Conv2dBackwardData ? ConvPass::BackwardData
                                                : ConvPass::BackwardWeight;
  c.a_buffer = contiguous_operand(s, k, node->inputs[0].get());
  c.b_buffer = contiguous_operand(s, k, node->inputs[1].get());
  c.geometry = prim::conv_geometry(*node);
  k.summary = fmt::format("{} {} * {} -> {}", op_name(node->op), shape_str(node->inputs[0]->shape),
                          shape_str(node->inputs[1]->shape), shape_str(node->shape));
  return k;
}

Kernel build_pool(Lowerer& s, const Node* node, int slot) {
  Kernel k = library_kernel(s, KernelKind::Pool, node, slot);
  PoolCall& p = k.pool;
  p.x_buffer = contiguous_operand(s, k, node->inputs[0].get());
  if (node->op != Op::MaxPoolOffsets) p.offsets_buffer = contiguous_operand(s, k, node->inputs[1].get());
  p.scatter = node->op == Op::MaxPoolScatter;
  p.kh = node->ints[0];
  p.kw = node->ints[1];
  const Shape& grid = p.scatter ? node->inputs[0]->shape : node->shape;
  p.planes = grid[0] * grid[1];
  p.OH = grid[2];
  p.OW = grid[3];
  k.summary = fmt::format("{} {} {}x{} -> {}", op_name(node->op), shape_str(node->inputs[0]->shape), p.kh, p.kw,
                          dtype_name(node->dtype));
  return k;
}

// Forward: q, k, v strided; writes o (B, Tq, H, Dv) and lse (B, H, Tq) into its flat output.
// Backward: q, k, v, the forward's flat output and dout strided; writes dq, dk, dv regions.
bool build_attention(Lowerer& s, const Node* node, int slot, Kernel& k) {
  k.kind = KernelKind::Attention;
  KernelBuilder(s, k).buffer(slot, node->dtype, true);
  AttentionCall& a = k.attention;
  const prim::AttentionShape shape = prim::attention_shape(*node);
  a.backward = node->op == Op::AttentionBackward;
  a.causal = shape.causal;
  a.scale = shape.scale;
  a.B = shape.B, a.H = shape.H, a.Tq = shape.Tq, a.Tk = shape.Tk, a.D = shape.D, a.Dv = shape.Dv;
  auto operand = [&](const Node* in, AttentionOperand& op) {
    return strided_operand(s, k, in, op.buffer, op.strides, op.offset);
  };
  if (!operand(node->inputs[0].get(), a.q) || !operand(node->inputs[1].get(), a.k) ||
      !operand(node->inputs[2].get(), a.v))
    return false;
  // A region of a flat buffer laid out (B, T, H, d): strides over (b, h, t, d).
  auto region = [&](int buffer, int64_t offset, int64_t T, int64_t d) {
    return AttentionOperand{buffer, {T * a.H * d, d, a.H * d, 1}, offset};
  };
  auto lse_region = [&](int buffer, int64_t offset) {  // (B, H, Tq)
    return AttentionOperand{buffer, {a.H * a.Tq, a.Tq, 1, 0}, offset};
  };
  if (!a.backward) {
    a.o = region(0, 0, a.Tq, a.Dv);
    a.lse = lse_region(0, shape.out_elements());
    k.summary = fmt::format("Attention{} q {} k {} v {}", a.causal ? " causal" : "", shape_str(node->inputs[0]->shape),
                            shape_str(node->inputs[1]->shape), shape_str(node->inputs[2]->shape));
  } else {
    const Node* forward = node->inputs[3].get();
    KILN_CHECK(s.has_slot(forward), "jit", "attention backward: the forward's output has no buffer");
    const int fb = KernelBuilder(s, k).buffer(s.slot_of.at(forward), forward->dtype);
    a.o = region(fb, 0, a.Tq, a.Dv);
    a.lse = lse_region(fb, shape.out_elements());
    if (!operand(node->inputs[4].get(), a.dout)) return false;
    a.dq = region(0, 0, a.Tq, a.D);
    a.dk = region(0, shape.dq_elements(), a.Tk, a.D);
    a.dv = region(0, shape.dq_elements() + shape.dk_elements(), a.Tk, a.Dv);
    k.summary = fmt::format("AttentionBackward{} q {} k {} v {}", a.causal ? " causal" : "",
                            shape_str(node->inputs[0]->shape), shape_str(node->inputs[1]->shape),
                            shape_str(node->inputs[2]->shape));
  }
  k.out_numel = node->numel();
  return true;
}

// A materialized cast of a value that an elementwise kernel writes becomes a second output of
// that kernel: one pass over the data instead of two. (An optimizer's update and autocast's
// low-precision copy of the new weight: ops/autocast.h.)
bool Lowerer::add_side_output(const Node* node, const std::vector<int>& kernel_of) {
  if (node->op != Op::Cast || node->realized()) return false;
  const Node* src = node->inputs[0].get();
  auto at = position.find(src);
  if (at == position.end() || kernel_of[at->second] < 0 || src->shape != node->shape) return false;
  Kernel& k = out.kernels[kernel_of[at->second]];
  if (k.kind != KernelKind::Elementwise) return false;
  // The source is the kernel's output or one of its side stores (an update joined to its
  // momentum's kernel: add_update_output).
  int source = k.buffers[0].slot == slot_of.at(src) ? k.value : -1;
  for (const SideStore& side : k.side_stores)
    if (k.buffers[side.buffer].slot == slot_of.at(src)) source = side.value;
  if (source < 0) return false;
  KernelBuilder b(*this, k);
  SideStore store;
  store.value = b.compute(Op::Cast, node->dtype, {source});
  store.buffer = b.buffer(slot_of.at(node), node->dtype, true);
  k.side_stores.push_back(store);
  k.summary += fmt::format(" +{}", dtype_name(node->dtype));
  return true;
}

// The slot of a product that jit/tile_matmul.h may make tile by tile (a weight gradient) which
// `node`'s kernel would read, or -1.
int Lowerer::tileable_product_read(const Node* node, const std::vector<int>& writer_of_slot) const {
  std::vector<const Node*> stack;
  for (const NodePtr& in : node->inputs) stack.push_back(in.get());
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    if (auto found = slot_of.find(n); found != slot_of.end()) {
      const int w = writer_of_slot[found->second];
      if (w >= 0 && out.kernels[w].kind == KernelKind::Matmul &&
          matmul_row_block(out.kernels[w].matmul, out.slots[found->second].dtype) > 0)
        return found->second;
      continue;
    }
    if (position.count(n))
      for (const NodePtr& in : n->inputs) stack.push_back(in.get());
  }
  return -1;
}

// The external that `node` replaces (an update `e.assign(...)`), or -1.
int Lowerer::replaced_external(const Node* node) const {
  for (size_t o = 0; o < graph.outputs.size(); ++o)
    if (graph.nodes[graph.outputs[o]].get() == node) return graph.replaced_external[o];
  return -1;
}

// Whether `node` is an update `e.assign(...)` of an external value that other nodes read too
// (a parameter the backward still reads): made earlier, it could no longer overwrite e in place.
bool Lowerer::replaces_shared_external(const Node* node) const {
  const int e = replaced_external(node);
  return e >= 0 && graph.external_edges[e] > 1;
}

// A recomputed copy (memory/recompute.h) of the shape of an earlier elementwise kernel that reads
// the same saved values (a GELU's backward, and the GELU's output recomputed for the next
// layer's weight gradient) becomes that kernel's second output: the loads and the erf are done
// once, and the copy costs a store. Only a backward kernel, and only where everything the copy
// reads is written before it, so moving the copy's work earlier reads the same values.
// Likewise an update reading a weight gradient that an earlier update kernel reads (Adam's m and
// v): one kernel reads the gradient, so jit/tile_matmul.h can make it tile by tile inside it.
int Lowerer::add_sibling_output(const Node* node, int slot, const std::vector<int>& writer_of_slot) {
  if (!is_elementwise(node->op) || node->realized()) return -1;
  int product = -1;  // an update's: the gradient both kernels must read
  if (!node->recompute) {
    if (!flags().tiled_updates || node->requires_grad || replaces_shared_external(node)) return -1;
    product = tileable_product_read(node, writer_of_slot);
    if (product < 0) return -1;
  }
  const Kernel alone = build_elementwise(*this, node, slot);
  int latest_input = -1;  // the last kernel writing a buffer the copy reads
  std::vector<int> reads;
  for (size_t b = 1; b < alone.buffers.size(); ++b) {
    const int w = writer_of_slot[alone.buffers[b].slot];
    latest_input = std::max(latest_input, w);
    reads.push_back(alone.buffers[b].slot);
  }
  const int n = static_cast<int>(out.kernels.size());
  for (int kk = n - 1; kk > latest_input && kk >= n - kSiblingWindow; --kk) {
    const Kernel& k = out.kernels[kk];
    const Node* primary = graph.nodes[kernel_node_[kk]].get();
    // A forward kernel would make the copy before the backward starts, and keep it through: one
    // with gradient tracking, or one computed from inputs alone (a normalized batch), which is
    // neither the backward's, a copy, nor a variable's update.
    const bool forward =
        primary->requires_grad || (!primary->backward && !primary->recompute && primary->replaces.expired());
    if (k.kind != KernelKind::Elementwise || !k.side_stores.empty() || primary->shape != node->shape || forward)
      continue;
    const bool shares = std::any_of(k.buffers.begin() + 1, k.buffers.end(), [&](const KernelBuffer& b) {
      return product >= 0 ? b.slot == product : std::find(reads.begin(), reads.end(), b.slot) != reads.end();
    });
    if (shares && join_outputs(kk, {{node, slot}})) return kk;
  }
  return -1;
}

// Rebuilds kernel kk with `outputs` (all its further outputs, those it had and the new) stored
// beside its own: one builder, so loads and operations they share are done once. Refused (false,
// kk unchanged) when the rebuilt kernel would load a buffer it writes — a value it stores, read at
// another element — or loop differently, or read slot `read_only_in_place` at another element
// than the one it stores.
bool Lowerer::join_outputs(int kk, std::vector<SiblingOutput> outputs, int read_only_in_place) {
  const Kernel& k = out.kernels[kk];
  Kernel merged = build_elementwise(*this, graph.nodes[kernel_node_[kk]].get(), k.buffers[0].slot, outputs);
  const bool reads_own_output = std::any_of(merged.exprs.begin(), merged.exprs.end(), [&](const Expr& e) {
    return (e.kind == Expr::Kind::Load || e.kind == Expr::Kind::GatherLoad) && merged.buffers[e.buffer].written;
  });
  if (reads_own_output || merged.loops.size() != k.loops.size()) return false;
  for (size_t b = 1; b < merged.buffers.size(); ++b)
    if (merged.buffers[b].slot == read_only_in_place && !reads_at_store_index(merged, static_cast<int>(b)))
      return false;
  merged.name = k.name;
  merged.label = k.label;
  merged.recompute = k.recompute;  // the kernel's own output's flags (offload, memory::report)
  merged.backward = k.backward;
  out.kernels[kk] = std::move(merged);
  more_of_kernel_[kk] = std::move(outputs);
  return true;
}

// An update `p.assign(f(p, v))` that reads, element for element, a value an earlier elementwise
// kernel of its shape stores — SGD's `w - lr·v` after the momentum `v = μ·v + g`, Adam's step
// after its m and v — becomes one more output of that kernel: one pass over the parameter and its
// state instead of two, and in a weight gradient made tile by tile (jit/tile_matmul.h) the update
// runs while the tile is in cache. Only where no kernel in between reads p, which the joined
// update overwrites where that kernel stands; the update's value is the same expression either way.
int Lowerer::add_update_output(const Node* node, int slot, const std::vector<int>& writer_of_slot) {
  // (A parameter's new value requires grad as the parameter does, as a leaf: nothing is
  // differentiated through its computation.)
  if (!is_elementwise(node->op) || node->realized() || (node->requires_grad && !node->grad_leaf) || node->recompute)
    return -1;
  const int external = replaced_external(node);
  if (external < 0) return -1;
  const int p_slot = slot_of.at(graph.externals[static_cast<size_t>(external)].get());
  const Kernel alone = build_elementwise(*this, node, slot);
  const int n = static_cast<int>(out.kernels.size());
  for (int kk = n - 1; kk >= 0 && kk >= n - kSiblingWindow; --kk) {
    const Kernel& k = out.kernels[kk];
    const bool reads_p = std::any_of(k.buffers.begin() + 1, k.buffers.end(),
                                     [p_slot](const KernelBuffer& b) { return b.slot == p_slot; });
    std::vector<int> stored = {k.buffers[0].slot};
    for (const SideStore& side : k.side_stores) stored.push_back(k.buffers[side.buffer].slot);
    auto stored_here = [&](int s) { return std::find(stored.begin(), stored.end(), s) != stored.end(); };
    bool shares = false, ready = true;  // reads what k stores; everything else it reads is there
    for (size_t b = 1; b < alone.buffers.size(); ++b) {
      const int s = alone.buffers[b].slot;
      if (stored_here(s)) shares = true;
      else if (writer_of_slot[s] >= kk) ready = false;
    }
    if (!ready) return -1;  // neither here nor earlier
    const Node* primary = graph.nodes[kernel_node_[kk]].get();
    auto more = more_of_kernel_.find(kk);
    const size_t joined = more == more_of_kernel_.end() ? 0 : more->second.size();
    if (shares && k.kind == KernelKind::Elementwise && primary->shape == node->shape &&
        (!primary->requires_grad || primary->grad_leaf) &&
        k.side_stores.size() == joined) {
      std::vector<SiblingOutput> outputs = joined > 0 ? more->second : std::vector<SiblingOutput>{};
      outputs.push_back({node, slot});
      // p read only at the element it stores, or the update could not overwrite p in place there.
      if (join_outputs(kk, std::move(outputs), p_slot)) return kk;
    }
    // p is read here, so the update must come after; or the kernel can fail, and an update before
    // it could not be made in place (a failed run leaves every tensor as it was: jit/plan.cc).
    if (reads_p || may_fail(k)) return -1;
  }
  return -1;
}

bool Lowerer::build_kernels() {
  std::vector<int> kernel_of(graph.nodes.size(), -1);  // node -> the kernel that writes it
  std::vector<int> writer_of_slot(out.slots.size(), -1);
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    if (!schedule.materialized[i]) continue;
    const Node* node = graph.nodes[i].get();
    int slot = slot_of.at(node);
    if (add_side_output(node, kernel_of)) {
      kernel_of[i] = kernel_of[position.at(node->inputs[0].get())];
      writer_of_slot[slot] = kernel_of[i];
      continue;
    }
    if (int kk = add_sibling_output(node, slot, writer_of_slot); kk >= 0) {
      kernel_of[i] = kk;
      writer_of_slot[slot] = kk;
      continue;
    }
    if (int kk = add_update_output(node, slot, writer_of_slot); kk >= 0) {
      kernel_of[i] = kk;
      writer_of_slot[slot] = kk;
      continue;
    }
    Kernel k;
    switch (op_kind(node->op)) {
      case OpKind::Reduce:
        k = build_reduce(*this, node, slot, true);
        // Nested loops avoid a division per element where the producer's indexes are not affine
        // in the flat index; but a float sum keeps the flat loop, whose fixed blocks and lanes
        // over the flat index make it equal to the sum of the stored value (issue 18's one
        // result). A max, and an integer sum, are exact in any order.
        if (k.out_numel == 1 && !all_affine(k) && !(node->op == Op::ReduceSum && is_floating(node->dtype)))
          k = build_reduce(*this, node, slot, false);
        break;
      case OpKind::Library: {
        if (node->op == Op::AllReduce || node->op == Op::Send || node->op == Op::Recv) {
          k = build_collective(*this, node, slot);
          break;
        }
        if (node->op == Op::QuantizedMatmul) {
          k = build_quantized_matmul(*this, node, slot);
          break;
        }
        if (node->op == Op::Attention || node->op == Op::AttentionBackward) {
          if (!build_attention(*this, node, slot, k)) return false;
          break;
        }
        if (node->op == Op::MaxPoolOffsets || node->op == Op::MaxPoolGather || node->op == Op::MaxPoolScatter) {
          k = build_pool(*this, node, slot);
          break;
        }
        if (node->op != Op::Matmul) {
          k = build_conv(*this, node, slot);
          break;
        }
        k.kind = KernelKind::Matmul;
        KernelBuilder(*this, k).buffer(slot, node->dtype, true);
        MatmulCall& mm = k.matmul;
        if (!strided_operand(*this, k, node->inputs[0].get(), mm.a_buffer, mm.a_strides, mm.a_offset) ||
            !strided_operand(*this, k, node->inputs[1].get(), mm.b_buffer, mm.b_strides, mm.b_offset))
          return false;
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
          k = build_elementwise(*this, node, slot);
        }
    }
    k.name = fmt::format("kiln_k{}", out.kernels.size());
    k.label = node->label;
    k.recompute = node->recompute;
    k.backward = (node->backward || node->recompute) && !node->saved_copy;
    kernel_of[i] = static_cast<int>(out.kernels.size());
    writer_of_slot[slot] = kernel_of[i];
    kernel_node_.push_back(static_cast<int>(i));
    out.kernels.push_back(std::move(k));
  }
  return true;
}

}  // namespace

bool reads_at_store_index(const Kernel& k, int b) {
  const std::string store = k.ctx.render(k.store_index);
  for (const Expr& e : k.exprs)
    if (e.buffer == b && (e.kind != Expr::Kind::Load || k.ctx.render(e.index) != store)) return false;
  return true;
}

Program lower(const PendingGraph& graph, Schedule schedule) {
  for (size_t attempt = 0;; ++attempt) {
    Lowerer l(graph, schedule);
    l.assign_slots();
    if (l.build_kernels()) return std::move(l.out);
    KILN_CHECK(attempt < graph.nodes.size() && !schedule.materialized[l.needs_buffer], "jit",
               "internal: lowering did not converge");
    schedule.materialized[l.needs_buffer] = true;
  }
}

}  // namespace kiln::jit
