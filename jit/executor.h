// The executor: realize(targets) takes every pending node they need, finds or builds a plan
// (schedule, kernels, memory plan, compiled code) keyed by the graph's structure, binds this
// run's data and runs it. A repeated training step hits the plan cache and skips everything else.
#pragma once
#include <string>
#include <vector>

#include "core/node.h"
#include "jit/lower.h"
#include "jit/schedule.h"
#include "jit/stats.h"
#include "memory/profile.h"

namespace kiln::jit {

void realize(const std::vector<NodePtr>& targets);

// The kernels a realize of `targets` would run (before any KILN_MEMORY_BUDGET rewrite), lowered
// but neither planned, compiled nor run: nothing is realized. For renderers' tests and tools.
Program lower_for(const std::vector<NodePtr>& targets);

// The pending graph of `targets` and its fusion decisions, as a realize would make them (before
// any KILN_MEMORY_BUDGET rewrite), collected under the executor's lock. For tools that inspect a
// step without running it (jit::saved_for_backward).
struct ScheduledGraph {
  PendingGraph graph;
  Schedule schedule;
};
ScheduledGraph schedule_for(const std::vector<NodePtr>& targets);

// The memory layout of the plan the most recent realize call ran.
memory::PlanLayout last_plan_memory();

}  // namespace kiln::jit
