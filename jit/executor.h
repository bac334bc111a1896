// The executor: realize(targets) takes every pending node they need, finds or builds a plan
// (schedule + compiled kernels) keyed by the graph's structure, binds this run's data and runs
// it. A repeated training step hits the plan cache and skips scheduling and compiling.
#pragma once
#include <string>
#include <vector>

#include "core/node.h"
#include "jit/schedule.h"
#include "jit/stats.h"
#include "memory/profile.h"

namespace kiln::jit {

void realize(const std::vector<NodePtr>& targets);

// The kernels a realize of `targets` would run (before any KILN_MEMORY_BUDGET rewrite), scheduled
// but neither compiled nor run: nothing is realized. For renderers' tests and tools.
Schedule schedule_for(const std::vector<NodePtr>& targets);

// The memory layout of the plan the most recent realize call ran.
memory::PlanLayout last_plan_memory();

}  // namespace kiln::jit
