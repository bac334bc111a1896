// 2-D convolution on CUDA tensors through cuDNN: the device counterpart of
// backends/cpu/conv_onednn.h, with the same contract on device pointers. Work is queued on kiln's
// stream of the device; nothing here synchronizes.
//
//   ConvGeometry g{.N = 128, .C = 32, .H = 14, .W = 14, .OC = 64, .KH = 3, .KW = 3,
//                  .OH = 14, .OW = 14, .stride = {1, 1}, .padding = {1, 1}};
//   if (kiln::cuda::cudnn_supports_conv(DType::Float32))
//     kiln::cuda::cudnn_conv2d(0, ConvPass::Forward, DType::Float32, g, x, w, y);
//   kiln::cuda::synchronize(0);               // or copy_to_host, which waits too
#pragma once
#include <cstdint>

#include "core/dtype.h"
#include "ops/conv_geometry.h"

namespace kiln::cuda {

// True when this build can run a convolution for dtype t on a real CUDA device: float32, float16
// and bfloat16 (built with the CUDA toolkit and cuDNN; float64 convolutions stay composites).
// Says nothing about whether a device is present: that is kiln::cuda::available().
bool cudnn_supports_conv(DType t);

// Runs one pass on cuda:device: a, b and out are contiguous device buffers in the layouts
// ops/conv_geometry.h documents; out is overwritten.
// Throws kiln::Error for unsupported dtypes, a geometry cuDNN refuses, no usable device, or a
// CUDA / cuDNN failure while queueing.
void cudnn_conv2d(int device, ConvPass pass, DType t, const ConvGeometry& g, const void* a, const void* b, void* out);

}  // namespace kiln::cuda
