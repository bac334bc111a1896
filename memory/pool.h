// The caching pool: keeps freed blocks of an underlying Allocator for reuse, so a kernel output of
// the size just freed costs a set lookup instead of malloc and first-touch page faults.
//
//   kiln::memory::Pool& pool = kiln::memory::device_pool(kiln::Device::cpu());
//   void* p = pool.allocate(bytes);                           // what allocate_storage does
//   pool.release(p);                                          // (its Storage deleter does this)
//   kiln::memory::PoolStats s = kiln::memory::pool_stats();   // allocated, reserved, peaks, ...
//   fmt::print("{}", kiln::memory::memory_summary());         // the same as a table
//   kiln::empty_cache();                                      // give cached segments back
//
// Layout (PyTorch's CUDACachingAllocator, for any Allocator):
//   - sizes are rounded up to 512 B;
//   - small pool: requests <= 1 MiB, carved from 2 MiB segments;
//   - large pool: larger requests; a new segment is the request rounded up to a 2 MiB multiple;
//   - best fit: free blocks in a std::set ordered by (size, address); the block found is split
//     when the rest is worth keeping (any rest in the small pool, >= 1 MiB in the large pool);
//   - a freed block merges with free neighbours of its segment; a segment that is one free block
//     again goes back to the underlying allocator on empty_cache().
// When the underlying allocator refuses, the pool empties its cache and retries once; then it
// throws kiln::Error with a memory report. With flags().debug_memory every freed block is filled
// with 0xFF bytes (NaN as float) so a use after free shows up in results. Thread-safe (one mutex).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/device.h"
#include "memory/allocator.h"

namespace kiln::memory {

// One statistic: its current value, its peak (since creation or reset_peak_stats()), and the
// total ever added.
struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t total = 0;
};

// Byte counts nest: requested <= allocated <= active <= reserved.
struct PoolStats {
  Stat requested;    // bytes callers asked for
  Stat allocated;    // bytes of live allocations, each rounded up to 512 B
  Stat active;       // bytes of the blocks holding them (a large block may keep a tail < 1 MiB)
  Stat reserved;     // bytes of segments taken from the underlying allocator
  Stat segments;     // number of segments
  Stat allocations;  // number of live allocations
  int64_t alloc_retries = 0;       // underlying allocation failed; cache emptied and retried
  int64_t ooms = 0;                // failed again after the retry: threw kiln::Error
  int64_t largest_free_block = 0;  // bytes; the largest request served without a new segment
  // 1 - allocated / reserved: the share of reserved memory not holding live data (0 if none).
  double fragmentation() const;
};

class Pool {
 public:
  static constexpr size_t kRound = 512;               // every size is a multiple of this
  static constexpr size_t kSmallRequest = 1 << 20;    // requests up to this use the small pool
  static constexpr size_t kSmallSegment = 2 << 20;    // small-pool segment size
  static constexpr size_t kLargeSegmentRound = 2 << 20;  // large segments: multiples of this
  static constexpr size_t kMinLargeSplit = 1 << 20;   // large-pool rests below this stay attached

  explicit Pool(Allocator& underlying);
  // Returns every fully free segment; segments that still hold live blocks are leaked.
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // A block of at least `bytes` (512-byte aligned within its 64-byte aligned segment). Throws
  // kiln::Error with a memory report when the underlying allocator refuses twice.
  void* allocate(size_t bytes);
  // Takes back a pointer allocate() returned. Aborts on a pointer it does not know.
  void release(void* p);
  // Returns every segment that is entirely free to the underlying allocator.
  void empty_cache();

  PoolStats stats() const;
  void reset_peak_stats();
  // A short table of the stats, for humans.
  std::string summary() const;
  Allocator& underlying() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// The pool of `device`, created on first use over device_allocator(device); never destroyed.
Pool& device_pool(Device device);

PoolStats pool_stats(Device device = Device::cpu());
// Peaks of every pool and of peak_allocated_bytes() start again from the current values.
void reset_peak_stats();
// Every pool's table plus tensor bytes and the memory limit.
std::string memory_summary();

}  // namespace kiln::memory

namespace kiln {
// Returns the cached, fully free segments of every device pool to their allocators.
void empty_cache();
}  // namespace kiln
