#include "ops/library.h"

#include "memory/cuda_runtime.h"
#include "ops/conv_onednn.h"
#include "ops/cuda_library.h"
#include "ops/matmul_onednn.h"

namespace kiln {

bool library_matmul(Device device, DType t) {
  return cuda::is_gpu(device) ? cuda_library::supports_matmul(t) : onednn::supports_matmul(t);
}

bool library_conv(Device device, DType t) {
  return cuda::is_gpu(device) ? cuda_library::supports_conv(t) : onednn::supports_conv(t);
}

}  // namespace kiln
