// Where in a circular staging buffer the next copy goes: each copy takes one contiguous region
// that no copy still in flight uses, and the oldest copies are waited for only when the buffer
// has no room. The host-to-device copies of backends/cuda/cuda_runtime.h stage through pinned memory
// this way, so the host returns as soon as its bytes are in the buffer.
//
//   StagingRing ring(64 << 20);
//   size_t at = ring.reserve(n, [](void* event) { wait for event; });
//   memcpy(buffer + at, src, n); queue the copy from buffer + at; record `event` after it;
//   ring.commit(at, n, event);
#pragma once
#include <cstddef>
#include <deque>
#include <functional>

namespace kiln::cuda {

class StagingRing {
 public:
  explicit StagingRing(size_t capacity) : capacity_(capacity) {}

  // Offset of `bytes` (1 to capacity()) free bytes. Regions still in use are handed to `wait`,
  // oldest first, until the request fits; each is free once `wait` returns.
  size_t reserve(size_t bytes, const std::function<void(void* token)>& wait);
  // Marks the region reserve() just returned as in use until `token` has been waited for.
  void commit(size_t offset, size_t bytes, void* token);
  // Frees, oldest first, the regions `done` says are finished; stops at the first that is not.
  void reclaim(const std::function<bool(void* token)>& done);

  size_t capacity() const { return capacity_; }
  size_t regions_in_use() const { return in_use_.size(); }

 private:
  struct Region {
    size_t begin, end;
    void* token;
  };
  void pop();

  size_t capacity_;
  size_t head_ = 0;            // where the next region starts, unless it must wrap to 0
  std::deque<Region> in_use_;  // in allocation order: the arc from front().begin to head_
};

}  // namespace kiln::cuda
