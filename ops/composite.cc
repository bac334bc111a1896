// Composite ops: built only from primitives, so the JIT fuses them and autograd derives them.
#include <cmath>

#include "core/autograd.h"
#include "ops/autocast.h"
#include "ops/ops.h"

namespace kiln {

Tensor relu(const Tensor& x) { return maximum(x, scalar_like(0.0, x)); }

Tensor masked_fill(const Tensor& a, const Tensor& mask, double value) {
  KILN_CHECK(mask.dtype() == DType::Bool, "masked_fill", "the mask must be bool, got {} (filling {})", mask.str(),
             a.str());
  KILN_CHECK(broadcast_shapes(mask.shape(), a.shape(), "masked_fill") == a.shape(), "masked_fill",
             "the mask {} does not broadcast to the filled tensor's shape {}", shape_str(mask.shape()),
             shape_str(a.shape()));
  return where(mask, scalar(value, a.dtype()), a);  // value in a's dtype, as PyTorch
}

namespace {
// Where j - i <= diagonal (lower) or >= diagonal (upper) over the last two dims of a.
Tensor triangle(const Tensor& a, int64_t diagonal, bool lower, const char* name) {
  KILN_CHECK(a.dim() >= 2, name, "needs at least 2 dims, got {}", a.str());
  const Shape square{a.size(-2), a.size(-1)};
  const Tensor offset = iota(square, 1, DType::Int64) - iota(square, 0, DType::Int64);  // j - i
  const Tensor k = scalar(static_cast<double>(diagonal), DType::Int64);
  return where(lower ? le(offset, k) : ge(offset, k), a, zeros_like(a));
}
}  // namespace

Tensor tril(const Tensor& a, int64_t diagonal) { return triangle(a, diagonal, true, "tril"); }
Tensor triu(const Tensor& a, int64_t diagonal) { return triangle(a, diagonal, false, "triu"); }

namespace {
// A float16 / bfloat16 input of an elementwise composite is computed in float32 and rounded once
// at the end, as PyTorch's kernels do: rounding every inner op would cost accuracy and make the
// fused kernel compute-bound on conversions. (The gradient is rounded once too.)
bool in_float32(const Tensor& x) { return x.dtype() == DType::BFloat16 || x.dtype() == DType::Float16; }
}  // namespace

Tensor gelu(const Tensor& x, bool tanh_approximation) {
  AutocastScope amp("gelu");
  if (in_float32(x)) return gelu(x.cast(DType::Float32), tanh_approximation).cast(x.dtype());
  if (tanh_approximation) {
    const double k = std::sqrt(2.0 / M_PI);
    return 0.5 * x * (1.0 + tanh(k * (x + 0.044715 * x * x * x)));
  }
  return 0.5 * x * (1.0 + erf(x * M_SQRT1_2));
}

Tensor sigmoid(const Tensor& x) {
  AutocastScope amp("sigmoid");
  if (in_float32(x)) return sigmoid(x.cast(DType::Float32)).cast(x.dtype());
  return reciprocal(1.0 + exp(-x));
}
Tensor silu(const Tensor& x) {
  AutocastScope amp("silu");
  if (in_float32(x)) return silu(x.cast(DType::Float32)).cast(x.dtype());
  return x * sigmoid(x);
}

Tensor softmax(const Tensor& x_in, int64_t axis) {
  AutocastScope amp("softmax");
  const Tensor x = amp(x_in);
  axis = normalize_axis(axis, x.dim(), "softmax");  // so a bad axis names softmax, not max
  // The max is a constant shift (softmax does not change with it): no gradient flows through
  // it, as in PyTorch's softmax backward, which reads only the output.
  Tensor e = exp(x - max(x, {axis}, true).detach());
  return e / sum(e, {axis}, true);
}

Tensor log_softmax(const Tensor& x_in, int64_t axis) {
  AutocastScope amp("log_softmax");
  const Tensor x = amp(x_in);
  axis = normalize_axis(axis, x.dim(), "log_softmax");
  Tensor shifted = x - max(x, {axis}, true).detach();  // a constant shift, as in softmax
  return shifted - log(sum(exp(shifted), {axis}, true));
}

Tensor logsumexp(const Tensor& x_in, std::vector<int64_t> axes, bool keepdim) {
  AutocastScope amp("logsumexp");
  const Tensor x = amp(x_in);
  if (x.dim() > 0)  // (a 0-d input's axes are checked by the reductions)
    for (int64_t& axis : axes) axis = normalize_axis(axis, x.dim(), "logsumexp");
  // The max is a constant shift: no gradient needs to flow through it.
  Tensor m = max(x, axes, true).detach();
  // An infinite max (e.g. a slice of all -inf) would give inf - inf = NaN: shift by 0 there.
  m = where(eq(abs(m), scalar_like(INFINITY, m)), zeros_like(m), m);
  Tensor r = log(sum(exp(x - m), axes, true)) + m;
  if (keepdim) return r;
  return sum(r, axes, false);  // summing size-1 axes drops them
}

Tensor layer_norm(const Tensor& x_in, Shape normalized_shape, const Tensor& weight_in, const Tensor& bias_in,
                  double eps) {
  AutocastScope amp("layer_norm");
  const Tensor x = amp(x_in), weight = amp(weight_in), bias = amp(bias_in);
  size_t k = normalized_shape.size();
  KILN_CHECK(k >= 1 && k <= x.dim() && Shape(x.shape().end() - k, x.shape().end()) == normalized_shape, "layer_norm",
             "normalized shape {} must match the trailing dims of input {}", shape_str(normalized_shape),
             shape_str(x.shape()));
  std::vector<int64_t> axes;
  for (size_t i = x.dim() - k; i < x.dim(); ++i) axes.push_back(static_cast<int64_t>(i));
  Tensor mu = mean(x, axes, true);
  Tensor centered = x - mu;
  Tensor variance = mean(centered * centered, axes, true);
  Tensor y = centered * rsqrt(variance + eps);
  if (weight.defined()) y = y * weight;
  if (bias.defined()) y = y + bias;
  return y;
}

Tensor batch_norm(const Tensor& x_in, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum, double eps) {
  AutocastScope amp("batch_norm");
  const Tensor x = amp(x_in);
  KILN_CHECK(x.dim() >= 2, "batch_norm", "input {} needs a batch and a channel axis (N, C, ...)", shape_str(x.shape()));
  const int64_t C = x.size(1);
  for (const auto& [what, t] : {std::pair{"running_mean", running_mean}, {"running_var", running_var},
                                {"weight", weight}, {"bias", bias}})
    KILN_CHECK(!t.defined() || t.shape() == Shape{C}, "batch_norm", "{} {} does not match the {} channels of input {}",
               what, shape_str(t.shape()), C, shape_str(x.shape()));
  KILN_CHECK(running_mean.defined() == running_var.defined(), "batch_norm",
             "running_mean and running_var come together (both defined or both undefined)");
  KILN_CHECK(training || running_mean.defined(), "batch_norm",
             "evaluation (training = false) normalizes with running statistics; pass running_mean and running_var, "
             "or training = true for the batch's");
  std::vector<int64_t> axes{0};  // every axis but the channels
  Shape channel_shape{C};        // (C, 1, ...): broadcasts against x
  for (size_t d = 2; d < x.dim(); ++d) {
    axes.push_back(static_cast<int64_t>(d));
    channel_shape.push_back(1);
  }
  Tensor mean, var;
  if (training) {
    const int64_t count = x.numel() / std::max<int64_t>(C, 1);
    KILN_CHECK(count > 1, "batch_norm", "training needs more than one value per channel, got input {}",
               shape_str(x.shape()));
    mean = kiln::mean(x, axes);              // (C)
    var = kiln::var(x, axes, false, false);  // (C), biased: what normalization uses
    if (running_mean.defined()) {
      NoGradGuard no_grad;
      const double unbias = static_cast<double>(count) / static_cast<double>(count - 1);
      // The statistics keep their dtype (float32 beside a float16 batch): a deliberate cast.
      Tensor rm = running_mean, rv = running_var;
      rm.assign((running_mean * (1.0 - momentum) + mean.detach() * momentum).to(running_mean.dtype()));
      rv.assign((running_var * (1.0 - momentum) + var.detach() * (momentum * unbias)).to(running_var.dtype()));
    }
  } else {
    mean = running_mean;
    var = running_var;
  }
  Tensor y = (x - mean.reshape(channel_shape)) * rsqrt(var.reshape(channel_shape) + eps);
  if (weight.defined()) y = y * weight.reshape(channel_shape);
  if (bias.defined()) y = y + bias.reshape(channel_shape);
  return y;
}

Tensor dropout(const Tensor& x, double p, bool training) {
  KILN_CHECK(p >= 0 && p < 1, "dropout", "probability {} not in [0, 1)", p);
  if (!training || p == 0) return x;
  Tensor keep = ge(rand(x.shape(), is_floating(x.dtype()) ? x.dtype() : DType::Float32), scalar(p, x.dtype()));
  return where(keep, x * (1.0 / (1.0 - p)), zeros_like(x));
}

}  // namespace kiln
