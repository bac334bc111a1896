// Gradient rule of every primitive, as lazy graph ops. The table is checked at compile time to
// cover the whole op list in core/op.h.
#include <cmath>
#include <numeric>

#include "core/autograd.h"
#include "ops/ops.h"
#include "ops/primitive.h"

namespace kiln {

namespace {
using Grads = std::vector<Tensor>;

Tensor in(const NodePtr& n, size_t i) { return Tensor(n->inputs[i]); }
Tensor out(const NodePtr& n) { return Tensor(n); }
Tensor like(double v, const Tensor& t) { return scalar(v, t.dtype()); }

Grads none(const NodePtr&, const Tensor&) { return {}; }
Grads no_grad_inputs(const NodePtr& n, const Tensor&) { return Grads(n->inputs.size()); }

Grads neg_grad(const NodePtr&, const Tensor& g) { return {-g}; }
Grads exp_grad(const NodePtr& n, const Tensor& g) { return {g * out(n)}; }
Grads log_grad(const NodePtr& n, const Tensor& g) { return {g / in(n, 0)}; }
Grads sqrt_grad(const NodePtr& n, const Tensor& g) { return {g * 0.5 / out(n)}; }
Grads rsqrt_grad(const NodePtr& n, const Tensor& g) {
  Tensor y = out(n);
  return {g * -0.5 * y * y * y};
}
Grads sin_grad(const NodePtr& n, const Tensor& g) { return {g * cos(in(n, 0))}; }
Grads cos_grad(const NodePtr& n, const Tensor& g) { return {-g * sin(in(n, 0))}; }
Grads tanh_grad(const NodePtr& n, const Tensor& g) {
  Tensor y = out(n);
  return {g * (1.0 - y * y)};
}
Grads erf_grad(const NodePtr& n, const Tensor& g) {
  Tensor x = in(n, 0);
  return {g * (2.0 / std::sqrt(M_PI)) * exp(-(x * x))};
}
Grads abs_grad(const NodePtr& n, const Tensor& g) { return {g * sign(in(n, 0))}; }
Grads reciprocal_grad(const NodePtr& n, const Tensor& g) {
  Tensor y = out(n);
  return {-g * y * y};
}
Grads cast_grad(const NodePtr& n, const Tensor& g) {
  Tensor x = in(n, 0);
  if (!is_floating(x.dtype())) return {Tensor()};
  return {cast(g, x.dtype())};
}

Grads add_grad(const NodePtr&, const Tensor& g) { return {g, g}; }
Grads sub_grad(const NodePtr&, const Tensor& g) { return {g, -g}; }
Grads mul_grad(const NodePtr& n, const Tensor& g) { return {g * in(n, 1), g * in(n, 0)}; }
Grads div_grad(const NodePtr& n, const Tensor& g) {
  Tensor b = in(n, 1);
  return {g / b, -g * out(n) / b};
}
Grads pow_grad(const NodePtr& n, const Tensor& g) {
  Tensor a = in(n, 0), b = in(n, 1), y = out(n);
  Tensor da = g * b * pow(a, b - 1.0);
  // d/db a^b = a^b log a; defined as 0 where a == 0 (the limit used by PyTorch).
  Tensor safe_log = log(where(a > like(0.0, a), a, ones_like(a)));
  Tensor db = g * y * safe_log;
  return {da, db};
}
// Ties split the gradient evenly between both operands, as in PyTorch.
Grads max_min_grad(const NodePtr& n, const Tensor& g, bool is_max) {
  Tensor a = in(n, 0), b = in(n, 1);
  const Node& bn = *n->inputs[1];
  // The constant is a Full of the result's shape when recorded lazily; eager mode realizes the
  // Full first and broadcasts it through a reshape and an expand (the same rule applies, or eager
  // relu would split ties).
  const Node* source = prim::constant_source(bn);
  if (source->op == Op::Full && !bn.requires_grad) {
    // Against a constant (relu, clamp): a wins exactly where the result differs from the
    // constant, so the backward reads the result, which the next layer keeps anyway, instead of
    // keeping the input alive too. Ties get 0, as PyTorch's relu gives.
    Tensor y = out(n);
    return {g * cast(is_max ? gt(y, b) : lt(y, b), g.dtype()), Tensor()};
  }
  Tensor wins = cast(is_max ? gt(a, b) : lt(a, b), g.dtype());
  Tensor ties = cast(eq(a, b), g.dtype());
  Tensor share = wins + ties * 0.5;
  return {g * share, g * (1.0 - share)};
}
Grads max_grad(const NodePtr& n, const Tensor& g) { return max_min_grad(n, g, true); }
Grads min_grad(const NodePtr& n, const Tensor& g) { return max_min_grad(n, g, false); }

Grads where_grad(const NodePtr& n, const Tensor& g) {
  Tensor c = in(n, 0), z = zeros_like(g);
  return {Tensor(), where(c, g, z), where(c, z, g)};
}

Grads reshape_grad(const NodePtr& n, const Tensor& g) {
  // A reshape with an attribute is prim::all_reduce_gradient's identity.
  if (!n->ints.empty()) {
    // MPI has no half types: their sums run in float32, as distributed::all_reduce does.
    const int64_t world = n->ints[0], group = n->ints[1];
    if (g.dtype() != DType::Float16 && g.dtype() != DType::BFloat16) return {prim::all_reduce(g, 0, world, false, group)};
    return {prim::cast(prim::all_reduce(prim::cast(g, DType::Float32), 0, world, false, group), g.dtype())};
  }
  return {prim::reshape(g, n->inputs[0]->shape)};
}
Grads permute_grad(const NodePtr& n, const Tensor& g) {
  std::vector<int64_t> inverse(n->ints.size());
  for (size_t i = 0; i < n->ints.size(); ++i) inverse[n->ints[i]] = static_cast<int64_t>(i);
  return {prim::permute(g, inverse)};
}
Grads expand_grad(const NodePtr& n, const Tensor& g) {
  std::vector<int64_t> axes;
  const Shape& src = n->inputs[0]->shape;
  for (size_t i = 0; i < src.size(); ++i)
    if (src[i] != n->shape[i]) axes.push_back(static_cast<int64_t>(i));
  return {prim::reduce(Op::ReduceSum, g, axes)};
}
Grads slice_grad(const NodePtr& n, const Tensor& g) {
  const Shape& src = n->inputs[0]->shape;
  size_t rank = src.size();
  Tensor r = g;
  for (size_t ax = 0; ax < rank; ++ax) {
    int64_t start = n->ints[ax], step = n->ints[rank + ax], count = n->shape[ax];
    if (step > 1 && count > 0) {
      // Spread the picked elements `step` apart: append step-1 zeros after each, then merge.
      Shape s = r.shape();
      Shape spread = s;
      spread.insert(spread.begin() + ax + 1, 1);
      std::vector<int64_t> before(rank + 1, 0), after(rank + 1, 0);
      after[ax + 1] = step - 1;
      r = prim::pad(prim::reshape(r, spread), before, after);
      s[ax] = count * step;
      r = prim::reshape(r, s);
      count *= step;
    }
    int64_t tail = src[ax] - start - count;
    if (tail < 0) {  // the spread overshoots the end: drop the trailing zeros
      std::vector<int64_t> starts(rank, 0), steps(rank, 1);
      Shape s = r.shape();
      s[ax] += tail;
      r = prim::slice(r, starts, steps, s);
      tail = 0;
    }
    if (start > 0 || tail > 0) {
      std::vector<int64_t> before(rank, 0), after(rank, 0);
      before[ax] = start;
      after[ax] = tail;
      r = prim::pad(r, before, after);
    }
  }
  return {r};
}
Grads pad_grad(const NodePtr& n, const Tensor& g) {
  const Shape& src = n->inputs[0]->shape;
  std::vector<int64_t> starts(src.size()), steps(src.size(), 1);
  for (size_t i = 0; i < src.size(); ++i) starts[i] = n->ints[i];
  return {prim::slice(g, starts, steps, src)};
}

Grads sum_grad(const NodePtr& n, const Tensor& g) { return {prim::expand(g, n->inputs[0]->shape)}; }
Grads reduce_max_grad(const NodePtr& n, const Tensor& g) {
  Tensor x = in(n, 0);
  const Shape& s = x.shape();
  Tensor mask = cast(eq(x, prim::expand(out(n), s)), g.dtype());
  Tensor count = prim::reduce(Op::ReduceSum, mask, n->ints);
  return {mask * prim::expand(g / count, s)};
}

Grads gather_grad(const NodePtr& n, const Tensor& g) {
  Tensor index = in(n, 1);
  return {prim::scatter_add(n->inputs[0]->shape, n->ints[0], index, g), Tensor()};
}
Grads scatter_add_grad(const NodePtr& n, const Tensor& g) {
  Tensor index = in(n, 0);
  return {Tensor(), prim::gather(g, n->ints[0], index)};
}

// The window element at each offset: the gradient goes back to it, zeros to the rest of the
// window, from a host kernel like the gather's (a scatter_add over the (N, C, OH, kh * W) view, as
// max_pool2d's general path runs it, gives the same bits but runs as scalar code).
Grads max_pool_gather_grad(const NodePtr& n, const Tensor& g) {
  return {prim::max_pool_scatter(g, in(n, 1), n->ints[0], n->ints[1]), Tensor()};
}

Grads max_pool_scatter_grad(const NodePtr& n, const Tensor& g) {
  return {prim::max_pool_gather(g, in(n, 1), n->ints[0], n->ints[1]), Tensor()};
}

Grads matmul_grad(const NodePtr& n, const Tensor& g) {
  Tensor a = in(n, 0), b = in(n, 1);
  // dA = dC @ B^T, dB = A^T @ dC; a stride-0 (broadcast) batch sums in the Expand rule.
  Tensor db;
  const Node& bn = *n->inputs[1];
  if (bn.op == Op::Permute && !bn.realized() && bn.ints == std::vector<int64_t>{0, 2, 1}) {
    // B is a transposed view (x @ W^T in Linear): compute dB^T = dC^T @ A, so that the
    // Permute rule's transpose cancels this one and W's gradient is stored in W's layout.
    db = prim::permute(prim::matmul(prim::permute(g, {0, 2, 1}), a), {0, 2, 1});
  } else {
    db = prim::matmul(prim::permute(a, {0, 2, 1}), g);
  }
  return {prim::matmul(g, prim::permute(b, {0, 2, 1})), db};
}

// conv's adjoints are bilinear too, so each gradient is one of the three passes again.
Grads conv2d_grad(const NodePtr& n, const Tensor& g) {
  Tensor x = in(n, 0), w = in(n, 1);
  return {prim::conv2d_backward_data(g, w, x.shape(), n->ints), prim::conv2d_backward_weight(x, g, w.shape(), n->ints)};
}
Grads conv2d_backward_data_grad(const NodePtr& n, const Tensor& g) {
  Tensor gy = in(n, 0), w = in(n, 1);
  return {prim::conv2d(g, w, n->ints), prim::conv2d_backward_weight(g, gy, w.shape(), n->ints)};
}
Grads conv2d_backward_weight_grad(const NodePtr& n, const Tensor& g) {
  Tensor x = in(n, 0), gy = in(n, 1);
  return {prim::conv2d_backward_data(gy, g, x.shape(), n->ints), prim::conv2d(x, g, n->ints)};
}
// Every rank's sum reads every rank's input: each input's gradient is the sum of all ranks'
// output gradients. A maximum's would need to know which rank won; it has none yet.
Grads all_reduce_grad(const NodePtr& n, const Tensor& g) {
  KILN_CHECK(n->ints[0] == 0, "all_reduce", "only a sum (or mean) all-reduce has a gradient; got a maximum");
  if (n->ints[2] == 1) return {g};  // replicated: every rank's loss is the same function of the sum
  Tensor all = prim::all_reduce(g, 0, n->ints[1], false, n->ints[3]);
  if (n->inputs.size() == 1) return {all};
  Grads parts;  // a bucket's: each part's slice of the flat result
  int64_t at = 0;
  for (const NodePtr& in : n->inputs) {
    const int64_t size = in->numel();
    parts.push_back(prim::reshape(prim::slice(all, {at}, {1}, {size}), in->shape));
    at += size;
  }
  return parts;
}

Grads quantized_matmul_grad(const NodePtr&, const Tensor&) {
  KILN_FAIL("QuantizedLinear",
            "int8 layers are for inference and have no gradient (rounding has none); run them under NoGradGuard, "
            "or train the float model and quantize it afterwards (nn::quantize_dynamic)");
}

// The output gradient is the first region of the packed gradient (the log-sum-exp region only
// feeds the backward); the backward kernel's regions are dq, dk and dv.
Grads attention_grad(const NodePtr& n, const Tensor& g) {
  const prim::AttentionShape s = prim::attention_shape(*n);
  const Tensor dout = prim::attention_output(g, n->inputs[0]->shape, s.Dv);
  const Tensor grads = prim::attention_backward(out(n), dout);
  // Each gradient in its input's type (bfloat16 q, k, v get bfloat16 gradients).
  auto region = [&](size_t input, int64_t start, int64_t T, int64_t d) {
    const Tensor flat = prim::slice(grads, {start}, {1}, {s.B * T * s.H * d});
    const Tensor g = prim::permute(prim::reshape(flat, {s.B, T, s.H, d}), {0, 2, 1, 3});
    const DType t = n->inputs[input]->dtype;
    return g.dtype() == t ? g : prim::cast(g, t);
  };
  return {region(0, 0, s.Tq, s.D), region(1, s.dq_elements(), s.Tk, s.D),
          region(2, s.dq_elements() + s.dk_elements(), s.Tk, s.Dv)};
}
Grads attention_backward_grad(const NodePtr&, const Tensor&) {
  KILN_FAIL("attention", "the fused attention's backward has no gradient of its own (no double backward)");
}

struct GradEntry {
  Op op;
  GradRule rule;
};
constexpr GradEntry kGradRules[] = {
    {Op::Input, none}, {Op::Full, none}, {Op::Iota, none}, {Op::RandUniform, none}, {Op::RandNormal, none},
    {Op::Neg, neg_grad}, {Op::Exp, exp_grad}, {Op::Log, log_grad}, {Op::Sqrt, sqrt_grad},
    {Op::Rsqrt, rsqrt_grad}, {Op::Sin, sin_grad}, {Op::Cos, cos_grad}, {Op::Tanh, tanh_grad},
    {Op::Erf, erf_grad}, {Op::Abs, abs_grad}, {Op::Reciprocal, reciprocal_grad}, {Op::Sign, no_grad_inputs},
    {Op::Floor, no_grad_inputs}, {Op::Not, no_grad_inputs}, {Op::Cast, cast_grad},
    {Op::Add, add_grad}, {Op::Sub, sub_grad}, {Op::Mul, mul_grad}, {Op::Div, div_grad}, {Op::Pow, pow_grad},
    {Op::Max, max_grad}, {Op::Min, min_grad}, {Op::Lt, no_grad_inputs}, {Op::Le, no_grad_inputs},
    {Op::Gt, no_grad_inputs}, {Op::Ge, no_grad_inputs}, {Op::Eq, no_grad_inputs}, {Op::Ne, no_grad_inputs},
    {Op::And, no_grad_inputs}, {Op::Or, no_grad_inputs},
    {Op::Where, where_grad},
    {Op::Reshape, reshape_grad}, {Op::Permute, permute_grad}, {Op::Expand, expand_grad}, {Op::Slice, slice_grad},
    {Op::Pad, pad_grad},
    {Op::ReduceSum, sum_grad}, {Op::ReduceMax, reduce_max_grad},
    {Op::Gather, gather_grad}, {Op::ScatterAdd, scatter_add_grad},
    {Op::Matmul, matmul_grad}, {Op::Conv2d, conv2d_grad}, {Op::Conv2dBackwardData, conv2d_backward_data_grad},
    {Op::Conv2dBackwardWeight, conv2d_backward_weight_grad}, {Op::MaxPoolOffsets, no_grad_inputs},
    {Op::MaxPoolGather, max_pool_gather_grad}, {Op::MaxPoolScatter, max_pool_scatter_grad},
    {Op::AllReduce, all_reduce_grad},
    {Op::Send, no_grad_inputs}, {Op::Recv, no_grad_inputs}, {Op::QuantizedMatmul, quantized_matmul_grad},
    {Op::Attention, attention_grad}, {Op::AttentionBackward, attention_backward_grad},
};

constexpr bool covers_every_op() {
  if (std::size(kGradRules) != static_cast<size_t>(kNumOps)) return false;
  for (size_t i = 0; i < std::size(kGradRules); ++i)
    if (static_cast<size_t>(kGradRules[i].op) != i) return false;
  return true;
}
static_assert(covers_every_op(), "every primitive in core/op.h needs a grad rule here, in enum order");
}  // namespace

GradRule grad_rule(Op op) { return kGradRules[static_cast<int>(op)].rule; }

}  // namespace kiln
