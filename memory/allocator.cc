#include "memory/allocator.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/flags.h"
#include "backends/cuda/cuda_allocator.h"
#include "memory/pool.h"

namespace kiln::memory {

Allocator::~Allocator() = default;
void Allocator::fill(void* p, int value, size_t bytes) { std::memset(p, value, bytes); }
void Allocator::copy_from_host(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
void Allocator::copy_to_host(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }

namespace {

size_t host_rounded(size_t bytes) {
  constexpr size_t a = HostAllocator::kAlignment;
  return (std::max<size_t>(bytes, 1) + a - 1) / a * a;
}

std::atomic<int64_t> g_allocated{0};
std::atomic<int64_t> g_peak{0};

void count_allocated(size_t bytes) {
  int64_t now = g_allocated += static_cast<int64_t>(bytes);
  int64_t peak = g_peak;
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

// Storage deleters: the allocator that made a Storage is fixed by which of these it holds.
void release_pooled(void* data, size_t bytes, Device device) {
  g_allocated -= static_cast<int64_t>(bytes);
  device_pool(device).release(data);
}

void release_direct(void* data, size_t bytes, Device device) {
  g_allocated -= static_cast<int64_t>(bytes);
  if (device.is_cpu() && flags().debug_memory) std::memset(data, 0xFF, bytes);
  device_allocator(device).release(data, bytes);
}

}  // namespace

int64_t memory_limit_bytes() {
  const std::string& limit = flags().memory_limit;
  return limit.empty() ? 0 : parse_size(limit, "memory_limit");
}

void* HostAllocator::allocate(size_t bytes) {
  const size_t rounded = host_rounded(bytes);
  const int64_t n = static_cast<int64_t>(rounded);
  const int64_t limit = memory_limit_bytes();
  int64_t now = in_use_ += n;  // claim first, so concurrent callers cannot both pass the check
  if (limit > 0 && now > limit) {
    in_use_ -= n;
    return nullptr;
  }
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (!p) in_use_ -= n;
  return p;
}

void HostAllocator::release(void* p, size_t bytes) {
  if (!p) return;
  in_use_ -= static_cast<int64_t>(host_rounded(bytes));
  std::free(p);
}

int64_t HostAllocator::bytes_in_use() const { return in_use_; }

HostAllocator& host_allocator() {
  static auto* host = new HostAllocator;  // never destroyed: storages may be freed during exit
  return *host;
}

Allocator& device_allocator(Device device) {
  if (device.is_cpu()) return host_allocator();
  return cuda::device_allocator(device);
}

std::shared_ptr<Storage> allocate_storage(size_t bytes, Device device) {
  auto storage = std::make_shared<Storage>();
  if (flags().memory_pool == MemoryPool::Pool) {
    storage->data = device_pool(device).allocate(bytes);  // throws with the pool's report
    storage->release = release_pooled;
  } else {
    Allocator& allocator = device_allocator(device);
    storage->data = allocator.allocate(bytes);
    if (!storage->data) {
      int64_t limit = memory_limit_bytes();
      KILN_FAIL("memory",
                "out of memory: cannot allocate {} on {} from the {} allocator (KILN_MEMORY_POOL=none); "
                "{} of host memory in use{}.\n"
                "  try: KILN_MEMORY_BUDGET (e.g. 0.5) so plans recompute activations instead of keeping them; "
                "kiln::checkpoint around layers; a smaller batch",
                format_bytes(static_cast<int64_t>(bytes)), device.str(), allocator.name(),
                format_bytes(host_allocator().bytes_in_use()),
                limit > 0 ? fmt::format(", KILN_MEMORY_LIMIT={} ({})", flags().memory_limit, format_bytes(limit))
                          : std::string());
    }
    storage->release = release_direct;
  }
  storage->bytes = bytes;
  storage->device = device;
  count_allocated(bytes);
  return storage;
}

int64_t allocated_bytes() { return g_allocated; }
int64_t peak_allocated_bytes() { return g_peak; }
void reset_peak_allocated_bytes() { g_peak = g_allocated.load(); }

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  int64_t magnitude = bytes < 0 ? -bytes : bytes;
  if (magnitude < 1024) return fmt::format("{} B", bytes);
  double v = static_cast<double>(bytes) / 1024;
  int unit = 0;
  while (unit < 3 && (v >= 1024 || v <= -1024)) {
    v /= 1024;
    ++unit;
  }
  return fmt::format("{:.1f} {}", v, units[unit]);
}

}  // namespace kiln::memory
