#include "ops/library.h"

#include "backends/cuda/cuda_runtime.h"
#include "backends/cpu/conv_onednn.h"
#include "backends/cuda/cublaslt.h"
#include "backends/cuda/cudnn.h"
#include "backends/cpu/matmul_onednn.h"

namespace kiln {

bool library_matmul(Device device, DType t) {
  return cuda::is_gpu(device) ? cuda::cublaslt_supports_matmul(t) : cpu::onednn_supports_matmul(t);
}

bool library_conv(Device device, DType t) {
  return cuda::is_gpu(device) ? cuda::cudnn_supports_conv(t) : cpu::onednn_supports_conv(t);
}

}  // namespace kiln
