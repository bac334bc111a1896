// Dynamic int8 quantization: per-channel weights, per-batch activations, oneDNN's int8 matmul.
// See quantize.h.
#include "nn/quantize.h"

#include <fmt/format.h>

#include <limits>

#include "core/autograd.h"
#include "core/error.h"
#include "ops/library.h"
#include "ops/ops.h"
#include "ops/primitive.h"

namespace kiln::nn {

namespace {

// The smallest scale: an all-zero row or batch quantizes to zeros instead of dividing by zero.
constexpr double kScaleFloor = std::numeric_limits<float>::min();

Tensor round_half_up(const Tensor& t) { return floor(t + 0.5); }

// 0 where t is NaN, else t: keeps a cast to an integer type defined.
Tensor zero_nan(const Tensor& t) { return where(t == t, t, zeros_like(t)); }

}  // namespace

QuantizedWeight quantize_per_channel(const Tensor& weight) {
  KILN_CHECK(weight.dim() == 2 && is_floating(weight.dtype()), "quantize_per_channel",
             "needs a floating-point (out, in) weight, got {}", weight.str());
  NoGradGuard no_grad;
  const Tensor w = cast(weight.detach(), DType::Float32);
  const int limit = int8_weight_limit(weight.device());
  const Tensor scales = maximum(w.abs().max({1}, true) / static_cast<double>(limit), scalar_like(kScaleFloor, w));
  const Tensor q = clamp(round_half_up(w / scales), -limit, limit);
  QuantizedWeight out;
  out.values = cast(zero_nan(q).t(), DType::Int8);  // (in, out): the matmul's B
  out.scales = scales.reshape({weight.size(0)});
  sync({out.values, out.scales});  // one plan
  return out;
}

Tensor dequantize(const QuantizedWeight& w) {
  return cast(w.values, DType::Float32).t() * w.scales.reshape({w.scales.numel(), 1});
}

Tensor quantized_linear(const Tensor& x, const QuantizedWeight& w, const Tensor& bias) {
  const int64_t K = w.values.size(0), N = w.values.size(1);
  KILN_CHECK(x.dim() >= 1 && x.shape().back() == K && is_floating(x.dtype()), "QuantizedLinear",
             "input {} does not end in in_features={} (or is not floating point)", x.str(), K);
  // Fails here rather than in the backward: rounding has no gradient, on the host or a device.
  KILN_CHECK(!grad_enabled() || !x.requires_grad(), "QuantizedLinear",
             "int8 layers are for inference and have no gradient (rounding has none), but input {} requires one; run "
             "them under NoGradGuard, or train the float model and quantize it afterwards (nn::quantize_dynamic)",
             x.str());
  if (!x.device().is_cpu()) {  // no int8 kernel on the device yet: the float matmul of the dequantized weight
    const Device d = x.device();
    const Tensor bias_on = bias.defined() ? bias.to(d) : Tensor();
    const Tensor poison = (x - x).sum();  // NaN in, NaN out everywhere, as on the host
    return linear(x, dequantize(QuantizedWeight{w.values.to(d), w.scales.to(d), Tensor()}).cast(x.dtype()), bias_on) + poison;
  }
  Shape out_shape = x.shape();
  out_shape.back() = N;
  const Tensor x2 = cast(x, DType::Float32).reshape({x.numel() / K, K});
  // Symmetric int8, one scale per call: the largest magnitude maps to 127.
  const Tensor scale = maximum(max(x2.abs()) / 127.0, scalar_like(kScaleFloor, x2));
  const Tensor q = cast(zero_nan(clamp(round_half_up(x2 / scale), -127, 127)), DType::Int8);
  // NaN (or an infinity) anywhere in x makes every output NaN instead of a silently wrong number.
  const Tensor poison = (x2 - x2).sum();
  // The scales, the NaN guard and the bias fuse into one kernel after the int8 matmul.
  const Tensor product = w.packed.defined() ? prim::quantized_matmul_packed(q, w.packed, N) : prim::quantized_matmul(q, w.values);
  Tensor y = product * (scale * w.scales) + poison;
  if (bias.defined()) y = y + cast(bias, DType::Float32);
  return cast(y.reshape(out_shape), x.dtype());
}

Int4Weight quantize_int4(const Tensor& weight, int64_t group) {
  KILN_CHECK(weight.dim() == 2 && is_floating(weight.dtype()), "quantize_int4",
             "needs a floating-point (out, in) weight, got {}", weight.str());
  KILN_CHECK(group == 32 || group == 64, "quantize_int4", "group size must be 32 or 64, got {}", group);
  const int64_t N = weight.size(0), K = weight.size(1), padded = (K + group - 1) / group * group;
  NoGradGuard no_grad;
  // (padded / group, group, N): the groups run along the input features; padding rows are zeros.
  const Tensor w = pad(cast(weight.detach(), DType::Float32).t(), {{0, padded - K}, {0, 0}}).reshape({padded / group, group, N});
  const Tensor scales = maximum(w.abs().max({1}, true) / 7.0, scalar_like(kScaleFloor, w));
  const Tensor q = zero_nan(clamp(round_half_up(w / scales), -7, 7)).reshape({padded / 2, 2, N}) + 8.0;
  Int4Weight out;
  out.values = cast(q.slice(1, 0, 1) + q.slice(1, 1, 2) * 16.0, DType::UInt8).reshape({padded / 2, N});
  out.scales = scales.reshape({padded / group, N});
  out.in_features = K;
  sync({out.values, out.scales});
  return out;
}

Tensor dequantize(const Int4Weight& w) {
  const int64_t half = w.values.size(0), N = w.values.size(1), padded = 2 * half, groups = w.scales.size(0);
  const Tensor packed = cast(w.values, DType::Float32);
  const Tensor high = floor(packed / 16.0), low = packed - high * 16.0;
  const Tensor q = concat({low.unsqueeze(1), high.unsqueeze(1)}, 1).reshape({padded, N}) - 8.0;  // row 2i, then 2i + 1
  return (q.reshape({groups, padded / groups, N}) * w.scales.unsqueeze(1)).reshape({padded, N}).slice(0, 0, w.in_features);
}

Tensor int4_linear(const Tensor& x, const Int4Weight& w, const Tensor& bias) {
  const int64_t K = w.in_features;
  KILN_CHECK(x.dim() >= 1 && x.shape().back() == K && is_floating(x.dtype()), "QuantizedLinear",
             "input {} does not end in in_features={} (or is not floating point)", x.str(), K);
  const Device d = x.device();
  const Tensor weight = dequantize(Int4Weight{w.values.to(d), w.scales.to(d), K}).cast(x.dtype());
  Tensor y = matmul(x, weight);
  return bias.defined() ? y + bias.to(d).cast(x.dtype()) : y;
}

int64_t quantize_dynamic(Module& model, const QuantizeOptions& options) {
  KILN_CHECK(options.bits_ == 8 || options.bits_ == 4, "quantize_dynamic", "bits must be 8 or 4, got {}", options.bits_);
  const bool int4 = options.bits_ == 4;
  const std::string values_name = int4 ? "weight_int4" : "weight_int8";
  int64_t count = 0;
  auto visit = [&](auto& self, Module m) -> void {
    if (m.type_name() == "Linear") {
      Tensor weight;
      for (const auto& [name, p] : m.named_parameters(false))
        if (name == "weight") weight = p;
      Tensor values, scales;
      if (int4) {
        const Int4Weight q = quantize_int4(weight, options.group_size_);
        values = q.values, scales = q.scales;
      } else {
        const QuantizedWeight q = quantize_per_channel(weight);
        values = q.values, scales = q.scales;
      }
      bool had = false;
      for (auto& [name, b] : m.named_buffers(false)) {
        KILN_CHECK(name != (int4 ? "weight_int8" : "weight_int4"), "quantize_dynamic",
                   "a Linear of {} is already quantized to {} bits; quantize a float model", model.type_name(),
                   int4 ? 8 : 4);
        if (name == values_name) b.assign(values), had = true;
        if (name == "weight_scale") b.assign(scales);
      }
      if (!had) {
        m.register_buffer(values_name, values);
        m.register_buffer("weight_scale", scales);
      }
      ++count;
    }
    for (const auto& [name, child] : m.named_children()) self(self, child);
  };
  visit(visit, model);
  if (count == 0) fmt::print(stderr, "[kiln] quantize_dynamic: {} has no nn::Linear; nothing was quantized\n", model.type_name());
  return count;
}

}  // namespace kiln::nn
