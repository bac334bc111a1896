// matmul of the user API: NumPy's broadcasting batched product, lowered to one (B, M, K) @ (B, K, N)
// primitive that runs as a library call (ops/library.h), or to a multiply-reduce where no library
// takes the dtype.
#include "ops/autocast.h"
#include "ops/library.h"
#include "ops/ops.h"
#include "ops/primitive.h"

namespace kiln {

Tensor matmul(const Tensor& a_raw, const Tensor& b_raw) {
  AutocastScope amp("matmul");
  const Tensor a_in = amp(a_raw), b_in = amp(b_raw);
  KILN_CHECK(a_in.dim() >= 1 && b_in.dim() >= 1, "matmul", "operands must have at least one dim: {} @ {}",
             shape_str(a_in.shape()), shape_str(b_in.shape()));
  DType t = promote(a_in.dtype(), b_in.dtype());
  if (!is_floating(t)) t = DType::Float32;
  if ((t == DType::Float16 || t == DType::BFloat16) && !library_matmul(a_in.device(), t) &&
      library_matmul(a_in.device(), DType::Float32)) {
    // No float16 (or bfloat16: a CPU without AVX-512) library product here: the float32 product of
    // the widened operands, rounded once. Correct (closer than half accumulation), not faster.
    return cast(matmul(cast(a_in, DType::Float32), cast(b_in, DType::Float32)), t);
  }
  Tensor a = cast(a_in.dim() == 1 ? unsqueeze(a_in, 0) : a_in, t);
  Tensor b = cast(b_in.dim() == 1 ? unsqueeze(b_in, -1) : b_in, t);
  int64_t M = a.shape()[a.dim() - 2], K = a.shape()[a.dim() - 1];
  int64_t K2 = b.shape()[b.dim() - 2], N = b.shape()[b.dim() - 1];
  KILN_CHECK(K == K2, "matmul", "inner dimensions differ: {} @ {} ({} vs {}); transpose one operand or fix the shapes",
             shape_str(a_in.shape()), shape_str(b_in.shape()), K, K2);
  Shape a_batch(a.shape().begin(), a.shape().end() - 2), b_batch(b.shape().begin(), b.shape().end() - 2);
  Shape batch = broadcast_shapes(a_batch, b_batch, "matmul");
  int64_t B = numel(batch);
  Shape out_shape = batch;
  out_shape.push_back(M);
  out_shape.push_back(N);

  Tensor out;
  if (!library_matmul(a.device(), t)) {
    // No library kernel for this dtype here (float64, float16 on the CPU): a fused multiply-reduce.
    Shape full_a = batch, full_b = batch;
    full_a.insert(full_a.end(), {M, K, 1});
    full_b.insert(full_b.end(), {1, K, N});
    Tensor prod = broadcast_to(unsqueeze(a, -1), full_a) * broadcast_to(unsqueeze(b, -3), full_b);
    out = sum(prod, {-2});
  } else if (b_batch.empty() || numel(b_batch) == 1) {
    // (..., M, K) @ (K, N): fold a's batch into rows, one 2-d product.
    Tensor a2 = reshape(broadcast_to(a, [&] { Shape s = batch; s.push_back(M); s.push_back(K); return s; }()),
                        {1, B * M, K});
    // A transposed 2-d b (x @ W^T) stays a transpose on the outside, which the matmul's grad rule
    // uses to give W's gradient in W's layout.
    bool transposed = b.dim() == 2 && b.node()->op == Op::Permute && !b.node()->realized();
    Tensor b3 = transposed ? prim::permute(reshape(prim::permute(b, {1, 0}), {1, N, K}), {0, 2, 1}) : reshape(b, {1, K, N});
    out = prim::matmul(a2, b3);
  } else {
    auto to3 = [&](const Tensor& x, const Shape& xb, int64_t r, int64_t c) {
      if (numel(xb) == 1) return expand(reshape(x, {1, r, c}), {B, r, c});  // stride-0 batch
      Shape s = batch;
      s.push_back(r);
      s.push_back(c);
      return reshape(broadcast_to(x, s), {B, r, c});
    };
    out = prim::matmul(to3(a, a_batch, M, K), to3(b, b_batch, K, N));
  }
  out = reshape(out, out_shape);
  if (a_in.dim() == 1) out = squeeze(out, -2);
  if (b_in.dim() == 1) out = squeeze(out, -1);
  return out;
}

Tensor linear(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias_in) {
  AutocastScope amp("linear");
  // The weight is cast before it is transposed, so that autocast's copy is the parameter's own.
  const Tensor x = amp(x_in), weight = amp(weight_in), bias = amp(bias_in);
  KILN_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.shape().back() == weight.size(1), "linear",
             "input {} does not end in the weight's in_features: weight is {} (out_features, in_features)",
             shape_str(x.shape()), shape_str(weight.shape()));
  Tensor y = matmul(x, weight.t());  // (..., out)
  return bias.defined() ? y + bias : y;
}

}  // namespace kiln
