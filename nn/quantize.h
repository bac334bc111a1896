// Dynamic int8 quantization of Linear layers for inference (PyTorch's quantize_dynamic): weights
// int8, symmetric, one scale per output channel, quantized once; activations quantized per call,
// symmetric int8 with one scale (an asymmetric uint8 zero point would give one-signed inputs, as
// after a ReLU, one more bit, but oneDNN 2.6's int8 gemm runs about 2x slower with a runtime zero
// point; the tests hold the symmetric path to 35 dB SQNR on ReLU outputs too); int32 accumulation
// in oneDNN's int8 matmul (AVX-512 VNNI / AMX where the CPU has them); the float scales applied
// to its output, the bias added after.
//
//   nn::quantize_dynamic(model);                 // every nn::Linear inside model
//   NoGradGuard no_grad;
//   Tensor logits = model.forward(x);            // int8 matmuls
//
// Under a device (CUDA) the layer dequantizes its int8 weight and runs the float matmul (no int8
// kernel there yet). Asking for a gradient through a quantized layer is an Error.
#pragma once
#include <cstdint>

#include "nn/module.h"

namespace kiln::nn {

struct QuantizeOptions {
  // Weight width: 8 (int8 weights and activations, int8 matmul) or 4 (weight-only int4: two
  // weights per byte, one scale per group of input features; the float matmul runs on the weight
  // dequantized by one fused kernel per call, so the win is memory, not speed).
  QuantizeOptions& bits(int b) {
    bits_ = b;
    return *this;
  }
  // int4: input features per scale (32 or 64).
  QuantizeOptions& group_size(int64_t g) {
    group_size_ = g;
    return *this;
  }
  int bits_ = 8;
  int64_t group_size_ = 32;
};

// A weight (out, in) quantized per output channel: values (in, out) int8 in [-127, 127] (laid out
// for the matmul, the transpose of the weight; [-63, 63] on a CPU without VNNI, whose int8 matmul
// would saturate: int8_weight_limit in ops/library.h) and scales (out) float32, with
// weight[o][i] ~= values[i][o] * scales[o], each within scales[o] / 2.
struct QuantizedWeight {
  Tensor values;  // (in, out) int8
  Tensor scales;  // (out) float32
  // Optional: values laid out for this CPU's int8 matmul (prim::pack_quantized_weight), which
  // quantized_linear then reads instead of repacking values on each call. nn::Linear makes and
  // keeps it; not saved (the layout depends on the CPU).
  Tensor packed;
};
QuantizedWeight quantize_per_channel(const Tensor& weight);
Tensor dequantize(const QuantizedWeight& w);  // (out, in) float32

// x (..., in) float32 through the int8 path: each call quantizes x with its own range.
Tensor quantized_linear(const Tensor& x, const QuantizedWeight& w, const Tensor& bias = {});

// A weight (out, in) quantized to 4 bits per group of `group` input features, the inputs padded
// with zeros to a whole number of groups (in_padded): values (in_padded / 2, out) uint8, row 2i's
// nibble low and row 2i + 1's high, each nibble q + 8 for q in [-7, 7]; scales
// (in_padded / group, out) float32 (max |w| / 7 of the group); each weight within half its
// group's step.
struct Int4Weight {
  Tensor values;  // (in_padded / 2, out) uint8
  Tensor scales;  // (in_padded / group, out) float32
  int64_t in_features = 0;
};
Int4Weight quantize_int4(const Tensor& weight, int64_t group = 32);
Tensor dequantize(const Int4Weight& w);  // (in, out) float32: the matmul's B, one fused kernel
// x (..., in) @ the dequantized weight + bias, in x's float type.
Tensor int4_linear(const Tensor& x, const Int4Weight& w, const Tensor& bias = {});

// Quantizes every nn::Linear in `model` (itself included): each keeps its float weight and gains
// buffers "weight_int8" (or, for 4 bits, "weight_int4") and "weight_scale" (saved with the
// model), and its forward takes the quantized path from then on. Returns how many layers it
// quantized; prints a warning line when none. Throws kiln::Error for a width other than 8 or 4,
// or an int4 group size other than 32 or 64.
int64_t quantize_dynamic(Module& model, const QuantizeOptions& options = {});

}  // namespace kiln::nn
