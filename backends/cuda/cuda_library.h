// Matmul and 2-D convolution on CUDA tensors through NVIDIA's libraries (cuBLASLt, cuDNN): the
// device counterparts of backends/cpu/matmul_onednn.h and backends/cpu/conv_onednn.h, with the same contracts on
// device pointers. Work is queued on kiln's stream of the device; nothing here synchronizes.
//
//   if (kiln::cuda_library::supports_matmul(DType::Float16)) {
//     int64_t a_strides[3] = {0, K, 1};       // one (M, K) matrix shared by every batch
//     int64_t b_strides[3] = {K * N, 1, K};   // each (K, N) matrix stored transposed
//     kiln::cuda_library::matmul(0, DType::Float16, a, a_strides, b, b_strides, c, batch, M, K, N);
//   }
//   kiln::cuda_library::conv2d(0, ConvPass::Forward, DType::Float32, g, x, w, y);
//   kiln::cuda::synchronize(0);               // or copy_to_host, which waits too
#pragma once
#include <cstdint>

#include "core/dtype.h"
#include "ops/conv_geometry.h"

namespace kiln::cuda_library {

// True when this build can run the op for dtype t on a real CUDA device: matmul float32, float64,
// float16 and bfloat16 (built with the CUDA toolkit); conv float32, float16 and bfloat16 (built
// with cuDNN too; float64 convolutions stay composites). Says nothing about whether a device is
// present: that is kiln::cuda::available().
bool supports_matmul(DType t);
bool supports_conv(DType t);

// C[b] = A[b] @ B[b] for b in [0, batch) on cuda:device, accumulating in fp32 (fp64 for float64).
//   a: (batch, M, K) at element strides a_strides = {batch, row, col}; batch stride 0 broadcasts
//   b: (batch, K, N) at element strides b_strides = {batch, row, col}
//   c: (batch, M, N) contiguous, same dtype as a and b
// All three are device pointers. Operands whose layout cuBLASLt cannot take (no unit stride in a
// matrix, an overlapping or negative stride) are copied to contiguous device buffers first.
// With flags().tf32, float32 inputs may be rounded to TF32 (tensor cores).
// Throws kiln::Error for unsupported dtypes, negative or too large sizes, no usable device
// (none, or the host emulator), or a CUDA / cuBLASLt failure while queueing.
void matmul(int device, DType t, const void* a, const int64_t a_strides[3], const void* b,
            const int64_t b_strides[3], void* c, int64_t batch, int64_t M, int64_t K, int64_t N);

// Runs one pass of onednn::conv2d's contract on cuda:device: a, b and out are contiguous device
// buffers in the layouts ops/conv_geometry.h documents; out is overwritten.
// Throws kiln::Error for unsupported dtypes, a geometry cuDNN refuses, no usable device, or a
// CUDA / cuDNN failure while queueing.
void conv2d(int device, ConvPass pass, DType t, const ConvGeometry& g, const void* a,
            const void* b, void* out);

}  // namespace kiln::cuda_library
