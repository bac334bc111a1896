// What the cuBLASLt and cuDNN calls share: the check that a device can take a library call, the
// 32-bit size limit of both libraries' descriptors, and a CUDA runtime error as a kiln::Error that
// names the library call and the problem.
#pragma once
#include <climits>
#include <cstdint>
#include <string_view>

#include "backends/cuda/cuda_runtime.h"
#include "core/device.h"
#include "core/error.h"

#if KILN_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace kiln::cuda {

// A device this unit can queue library calls on: present, and a real GPU (the host emulator's
// "device memory" is host memory, which cuBLAS and cuDNN cannot read).
inline void check_library_device(int device, std::string_view op) {
  cuda::check_device(Device::cuda(device), op);
  KILN_CHECK(!cuda::emulated(), op, "cuda:{} is the host emulator (KILN_CUDA_EMULATOR=1); NVIDIA's libraries "
             "need a real GPU, so check cuda::emulated() and use the composite ops there", device);
}

// Whether a size fits the int fields of the libraries' descriptors.
inline bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

#if KILN_WITH_CUDA

// Fails with the runtime's message for `call`, naming `op` and describe()'s problem.
template <class Describe>
void check_cuda(cudaError_t e, std::string_view op, const char* call, const Describe& describe) {
  if (e != cudaSuccess)
    KILN_FAIL(op, "{} failed: {} ({}); {}", call, cudaGetErrorString(e), cudaGetErrorName(e), describe());
}

#endif  // KILN_WITH_CUDA

}  // namespace kiln::cuda
