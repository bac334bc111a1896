// The raw memory of a CUDA device (cudaMalloc/cudaFree through the runtime, copies and fills on
// kiln's stream), as the memory::Allocator the pool of that device sits on.
#pragma once
#include "core/device.h"
#include "memory/allocator.h"

namespace kiln::cuda {

// The allocator of CUDA device `device` (one per device, never destroyed); kiln::Error when this
// process cannot use it.
memory::Allocator& device_allocator(Device device);

}  // namespace kiln::cuda
