#include "memory/allocator.h"

#include <atomic>
#include <cstdlib>
#include <new>

#include "core/error.h"

namespace kiln::memory {

namespace {
constexpr size_t kAlignment = 64;

std::atomic<int64_t> g_allocated{0};
std::atomic<int64_t> g_peak{0};

void release_host(void* data, size_t bytes, Device) {
  g_allocated -= static_cast<int64_t>(bytes);
  std::free(data);
}
}  // namespace

int64_t allocated_bytes() { return g_allocated; }
int64_t peak_allocated_bytes() { return g_peak; }

std::shared_ptr<Storage> allocate_storage(size_t bytes, Device device) {
  KILN_CHECK(device.is_cpu(), "allocate", "device {} is not available in this build", device.str());
  auto storage = std::make_shared<Storage>();
  size_t rounded = (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
  storage->data = std::aligned_alloc(kAlignment, rounded);
  KILN_CHECK(storage->data != nullptr, "allocate",
             "out of host memory allocating {} bytes; try a smaller batch or KILN_MEMORY_BUDGET", bytes);
  storage->bytes = bytes;
  int64_t now = g_allocated += static_cast<int64_t>(bytes);
  int64_t peak = g_peak;
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
  storage->device = device;
  storage->release = release_host;
  return storage;
}

}  // namespace kiln::memory
