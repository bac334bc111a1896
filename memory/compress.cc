#include "memory/compress.h"

#include <cmath>
#include <functional>
#include <unordered_map>
#include <unordered_set>

#include "core/flags.h"
#include "memory/recompute.h"
#include "ops/primitive.h"

namespace kiln::memory {

namespace {

constexpr int64_t kMinGroup = 32;

// First axis of the scale groups: the shortest run of trailing axes with kMinGroup elements or
// more. 0 means the whole tensor would be one group, which compression does not take: one scale
// for a whole small tensor (logits) loses too much, and it saves little.
size_t group_axis(const Shape& shape) {
  int64_t count = 1;
  for (size_t k = shape.size(); k-- > 0;) {
    count *= shape[k];
    if (count >= kMinGroup) return k;
  }
  return 0;
}

bool is_comparison(Op op) {
  return op == Op::Lt || op == Op::Le || op == Op::Gt || op == Op::Ge || op == Op::Eq || op == Op::Ne;
}

// The nodes one rewrite records with prim:: calls, marked as forward work (the copy, computed
// with the forward and run as soon as it can) or as the backward's (its reading).
class Recording {
 public:
  Recording() : first_(Node::next_id()) {}
  void mark(const Tensor& t, bool forward, uint32_t label) {
    std::vector<Node*> stack{t.node().get()};
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      if (n->id <= first_ || n->realized() || !marked_.insert(n).second) continue;
      n->saved_copy = forward;
      n->requires_grad = forward;  // forward work, as the value it copies
      n->backward = !forward;
      n->compress = false;
      n->label = label;
      for (const NodePtr& in : n->inputs) stack.push_back(in.get());
    }
  }

 private:
  uint64_t first_;
  std::unordered_set<Node*> marked_;
};

Tensor constant(const Tensor& like, double value) { return prim::full(like.shape(), value, like.dtype()); }

// x as int8 with one scale per group: {q, s}; the reading is cast(q) * s.
std::pair<Tensor, Tensor> quantize(const Tensor& x, DType compute) {
  Tensor xc = prim::cast(x, compute);
  std::vector<int64_t> axes;
  for (size_t k = group_axis(x.shape()); k < x.shape().size(); ++k) axes.push_back(static_cast<int64_t>(k));
  Tensor amax = prim::reduce(Op::ReduceMax, prim::unary(Op::Abs, xc), axes);
  // The floor keeps an all-zero group from dividing by zero; the max propagates a NaN.
  Tensor s = prim::binary(Op::Max, prim::binary(Op::Mul, amax, constant(amax, 1.0 / 127.0)), constant(amax, 1e-30));
  Tensor v = prim::binary(Op::Div, xc, prim::expand(s, x.shape()));
  // Rounded to nearest, but at least 1 away from 0 unless x is 0: the sign survives. (NaN and
  // inf groups: their scale is NaN or inf, so whatever int8 they get reads back non-finite.)
  Tensor magnitude = prim::unary(Op::Floor, prim::binary(Op::Add, prim::unary(Op::Abs, v), constant(v, 0.5)));
  Tensor r = prim::binary(Op::Mul, prim::unary(Op::Sign, v), prim::binary(Op::Max, magnitude, constant(v, 1.0)));
  return {prim::cast(r, DType::Int8), s};
}

Tensor dequantize(const Tensor& q, const Tensor& s, DType dtype) {
  Tensor v = prim::binary(Op::Mul, prim::cast(q, s.dtype()), prim::expand(s, q.shape()));
  return prim::cast(v, dtype);
}

// Bit weights 1, 2, 4, ... 128 along the last axis of (rows, 8).
Tensor bit_weights(int64_t rows) {
  Shape shape{rows, 8};
  return prim::binary(Op::Pow, prim::full(shape, 2.0, DType::Float32), prim::iota(shape, 1, DType::Float32));
}

// A bool tensor as bits, 8 to a byte (row-major, zero-padded to a multiple of 8).
Tensor pack_bits(const Tensor& mask) {
  const int64_t n = mask.numel(), rows = (n + 7) / 8;
  Tensor flat = prim::reshape(prim::cast(mask, DType::Float32), {n});
  if (rows * 8 != n) flat = prim::pad(flat, {0}, {rows * 8 - n});
  Tensor weighted = prim::binary(Op::Mul, prim::reshape(flat, {rows, 8}), bit_weights(rows));
  return prim::cast(prim::reshape(prim::reduce(Op::ReduceSum, weighted, {1}), {rows}), DType::UInt8);
}

Tensor unpack_bits(const Tensor& bits, const Shape& shape) {
  const int64_t rows = bits.numel(), n = numel(shape);
  Tensor bytes = prim::expand(prim::reshape(prim::cast(bits, DType::Float32), {rows, 1}), {rows, 8});
  Tensor shifted = prim::unary(Op::Floor, prim::binary(Op::Div, bytes, bit_weights(rows)));
  Tensor half = prim::unary(Op::Floor, prim::binary(Op::Mul, shifted, constant(shifted, 0.5)));
  Tensor bit = prim::binary(Op::Sub, shifted, prim::binary(Op::Mul, half, constant(half, 2.0)));
  Tensor flat = prim::reshape(prim::binary(Op::Gt, bit, constant(bit, 0.5)), {rows * 8});
  if (rows * 8 != n) flat = prim::slice(flat, {0}, {1}, {n});
  return prim::reshape(flat, shape);
}

// A read of a saved value by the backward: input `slot` of `consumer`, which is the value itself
// or the view of it at `position`.
struct Read {
  NodePtr consumer;
  size_t slot;
  int position;
};

// The other operand of a comparison with a constant that reads `value` directly, or null.
const Node* compared_constant(const Read& read, const Node* value) {
  const Node& c = *read.consumer;
  if (!is_comparison(c.op) || c.inputs[read.slot].get() != value) return nullptr;
  const Node* other = c.inputs[1 - read.slot].get();
  return other->op == Op::Full && !other->realized() ? other : nullptr;
}

}  // namespace

Compression compress_saved_activations(const std::vector<NodePtr>& nodes) {
  Compression done;
  if (!flags().lazy) return done;  // eager: every value is computed, and kept, as it is recorded
  const GraphIndex index(nodes);
  // Saved values: read by the forward (not just viewed) and by the backward, directly or
  // through views. With or without gradient tracking: a frozen layer's output the backward
  // reads is kept as much as any other.
  std::vector<char> forward_use(nodes.size(), 0), recomputed(nodes.size(), 0);
  std::vector<std::vector<Read>> reads(nodes.size());
  for (const NodePtr& consumer : nodes) {
    const bool backward = (consumer->backward || consumer->recompute) && !consumer->saved_copy;
    if (!backward && op_kind(consumer->op) == OpKind::Movement) continue;  // a view, not a use
    for (size_t slot = 0; slot < consumer->inputs.size(); ++slot) {
      int p = index.of(consumer->inputs[slot].get());
      if (p < 0 || index.base[p] < 0) continue;
      const int base = index.base[p];
      if (!backward) forward_use[base] = 1;
      else if (consumer->recompute) recomputed[base] = 1;  // recomputation must see the forward's value
      else reads[base].push_back({consumer, slot, p});
    }
  }
  std::vector<char> candidate(nodes.size(), 0);
  for (size_t p = 0; p < nodes.size(); ++p) {
    const Node& x = *nodes[p];
    bool weight_copy = x.op == Op::Cast && x.inputs[0]->grad_leaf;  // autocast's copy of a parameter
    candidate[p] = index.base[p] == static_cast<int>(p) && x.compress && !x.saved_copy && !x.backward &&
                   !x.recompute && x.held == 0 && is_floating(x.dtype) && !weight_copy && group_axis(x.shape) > 0 &&
                   forward_use[p] && !recomputed[p] && !reads[p].empty();
  }
  for (size_t p = 0; p < nodes.size(); ++p) {
    if (!candidate[p]) continue;
    const NodePtr& x = nodes[p];
    Tensor value(x);
    Recording recording;
    bool masks_only = true;
    for (const Read& read : reads[p]) masks_only &= compared_constant(read, x.get()) != nullptr;
    if (masks_only) {
      // Each comparison is taken in the forward and kept as bits.
      std::unordered_map<Node*, Tensor> unpacked;  // per comparison node
      for (const Read& read : reads[p]) {
        Node* compare = read.consumer.get();
        if (unpacked.count(compare)) continue;
        Tensor constant_side(compare->inputs[1 - read.slot]);
        Tensor taken = read.slot == 0 ? prim::binary(compare->op, value, constant_side)
                                      : prim::binary(compare->op, constant_side, value);
        Tensor bits = pack_bits(taken);
        recording.mark(bits, true, x->label);
        done.kept_bytes += static_cast<int64_t>(bits.node()->nbytes());
        Tensor mask = unpack_bits(bits, x->shape);
        recording.mark(mask, false, compare->label);
        unpacked.emplace(compare, mask);
      }
      for (const NodePtr& consumer : nodes)
        for (NodePtr& in : consumer->inputs)
          if (auto it = unpacked.find(in.get()); it != unpacked.end()) in = it->second.node();
    } else {
      const DType compute = x->dtype == DType::Float64 ? DType::Float64 : DType::Float32;
      auto [q, s] = quantize(value, compute);
      recording.mark(q, true, x->label);
      done.kept_bytes += static_cast<int64_t>(q.node()->nbytes() + s.node()->nbytes());
      Tensor reading = dequantize(q, s, x->dtype);
      recording.mark(reading, false, reads[p].front().consumer->label);
      // Views of x the backward reads are made again over the reading.
      std::unordered_map<int, NodePtr> over_reading{{static_cast<int>(p), reading.node()}};
      std::function<NodePtr(int)> remade = [&](int position) -> NodePtr {
        auto it = over_reading.find(position);
        if (it != over_reading.end()) return it->second;
        const Node& view = *nodes[position];
        auto copy = std::make_shared<Node>();
        copy->op = view.op;
        copy->dtype = view.dtype;
        copy->device = view.device;
        copy->shape = view.shape;
        copy->ints = view.ints;
        copy->inputs = {remade(index.of(view.inputs[0].get()))};
        copy->backward = true;
        copy->compress = false;
        copy->label = view.label;
        return over_reading[position] = copy;
      };
      for (const Read& read : reads[p]) read.consumer->inputs[read.slot] = remade(read.position);
    }
    done.values++;
    done.full_bytes += static_cast<int64_t>(x->nbytes());
  }
  return done;
}

}  // namespace kiln::memory
