#include "backends/cuda/staging_ring.h"

#include "core/error.h"

namespace kiln::cuda {

void StagingRing::pop() {
  in_use_.pop_front();
  if (in_use_.empty()) head_ = 0;  // nothing in flight: start again from the beginning
}

size_t StagingRing::reserve(size_t bytes, const std::function<void(void*)>& wait) {
  KILN_CHECK(bytes > 0 && bytes <= capacity_, "staging", "a region of {} bytes does not fit a staging buffer of {} "
             "bytes; copy in pieces", bytes, capacity_);
  for (;;) {
    if (in_use_.empty()) return head_ = 0;
    const size_t tail = in_use_.front().begin;
    // In use: [tail, head_) when tail < head_, else [tail, capacity) and [0, head_) (all of it
    // when tail == head_: the ring is full).
    if (tail < head_) {
      if (head_ + bytes <= capacity_) return head_;
      if (bytes <= tail) return head_ = 0;  // skip the end of the buffer
    } else if (tail > head_ && head_ + bytes <= tail) {
      return head_;
    }
    wait(in_use_.front().token);
    pop();
  }
}

void StagingRing::commit(size_t offset, size_t bytes, void* token) {
  in_use_.push_back({offset, offset + bytes, token});
  head_ = offset + bytes;
}

void StagingRing::reclaim(const std::function<bool(void*)>& done) {
  while (!in_use_.empty() && done(in_use_.front().token)) pop();
}

}  // namespace kiln::cuda
