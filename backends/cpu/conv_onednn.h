// 2-D convolution on the CPU through oneDNN: forward, backward-data and backward-weights over
// plain contiguous NCHW / (OC, C/groups, KH, KW) buffers, for float32 and (where the CPU has it)
// bfloat16. Internally oneDNN picks its blocked layouts and kiln reorders in and out.
//
//   onednn::ConvGeometry g{.N = 128, .C = 32, .H = 14, .W = 14, .OC = 64, .KH = 3, .KW = 3,
//                          .OH = 14, .OW = 14, .stride = {1, 1}, .padding = {1, 1}};
//   onednn::conv2d(onednn::ConvPass::Forward, DType::Float32, g, x, w, y);
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace kiln::onednn {

// Sizes and attributes of one convolution; dilation 1 means no gaps (PyTorch's convention).
struct ConvGeometry {
  int64_t N = 0, C = 0, H = 0, W = 0;  // input
  int64_t OC = 0, KH = 0, KW = 0;      // weight (OC, C / groups, KH, KW)
  int64_t OH = 0, OW = 0;              // output
  int64_t stride[2] = {1, 1}, padding[2] = {0, 0}, dilation[2] = {1, 1};
  int64_t groups = 1;
};

enum class ConvPass : uint8_t {
  Forward,         // y = conv(x, w):            a = x,  b = w,  out = y
  BackwardData,    // dx = conv^T(dy, w):        a = dy, b = w,  out = dx
  BackwardWeight,  // dw = correlate(x, dy):     a = x,  b = dy, out = dw
};

// True when oneDNN has a native convolution kernel for this dtype on this CPU.
bool supports_conv(DType t);

// Runs one pass; all three buffers are contiguous in the layouts above and of dtype t.
// Throws kiln::Error for unsupported dtypes or a oneDNN failure.
void conv2d(ConvPass pass, DType t, const ConvGeometry& g, const void* a, const void* b, void* out);

}  // namespace kiln::onednn
