// Batched matrix multiply on CUDA tensors through cuBLASLt: the device counterpart of
// backends/cpu/matmul_onednn.h, with the same contract on device pointers. Work is queued on
// kiln's stream of the device; nothing here synchronizes.
//
//   if (kiln::cuda::cublaslt_supports_matmul(DType::Float16)) {
//     int64_t a_strides[3] = {0, K, 1};       // one (M, K) matrix shared by every batch
//     int64_t b_strides[3] = {K * N, 1, K};   // each (K, N) matrix stored transposed
//     kiln::cuda::cublaslt_matmul(0, DType::Float16, a, a_strides, b, b_strides, c, batch, M, K, N);
//   }
//   kiln::cuda::synchronize(0);               // or copy_to_host, which waits too
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace kiln::cuda {

// True when this build can run matmul for dtype t on a real CUDA device: float32, float64, float16
// and bfloat16 (built with the CUDA toolkit). Says nothing about whether a device is present:
// that is kiln::cuda::available().
bool cublaslt_supports_matmul(DType t);

// Maps cuBLASLt and resolves every function kiln calls, as the first CUDA matmul does (kiln loads
// it on first use: backends/cuda/shared_library.h). Throws kiln::Error naming the library when it
// cannot be loaded, or when kiln was built without the CUDA toolkit.
void cublaslt_load();

// C[b] = A[b] @ B[b] for b in [0, batch) on cuda:device, accumulating in fp32 (fp64 for float64).
//   a: (batch, M, K) at element strides a_strides = {batch, row, col}; batch stride 0 broadcasts
//   b: (batch, K, N) at element strides b_strides = {batch, row, col}
//   c: (batch, M, N) contiguous, same dtype as a and b
// All three are device pointers. Operands whose layout cuBLASLt cannot take (no unit stride in a
// matrix, an overlapping or negative stride) are copied to contiguous device buffers first.
// With flags().tf32, float32 inputs may be rounded to TF32 (tensor cores).
// Throws kiln::Error for unsupported dtypes, negative or too large sizes, no usable device
// (none, or the host emulator), or a CUDA / cuBLASLt failure while queueing.
void cublaslt_matmul(int device, DType t, const void* a, const int64_t a_strides[3], const void* b,
            const int64_t b_strides[3], void* c, int64_t batch, int64_t M, int64_t K, int64_t N);

}  // namespace kiln::cuda
