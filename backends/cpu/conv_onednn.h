// 2-D convolution on the CPU through oneDNN: forward, backward-data and backward-weights over
// the plain contiguous buffers ops/conv_geometry.h describes, for float32 and (where the CPU has
// it) bfloat16. Internally oneDNN picks its blocked layouts and kiln reorders in and out.
//
//   ConvGeometry g{.N = 128, .C = 32, .H = 14, .W = 14, .OC = 64, .KH = 3, .KW = 3,
//                  .OH = 14, .OW = 14, .stride = {1, 1}, .padding = {1, 1}};
//   cpu::onednn_conv2d(ConvPass::Forward, DType::Float32, g, x, w, y);
#pragma once
#include <cstdint>

#include "core/dtype.h"
#include "ops/conv_geometry.h"

namespace kiln::cpu {

// True when oneDNN has a native convolution kernel for this dtype on this CPU.
bool onednn_supports_conv(DType t);

// Runs one pass; all three buffers are contiguous in the layouts of ops/conv_geometry.h and of
// dtype t.
// Throws kiln::Error for unsupported dtypes or a oneDNN failure.
void onednn_conv2d(ConvPass pass, DType t, const ConvGeometry& g, const void* a, const void* b, void* out);

}  // namespace kiln::cpu
