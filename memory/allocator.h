// Allocation of tensor storage: a small Allocator interface, the host allocator, and the one entry
// point every op and the executor call.
//
//   auto s = kiln::memory::allocate_storage(bytes, kiln::Device::cpu());  // pooled by default
//   s.reset();                                    // goes back to the allocator that made it
//   kiln::flags().memory_pool = kiln::MemoryPool::None;  // later allocations: plain aligned_alloc
//
// Stacking: allocate_storage -> Pool (memory/pool.h, caching, per device) -> Allocator of the
// device (host_allocator() for the CPU; the CUDA allocator implements the same interface).
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/node.h"

namespace kiln::memory {

// Raw memory of one device. allocate() returns nullptr when the memory is not available (out of
// memory, or over KILN_MEMORY_LIMIT); it never throws for that. release() takes back a pointer
// this allocator returned, with the same byte count. Implementations are thread-safe.
struct Allocator {
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* p, size_t bytes) = 0;
  virtual const char* name() const = 0;
  // Sets every byte of [p, p + bytes), memory this allocator returned, to `value`: how
  // KILN_DEBUG_MEMORY poisons freed blocks (host memory by memset, device memory on its stream).
  virtual void fill(void* p, int value, size_t bytes);
  // Copies between host memory and memory this allocator returned (host: memcpy; a device: on
  // its stream, copy_to_host returning once `dst` holds the data).
  virtual void copy_from_host(void* dst, const void* src, size_t bytes);
  virtual void copy_to_host(void* dst, const void* src, size_t bytes);
  virtual ~Allocator();
};

// Host memory, 64-byte aligned (cache line, AVX-512 loads). Counts the bytes it hands out and
// refuses an allocation that would take that count past flags().memory_limit.
class HostAllocator final : public Allocator {
 public:
  static constexpr size_t kAlignment = 64;
  void* allocate(size_t bytes) override;
  void release(void* p, size_t bytes) override;
  const char* name() const override { return "host"; }
  // Bytes currently handed out (rounded up to kAlignment).
  int64_t bytes_in_use() const;

 private:
  std::atomic<int64_t> in_use_{0};
};

// The process-wide host allocator (never destroyed, so storages freed at exit stay valid).
HostAllocator& host_allocator();

// The raw allocator of `device`; throws kiln::Error for a device this build cannot allocate on.
Allocator& device_allocator(Device device);

// flags().memory_limit in bytes; 0 when no limit is set.
int64_t memory_limit_bytes();

// A new Storage of `bytes` on `device`, freed when the last reference goes. flags().memory_pool,
// read now, picks the pool (default) or the device allocator directly; the Storage goes back to
// the one that made it whatever the flag says later. Throws kiln::Error with a memory report when
// the memory is not available.
std::shared_ptr<Storage> allocate_storage(size_t bytes, Device device);

// Bytes of tensor storage currently allocated (requested sizes, pooled or not) and the peak since
// start or the last reset_peak_stats() (memory/pool.h).
int64_t allocated_bytes();
int64_t peak_allocated_bytes();
void reset_peak_allocated_bytes();

// "512 B", "1.5 KiB", "64.0 MiB": byte counts for humans (reports, errors).
std::string format_bytes(int64_t bytes);

}  // namespace kiln::memory
