// The standard layers. See layers.h.
#include "nn/layers.h"

#include "nn/quantize.h"
#include "ops/primitive.h"

#include <cmath>

#include <fmt/format.h>

#include "core/autograd.h"
#include "core/flags.h"
#include "core/shape.h"
#include "nn/init.h"
#include "ops/autocast.h"
#include "ops/ops.h"

namespace kiln::nn {

Linear::Linear(const LinearOptions& o) : Module("Linear"), options_(o) {
  KILN_CHECK(o.in_features() > 0 && o.out_features() > 0, "Linear", "features must be positive, got in={} out={}",
             o.in_features(), o.out_features());
  weight = register_parameter("weight", zeros({o.out_features(), o.in_features()}, o.dtype()));
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (o.bias()) {
    bias = register_parameter("bias", zeros({o.out_features()}, o.dtype()));
    double bound = 1.0 / std::sqrt(static_cast<double>(o.in_features()));
    init::uniform_(bias, -bound, bound);
  }
  set_extra_repr(fmt::format("in={}, out={}, bias={}", o.in_features(), o.out_features(), o.bias()));
}

Tensor Linear::forward(const Tensor& x) {
  KILN_CHECK(x.dim() >= 1 && x.shape().back() == options_.in_features(), "Linear",
             "input {} does not end in in_features={}", shape_str(x.shape()), options_.in_features());
  // After nn::quantize_dynamic the layer holds its int8 weight as buffers: the int8 path.
  Tensor int8, int4, scales;
  for (const auto& [name, b] : named_buffers(false)) {
    if (name == "weight_int8") int8 = b;
    if (name == "weight_int4") int4 = b;
    if (name == "weight_scale") scales = b;
  }
  if (int8.defined()) return quantized_linear(x, QuantizedWeight{int8, scales, packed_int8(int8)}, bias);
  if (int4.defined()) return int4_linear(x, Int4Weight{int4, scales, options_.in_features()}, bias);
  // KILN_QUANTIZE=1: without gradients (NoGradGuard, or nothing requires one), the int8 path,
  // the weight quantized once per value it takes.
  if (flags().quantize && !(grad_enabled() && (x.requires_grad() || weight.requires_grad()))) {
    const int bits = flags().quantize_bits;
    if (quantized_->of.lock() != weight.node() || quantized_->bits != bits) {
      if (bits == 4) {
        const Int4Weight fresh = quantize_int4(weight);
        *quantized_ = {weight.node(), bits, fresh.values, fresh.scales};
      } else {
        const QuantizedWeight fresh = quantize_per_channel(weight);
        *quantized_ = {weight.node(), bits, fresh.values, fresh.scales};
      }
    }
    if (bits == 4) return int4_linear(x, Int4Weight{quantized_->values, quantized_->scales, options_.in_features()}, bias);
    return quantized_linear(x, QuantizedWeight{quantized_->values, quantized_->scales, packed_int8(quantized_->values)},
                            bias);
  }
  return linear(x, weight, bias);
}

Tensor Linear::packed_int8(const Tensor& values) {
  if (!values.device().is_cpu()) return {};  // a device dequantizes instead
  if (packed_->of.lock() != values.node()) *packed_ = {values.node(), prim::pack_quantized_weight(values)};
  return packed_->packed;
}

Dropout::Dropout(double p) : Module("Dropout"), p_(p) {
  KILN_CHECK(p >= 0.0 && p < 1.0, "Dropout", "p = {} is outside [0, 1)", p);
  set_extra_repr(fmt::format("p={}", p));
}
Tensor Dropout::forward(const Tensor& x) { return dropout(x, p_, is_training()); }

Tensor ReLU::forward(const Tensor& x) { return relu(x); }

GELU::GELU(bool tanh) : Module("GELU"), tanh_approximation_(tanh) {
  if (tanh) set_extra_repr("approximate=tanh");
}
Tensor GELU::forward(const Tensor& x) { return gelu(x, tanh_approximation_); }

Tensor SiLU::forward(const Tensor& x) { return silu(x); }
Tensor Sigmoid::forward(const Tensor& x) { return sigmoid(x); }
Tensor Tanh::forward(const Tensor& x) { return kiln::tanh(x); }

Flatten::Flatten(int64_t start, int64_t end) : Module("Flatten"), start_dim_(start), end_dim_(end) {
  set_extra_repr(fmt::format("start_dim={}, end_dim={}", start, end));
}
Tensor Flatten::forward(const Tensor& x) { return flatten(x, start_dim_, end_dim_); }

LayerNorm::LayerNorm(const LayerNormOptions& o) : Module("LayerNorm"), options_(o) {
  if (o.elementwise_affine()) {
    weight = register_parameter("weight", ones(o.normalized_shape(), o.dtype()).realize());
    bias = register_parameter("bias", zeros(o.normalized_shape(), o.dtype()).realize());
  }
  set_extra_repr(fmt::format("{}, eps={}", shape_str(o.normalized_shape()), o.eps()));
}
Tensor LayerNorm::forward(const Tensor& x) {
  return layer_norm(x, options_.normalized_shape(), weight, bias, options_.eps());
}

Embedding::Embedding(const EmbeddingOptions& o) : Module("Embedding"), options_(o) {
  KILN_CHECK(o.num_embeddings() > 0 && o.embedding_dim() > 0, "Embedding", "sizes must be positive, got {} x {}",
             o.num_embeddings(), o.embedding_dim());
  KILN_CHECK(is_floating(o.dtype()), "Embedding", "the table's dtype must be floating-point, got {}",
             dtype_name(o.dtype()));
  weight = register_parameter("weight", randn({o.num_embeddings(), o.embedding_dim()}, o.dtype()).realize());
  set_extra_repr(fmt::format("{}, {}", o.num_embeddings(), o.embedding_dim()));
}
Tensor Embedding::forward(const Tensor& indices) { return embedding(indices, weight); }

BatchNormBase::BatchNormBase(const char* name, const BatchNormOptions& o) : Module(name), options_(o) {
  KILN_CHECK(o.features() > 0, name, "features must be positive, got {}", o.features());
  if (o.affine()) {
    weight = register_parameter("weight", ones({o.features()}, o.dtype()).realize());
    bias = register_parameter("bias", zeros({o.features()}, o.dtype()).realize());
  }
  if (o.track_running_stats()) {
    running_mean = register_buffer("running_mean", zeros({o.features()}, o.dtype()).realize());
    running_var = register_buffer("running_var", ones({o.features()}, o.dtype()).realize());
    num_batches_tracked = register_buffer("num_batches_tracked", zeros({}, DType::Int64).realize());
  }
  set_extra_repr(fmt::format("{}, eps={}, momentum={}", o.features(), o.eps(), o.momentum()));
}

Tensor BatchNormBase::normalize(const Tensor& x) const {
  // Eval without running statistics normalizes with the batch's, updating nothing.
  const bool use_batch = is_training() || !options_.track_running_stats();
  Tensor y = batch_norm(x, running_mean, running_var, weight, bias, use_batch, options_.momentum(), options_.eps());
  if (is_training() && options_.track_running_stats()) {
    NoGradGuard no_grad;
    Tensor batches = num_batches_tracked;
    batches.assign(num_batches_tracked + 1.0);
  }
  return y;
}

Tensor BatchNorm1d::forward(const Tensor& x) {
  int64_t C = options().features();
  KILN_CHECK((x.dim() == 2 || x.dim() == 3) && x.size(1) == C, "BatchNorm1d",
             "expects (N, {0}) or (N, {0}, L), got {1}", C, shape_str(x.shape()));
  return normalize(x);
}

Tensor BatchNorm2d::forward(const Tensor& x) {
  int64_t C = options().features();
  KILN_CHECK(x.dim() == 4 && x.size(1) == C, "BatchNorm2d",
             "expects (N, {0}, H, W), got {1}; BatchNorm1d takes (N, C) and (N, C, L)", C, shape_str(x.shape()));
  return normalize(x);
}

}  // namespace kiln::nn
