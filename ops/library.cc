#include "ops/library.h"

#include "backends/cuda/cuda_runtime.h"
#include "backends/cpu/conv_onednn.h"
#include "backends/cuda/cublaslt.h"
#include "backends/cuda/cudnn.h"
#include "backends/cpu/matmul_onednn.h"
#include "backends/cpu/pool_cpu.h"
#include "ops/ops.h"
#include "ops/primitive.h"

namespace kiln {

bool library_matmul(Device device, DType t) {
  return cuda::is_gpu(device) ? cuda::cublaslt_supports_matmul(t) : cpu::onednn_supports_matmul(t);
}

bool library_conv(Device device, DType t) {
  return cuda::is_gpu(device) ? cuda::cudnn_supports_conv(t) : cpu::onednn_supports_conv(t);
}

bool library_pool(Device device, DType t) { return !cuda::is_gpu(device) && cpu::supports_max_pool_offsets(t); }

int int8_weight_limit(Device device) { return device.is_cpu() ? cpu::onednn_int8_weight_limit() : 127; }

}  // namespace kiln

namespace kiln::prim {

Tensor pack_quantized_weight(const Tensor& b) {
  KILN_CHECK(b.dim() == 2 && b.dtype() == DType::Int8 && b.device().is_cpu(), "pack_quantized_weight",
             "needs an int8 (K, N) weight on the host; got {}", b.str());
  const int64_t K = b.size(0), N = b.size(1);
  const int64_t bytes = cpu::onednn_packed_int8_weight_bytes(K, N);
  if (bytes == 0) return {};
  const std::vector<int8_t> plain = b.to_vector<int8_t>();
  std::vector<uint8_t> packed(static_cast<size_t>(bytes));
  cpu::onednn_pack_int8_weight(plain.data(), packed.data(), K, N);
  return from_vector<uint8_t>(packed, {bytes}).to(b.device());  // (KILN_USE_CUDA makes new tensors on the device)
}

Tensor quantized_matmul_packed(const Tensor& a, const Tensor& packed, int64_t N) {
  KILN_CHECK(a.dim() == 2 && a.dtype() == DType::Int8 && packed.dim() == 1 && packed.dtype() == DType::UInt8 &&
                 packed.numel() == cpu::onednn_packed_int8_weight_bytes(a.size(1), N),
             "quantized_matmul", "needs int8 (M, K) and the bytes of pack_quantized_weight for (K, {}); got {} and {}",
             N, a.str(), packed.str());
  KILN_CHECK(a.device().is_cpu(), "quantized_matmul", "the int8 matmul runs on the host; got {}", a.str());
  return make(Op::QuantizedMatmul, DType::Float32, {a.size(0), N}, {a, packed}, {a.size(1), N});
}

}  // namespace kiln::prim
