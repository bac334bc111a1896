#include "memory/compress.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
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
      n->recompute = !forward;  // read back as late as the backward can: one float copy at a time
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

// Finite values take the codes -126..126 (q * s); the other three codes keep what is not
// finite exactly: attention scores masked with -inf are ordinary saved values.
constexpr double kLargestCode = 126, kPlusInf = 127, kMinusInf = -127, kNaN = -128;

// x as int8 with one scale per group: {q, s}.
std::pair<Tensor, Tensor> quantize(const Tensor& x, DType compute) {
  Tensor xc = prim::cast(x, compute);
  std::vector<int64_t> axes;
  for (size_t k = group_axis(x.shape()); k < x.shape().size(); ++k) axes.push_back(static_cast<int64_t>(k));
  const double inf = std::numeric_limits<double>::infinity();
  Tensor magnitude_x = prim::unary(Op::Abs, xc);
  Tensor finite = prim::binary(Op::Lt, magnitude_x, constant(xc, inf));  // false for inf and NaN
  Tensor amax = prim::reduce(Op::ReduceMax, prim::where(finite, magnitude_x, constant(xc, 0.0)), axes);
  // The floor keeps an all-zero group from dividing by zero.
  Tensor s = prim::binary(Op::Max, prim::binary(Op::Mul, amax, constant(amax, 1.0 / kLargestCode)), constant(amax, 1e-30));
  Tensor v = prim::binary(Op::Div, xc, prim::expand(s, x.shape()));
  // Rounded to nearest, but at least 1 away from 0 unless x is 0: the sign survives.
  Tensor magnitude = prim::unary(Op::Floor, prim::binary(Op::Add, prim::unary(Op::Abs, v), constant(v, 0.5)));
  Tensor r = prim::binary(Op::Mul, prim::unary(Op::Sign, v), prim::binary(Op::Max, magnitude, constant(v, 1.0)));
  Tensor special = prim::where(prim::binary(Op::Gt, xc, constant(xc, 0.0)), constant(xc, kPlusInf),
                               prim::where(prim::binary(Op::Lt, xc, constant(xc, 0.0)), constant(xc, kMinusInf),
                                           constant(xc, kNaN)));
  return {prim::cast(prim::where(finite, r, special), DType::Int8), s};
}

Tensor dequantize(const Tensor& q, const Tensor& s, DType dtype) {
  Tensor code = prim::cast(q, s.dtype());
  auto is = [&](double c) { return prim::binary(Op::Eq, code, constant(code, c)); };
  const double inf = std::numeric_limits<double>::infinity();
  Tensor v = prim::binary(Op::Mul, code, prim::expand(s, q.shape()));
  v = prim::where(is(kPlusInf), constant(v, inf),
                  prim::where(is(kMinusInf), constant(v, -inf),
                              prim::where(is(kNaN), constant(v, std::numeric_limits<double>::quiet_NaN()), v)));
  return prim::cast(v, dtype);
}

// Masks are packed along the first axis whose extent 8 divides, split as (8, extent / 8): bit j
// of a byte comes from the j-th eighth of that axis. Backward kernels loop over the mask's shape,
// so the byte an element is in and its bit are affine in the inner loops (a leading axis is
// best: the bit changes only with the outer loop). -1: no axis fits.
int mask_axis(const Shape& shape) {
  for (size_t a = 0; a < shape.size(); ++a)
    if (shape[a] % 8 == 0) return static_cast<int>(a);
  return -1;
}

// `shape` with axis a split into (8, shape[a] / 8).
Shape split_for_bits(const Shape& shape, int a) {
  Shape split(shape.begin(), shape.begin() + a);
  split.push_back(8);
  split.push_back(shape[a] / 8);
  split.insert(split.end(), shape.begin() + a + 1, shape.end());
  return split;
}

// 2^(sign * j) along axis a of `shape` (extent 8), j the index there: a chain of selects, cheaper
// per element than pow.
Tensor powers_of_two(const Shape& shape, int a, double sign, Device device) {
  Tensor j = prim::iota(shape, a, DType::Float32);
  Tensor w = prim::full(shape, 1.0, DType::Float32);
  for (int k = 1; k < 8; ++k)
    w = prim::where(prim::binary(Op::Eq, j, constant(j, k)), constant(w, std::ldexp(1.0, static_cast<int>(sign) * k)), w);
  return prim::follow(w, device);
}

// A bool tensor as bits, 8 to a byte, along axis a (mask_axis).
Tensor pack_bits(const Tensor& mask, int a) {
  const Shape split = split_for_bits(mask.shape(), a);
  Shape packed = mask.shape();
  packed[a] /= 8;
  Tensor weighted = prim::binary(Op::Mul, prim::reshape(prim::cast(mask, DType::Float32), split),
                                 powers_of_two(split, a, 1, mask.device()));
  return prim::cast(prim::reshape(prim::reduce(Op::ReduceSum, weighted, {a}), packed), DType::UInt8);
}

// The bits back as a bool tensor of `shape`; `inverse_weights` is powers_of_two(..., -1) over the
// split shape with extent 1 on every axis but a.
Tensor unpack_bits(const Tensor& bits, const Shape& shape, int a, const Tensor& inverse_weights) {
  const Shape split = split_for_bits(shape, a);
  Shape one = split;
  one[a] = 1;
  Tensor bytes = prim::expand(prim::reshape(prim::cast(bits, DType::Float32), one), split);
  Tensor shifted = prim::unary(Op::Floor, prim::binary(Op::Mul, bytes, prim::expand(inverse_weights, split)));
  Tensor half = prim::unary(Op::Floor, prim::binary(Op::Mul, shifted, constant(shifted, 0.5)));
  Tensor bit = prim::binary(Op::Sub, shifted, prim::binary(Op::Mul, half, constant(half, 2.0)));
  return prim::reshape(prim::binary(Op::Gt, bit, constant(bit, 0.5)), shape);
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
    // A view is not a use; what reads it is, through it. (A backward view of x is made again over
    // the reading, where it is read, so nothing is rewired twice.)
    if (op_kind(consumer->op) == OpKind::Movement) continue;
    const bool backward = (consumer->backward || consumer->recompute) && !consumer->saved_copy;
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
    // A comparison of two saved values (a max's backward: x == max x) must see both exactly.
    const bool compared_with_value = std::any_of(reads[p].begin(), reads[p].end(), [&](const Read& read) {
      return is_comparison(read.consumer->op) && read.consumer->inputs[1 - read.slot]->op != Op::Full;
    });
    candidate[p] = !compared_with_value && index.base[p] == static_cast<int>(p) && x.compress && !x.saved_copy &&
                   !x.backward &&
                   !x.recompute && x.held == 0 && is_floating(x.dtype) && !weight_copy && group_axis(x.shape) > 0 &&
                   forward_use[p] && !recomputed[p] && !reads[p].empty();
  }
  for (size_t p = 0; p < nodes.size(); ++p) {
    if (!candidate[p]) continue;
    const NodePtr& x = nodes[p];
    Tensor value(x);
    Recording recording;
    const int axis = mask_axis(x->shape);
    bool masks_only = axis >= 0;  // else int8, whose signs keep such masks exact too
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
        Tensor bits = pack_bits(taken, axis);
        recording.mark(bits, true, x->label);
        done.kept_bytes += static_cast<int64_t>(bits.node()->nbytes());
        // The 8 weights are stored (with the forward, 32 bytes): computed inline, the select chain
        // would make the backward store a float per mask element instead.
        Shape eight(x->shape.size() + 1, 1);
        eight[axis] = 8;
        Tensor inverse_weights = powers_of_two(eight, axis, -1, x->device);
        Tensor mask = unpack_bits(bits, x->shape, axis, inverse_weights);
        recording.mark(inverse_weights, true, x->label);  // first: the reading's marks skip it
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
        // Read as late as the rest of the reading (recompute, as mark() sets it).
        NodePtr copy = recompute_copy(view, {remade(index.of(view.inputs[0].get()))});
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
