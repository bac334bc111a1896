// The executor: realize(targets) takes every pending node they need, finds or builds a plan
// (schedule + compiled kernels) keyed by the graph's structure, binds this run's data and runs
// it. A repeated training step hits the plan cache and skips scheduling and compiling.
#pragma once
#include <string>
#include <vector>

#include "core/node.h"

namespace kiln::jit {

void realize(const std::vector<NodePtr>& targets);

// Where a plan's intermediates live: one arena, offsets chosen by the memory planner.
struct PlannedBuffer {
  int64_t offset = 0, bytes = 0;
  int first = 0, last = 0;  // kernels that write it and last read it
  int in_place_of = -1;     // index of the buffer whose memory it took over, if any
  std::string made_by;      // summary of the kernel that writes it
};
struct PlanMemoryInfo {
  std::vector<std::string> kernels;  // kernel summaries in run order
  std::vector<PlannedBuffer> buffers;
  int64_t arena_bytes = 0;
  int64_t lower_bound = 0;   // most bytes live during one kernel
  int64_t output_bytes = 0;  // buffers that outlive the run (results kept by tensors)
};
// The memory layout of the plan the most recent realize call ran.
PlanMemoryInfo last_plan_memory();
void clear_plan_cache();
size_t plan_cache_size();

}  // namespace kiln::jit
