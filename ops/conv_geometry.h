// The description of one 2-D convolution pass that the kernel IR carries and every backend's
// library call takes (oneDNN on the CPU, cuDNN on a GPU): sizes, window and which of the three
// passes. Backend-neutral: nothing here names a library.
//
//   kiln::ConvGeometry g{.N = 128, .C = 32, .H = 14, .W = 14, .OC = 64, .KH = 3, .KW = 3,
//                        .OH = 14, .OW = 14, .stride = {1, 1}, .padding = {1, 1}};
//   kiln::cpu::onednn_conv2d(kiln::ConvPass::Forward, DType::Float32, g, x, w, y);
//
// Every buffer is contiguous, row-major, of one dtype:
//   x  (N, C, H, W)             input, or its gradient dx
//   w  (OC, C / groups, KH, KW) weight, or its gradient dw
//   y  (N, OC, OH, OW)          output, or its gradient dy
// with OH = (H + 2 * padding[0] - dilation[0] * (KH - 1) - 1) / stride[0] + 1 (OW alike), the
// cross-correlation PyTorch computes.
#pragma once
#include <cstdint>

namespace kiln {

// Sizes and attributes of one convolution; dilation 1 means no gaps (PyTorch's convention).
struct ConvGeometry {
  int64_t N = 0, C = 0, H = 0, W = 0;  // input
  int64_t OC = 0, KH = 0, KW = 0;      // weight (OC, C / groups, KH, KW)
  int64_t OH = 0, OW = 0;              // output
  int64_t stride[2] = {1, 1}, padding[2] = {0, 0}, dilation[2] = {1, 1};
  int64_t groups = 1;
};

// Which pass a library call runs, and what its operands a, b and out are.
enum class ConvPass : uint8_t {
  Forward,         // y = conv(x, w):            a = x,  b = w,  out = y
  BackwardData,    // dx = conv^T(dy, w):        a = dy, b = w,  out = dx
  BackwardWeight,  // dw = correlate(x, dy):     a = x,  b = dy, out = dw
};

}  // namespace kiln
