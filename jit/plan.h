// Planning: from a lowered program to a plan the executor only binds and runs. Decides each
// buffer's life over the kernel order (row groups run as one kernel), the arena offsets of the
// intermediates (memory/planner.h), which ranges die after each kernel, and which parameter
// updates may overwrite their old value in place.
#pragma once
#include <memory>
#include <utility>
#include <vector>

#include "jit/backend.h"
#include "jit/collect.h"
#include "jit/lower.h"
#include "memory/planner.h"
#include "memory/profile.h"

namespace kiln::jit {

struct Plan {
  Device device;
  const Backend* backend = nullptr;
  Program program;
  // Per kernel, the first kernel of its row group (Backend::row_groups), itself when alone; empty
  // when the backend has none. A group runs as one function, so memory is planned as if it were
  // one kernel.
  std::vector<int> group_start;
  std::vector<int> last_use;    // per slot: last kernel reading or writing it
  std::vector<int64_t> offset;  // per slot: arena offset of an intermediate, -1 otherwise
  memory::MemoryPlan memory;
  // Offloaded activations' host copies (jit/offload.h): per slot, the offset in the host arena
  // (-1 for other slots), and the host arena, allocated by the first run and kept for the next.
  std::vector<int64_t> host_offset;
  memory::MemoryPlan host_memory;
  mutable std::shared_ptr<void> host_arena;
  // Per kernel: arena ranges {offset, bytes} whose buffers die there (poisoned under
  // KILN_DEBUG_MEMORY).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> dies_after;
  int64_t output_bytes = 0;
  // Parameter updates whose result may overwrite the old value's buffer: {output slot, external
  // slot}. Legal for the plan's structure; the executor also checks on every run that nobody
  // else can see the old value.
  std::vector<std::pair<int, int>> updates;
  int last_fallible = -1;  // the last kernel that may report a bad index; -1 when none can
  std::shared_ptr<memory::PlanLayout> info = std::make_shared<memory::PlanLayout>();
  // The backend's; null until compiled, or when all are library calls. Shared with the plan's
  // copy that replays a rewired graph on the graph as collected (jit/executor.cc).
  std::shared_ptr<CompiledKernels> kernels;
};

// Plans `program` (lowered from `graph`) for `device`; the kernels are not compiled yet.
// `budget`: the arena bytes KILN_MEMORY_BUDGET allows (-1: none), which KILN_OFFLOAD=auto offloads
// saved activations to meet (jit/offload.h).
std::unique_ptr<Plan> make_plan(const PendingGraph& graph, Program program, Device device, int64_t budget = -1);

// The memory of a graph's plan: scheduled, lowered and planned (offloading as make_plan would),
// not compiled (the budget pass weighs several rewrites of one graph).
std::shared_ptr<memory::PlanLayout> planned_memory(const PendingGraph& graph, int64_t budget = -1);
inline int64_t planned_arena(const PendingGraph& graph, int64_t budget = -1) {
  return planned_memory(graph, budget)->arena_bytes;
}

}  // namespace kiln::jit
