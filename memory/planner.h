// The memory planner: given every intermediate buffer of a plan with its live interval over the
// kernel order, assigns offsets in one arena so buffers alive at the same time never overlap,
// reusing an input's memory for an output in place where the executor allows it.
//
//   std::vector<kiln::memory::BufferRequest> requests = ...;  // bytes, first and last kernel
//   kiln::memory::MemoryPlan plan = kiln::memory::plan_memory(requests);
//   void* buffer_i = arena_base + plan.offsets[i];           // plan.arena_bytes in all
#pragma once
#include <cstdint>
#include <vector>

namespace kiln::memory {

struct BufferRequest {
  int64_t bytes = 0;
  int first = 0;        // kernel that writes it
  int last = 0;         // last kernel that reads it (>= first)
  int in_place_of = -1; // a request whose memory this one may take over: that buffer's last use
                        // is this one's first kernel, which reads it only at the index it writes
};

struct MemoryPlan {
  std::vector<int64_t> offsets;  // per request, in bytes from the arena base (64-byte aligned)
  int64_t arena_bytes = 0;
  // The largest total of bytes live during any one kernel: no arena can be smaller.
  int64_t lower_bound = 0;
  int in_place = 0;              // requests that share their input's memory
  // Per request: a later request took its memory over in place, so it does not die at its last
  // use (its bytes live on in the taker).
  std::vector<bool> handed_on;
};

// Greedy (Pisarchyk & Lee 2020): buffers are placed one by one, each at the best-fitting gap
// among the already placed buffers whose lifetimes overlap it, the largest first; when that
// misses the lower bound, the largest by bytes x lifetime first, then the longest-lived first,
// and the smallest arena of these is kept.
MemoryPlan plan_memory(const std::vector<BufferRequest>& requests);

}  // namespace kiln::memory
