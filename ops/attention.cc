// The fused attention primitives (prim::attention, prim::attention_backward) and the public
// kiln::fused_attention over them.
#include <bit>
#include <cmath>

#include "core/autograd.h"
#include "ops/ops.h"
#include "ops/primitive.h"

namespace kiln::prim {

namespace {

std::vector<int64_t> attention_ints(bool causal, double scale) {
  return {causal ? 1 : 0, std::bit_cast<int64_t>(scale)};
}

}  // namespace

AttentionShape attention_shape(const Node& node) {
  KILN_CHECK(node.op == Op::Attention || node.op == Op::AttentionBackward, "attention", "{} is not an attention node",
             op_name(node.op));
  const Shape& q = node.inputs[0]->shape;
  const Shape& k = node.inputs[1]->shape;
  const Shape& v = node.inputs[2]->shape;
  return {q[0], q[1], q[2], k[2], q[3], v[3], node.ints[0] != 0, std::bit_cast<double>(node.ints[1])};
}

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
  KILN_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.shape() == Shape({q.size(0), q.size(1), k.size(2), q.size(3)}) &&
                 v.shape() == Shape({q.size(0), q.size(1), k.size(2), v.size(3)}),
             "attention", "needs q (B, H, Tq, D), k (B, H, Tk, D) and v (B, H, Tk, Dv); got {}, {} and {}", q.str(),
             k.str(), v.str());
  KILN_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype() &&
                 (q.dtype() == DType::Float32 || q.dtype() == DType::Float64 || q.dtype() == DType::BFloat16),
             "attention", "fused attention reads float32, float64 or bfloat16 (all three alike); got {}, {} and {} "
             "(cast them first)", q.str(), k.str(), v.str());
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), Dv = v.size(3);
  // bfloat16 operands are computed in float32, and the output and its statistics stay float32.
  const DType t = q.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
  return make(Op::Attention, t, {B * Tq * H * Dv + B * H * Tq}, {q, k, v}, attention_ints(causal, scale));
}

Tensor attention_output(const Tensor& packed, const Shape& q_shape, int64_t dv) {
  const int64_t B = q_shape[0], H = q_shape[1], Tq = q_shape[2];
  const Tensor out = prim::slice(packed, {0}, {1}, {B * Tq * H * dv});
  return prim::permute(prim::reshape(out, Shape{B, Tq, H, dv}), {0, 2, 1, 3});
}

Tensor attention_backward(const Tensor& packed, const Tensor& dout) {
  KILN_CHECK(packed.node()->op == Op::Attention, "attention", "attention_backward needs an attention node, got {}",
             op_name(packed.node()->op));
  const AttentionShape s = attention_shape(*packed.node());
  KILN_CHECK(dout.shape() == Shape({s.B, s.H, s.Tq, s.Dv}) && dout.dtype() == packed.dtype(), "attention",
             "output gradient {} does not match the output ({}, {}, {}, {}) {}", dout.str(), s.B, s.H, s.Tq, s.Dv,
             dtype_name(packed.dtype()));
  const NodePtr& n = packed.node();
  return make(Op::AttentionBackward, packed.dtype(), {s.dq_elements() + s.dk_elements() + s.dv_elements()},
              {Tensor(n->inputs[0]), Tensor(n->inputs[1]), Tensor(n->inputs[2]), packed, dout}, n->ints);
}

}  // namespace kiln::prim

namespace kiln {

Tensor fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
  KILN_CHECK(is_floating(q.dtype()) && is_floating(k.dtype()) && is_floating(v.dtype()), "fused_attention",
             "needs floating q, k and v; got {}, {} and {}", q.str(), k.str(), v.str());
  // Read as they are when all three are float64, float32 or bfloat16 (autocast's projections);
  // other mixes are cast to float32 (or float64) first.
  const bool alike = q.dtype() == k.dtype() && q.dtype() == v.dtype() &&
                     (q.dtype() == DType::Float32 || q.dtype() == DType::Float64 || q.dtype() == DType::BFloat16);
  const DType t = alike ? q.dtype()
                  : q.dtype() == DType::Float64 && k.dtype() == DType::Float64 && v.dtype() == DType::Float64
                      ? DType::Float64
                      : DType::Float32;
  const Tensor packed = prim::attention(q.cast(t), k.cast(t), v.cast(t), causal, scale);
  return prim::attention_output(packed, q.shape(), v.size(3));
}

}  // namespace kiln
