// Allocation of tensor storage. Host memory is 64-byte aligned (cache line, AVX-512 loads).
// The pooled allocator and the CUDA allocator plug in behind allocate_storage().
#pragma once
#include <memory>

#include "core/node.h"

namespace kiln::memory {

// A new Storage of `bytes` on `device`, freed when the last reference goes.
std::shared_ptr<Storage> allocate_storage(size_t bytes, Device device);

// Bytes of tensor storage currently allocated (requested sizes) and the peak since start.
int64_t allocated_bytes();
int64_t peak_allocated_bytes();

}  // namespace kiln::memory
