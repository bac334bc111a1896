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
  std::unique_ptr<CompiledKernels> kernels;  // the backend's; null until compiled, or when all are library calls
};

// Plans `program` (lowered from `graph`) for `device`; the kernels are not compiled yet.
std::unique_ptr<Plan> make_plan(const PendingGraph& graph, Program program, Device device);

// The memory of a graph's plan: scheduled, lowered and planned, not compiled (the budget pass
// weighs several rewrites of one graph).
std::shared_ptr<memory::PlanLayout> planned_memory(const PendingGraph& graph);
inline int64_t planned_arena(const PendingGraph& graph) { return planned_memory(graph)->arena_bytes; }

}  // namespace kiln::jit
