#include "memory/allocator.h"

#include <cstdlib>
#include <new>

#include "core/error.h"

namespace kiln::memory {

namespace {
constexpr size_t kAlignment = 64;

void release_host(void* data, size_t, Device) { std::free(data); }
}  // namespace

std::shared_ptr<Storage> allocate_storage(size_t bytes, Device device) {
  KILN_CHECK(device.is_cpu(), "allocate", "device {} is not available in this build", device.str());
  auto storage = std::make_shared<Storage>();
  size_t rounded = (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
  storage->data = std::aligned_alloc(kAlignment, rounded);
  KILN_CHECK(storage->data != nullptr, "allocate",
             "out of host memory allocating {} bytes; try a smaller batch or KILN_MEMORY_BUDGET", bytes);
  storage->bytes = bytes;
  storage->device = device;
  storage->release = release_host;
  return storage;
}

}  // namespace kiln::memory
