// Where matmul and convolution run as library kernels: oneDNN on the CPU (and on the CUDA
// emulator, whose memory is the host's), cuBLASLt and cuDNN on a GPU. Elsewhere (float64 on the
// CPU, for instance) the ops build them from primitives.
//
//   if (kiln::library_matmul(a.device(), t)) out = prim::matmul(a3, b3);
#pragma once
#include "core/device.h"
#include "core/dtype.h"

namespace kiln {

bool library_matmul(Device device, DType t);
bool library_conv(Device device, DType t);
// Max pooling's window arg-max (prim::max_pool_offsets): a host kernel, also on the emulator.
bool library_pool(Device device, DType t);
// The largest magnitude of an int8 weight the quantized matmul on `device` sums exactly (127, or
// 63 on a CPU without VNNI: backends/cpu/matmul_onednn.h).
int int8_weight_limit(Device device);

}  // namespace kiln
