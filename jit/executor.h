// The executor: realize(targets) takes every pending node they need, finds or builds a plan
// (schedule, kernels, memory plan, compiled code) keyed by the graph's structure, binds this
// run's data and runs it. A repeated training step hits the plan cache and skips everything else.
#pragma once
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/node.h"
#include "jit/lower.h"
#include "jit/schedule.h"
#include "jit/stats.h"
#include "memory/profile.h"

namespace kiln::jit {

struct Plan;  // jit/plan.h

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

// A realize kept for replay: a training step recorded once and then run again on new values
// without recording it. The plan it ran (owned by the plan cache) and, in each of the plan's
// binding orders, the node it bound. The addresses identify the captured run's nodes only while
// their owners hold them; only held_externals and the prototypes are owning references (drop
// the held externals you do not need: they pin memory, and an update cannot run in place over a
// value they hold). Random keys are as the run drew them: a recomputed copy of a draw has its
// key, a draw the plan did not need has none.
struct CapturedRun {
  struct Value {
    const Node* node;  // identity at capture
    const void* data;  // its buffer's (a realized node may share another's buffer: autocast's copies)
    Shape shape;
    DType dtype;
    Device device;
  };
  const Plan* plan = nullptr;
  uint64_t generation = 0;                     // the plan cache's, when captured
  std::vector<Value> externals;                // the realized values it read
  std::vector<const Node*> scalar_nodes;       // Full nodes whose values it bound
  std::vector<uint64_t> scalar_ids;            //   their ids (recording order)
  std::vector<double> scalars;                 //   and those values
  std::vector<std::pair<uint64_t, uint64_t>> random;  // the seed and offset of each Rand* node it bound
  std::vector<const Node*> outputs;            // the nodes it gave values to
  std::vector<NodePtr> prototypes;             // per output: a copy without inputs or storage
  // Per external, the value where something besides the run still held it afterwards (a
  // constant the step reads), else null: for the caller to keep what it needs and drop the rest.
  std::vector<NodePtr> held_externals;
};

// realize(targets), kept for replay; nullopt, with the reason in `why`, where the run cannot be
// replayed (targets on several devices, the plan cache off, nothing pending). Either way the
// targets are realized.
std::optional<CapturedRun> realize_captured(const std::vector<NodePtr>& targets, std::string& why);

// While one lives on a thread, every realize that thread makes (its own, an optimizer's step, a
// sync) is kept for replay: runs() in the order they ran, and why_not() for those that cannot be
// replayed. Scopes do not nest.
class CaptureScope {
 public:
  CaptureScope();
  ~CaptureScope();
  CaptureScope(const CaptureScope&) = delete;
  CaptureScope& operator=(const CaptureScope&) = delete;
  const std::vector<CapturedRun>& runs() const { return runs_; }
  const std::vector<std::string>& why_not() const { return why_not_; }

 private:
  friend void realize(const std::vector<NodePtr>& targets);
  std::vector<CapturedRun> runs_;
  std::vector<std::string> why_not_;
};

// Changes when the plan cache is cleared: a CapturedRun of another generation cannot be replayed.
uint64_t plan_cache_generation();

// A replay's values, in the CapturedRun's orders: each external realized, of the captured shape,
// dtype and device.
struct ReplayBindings {
  std::vector<NodePtr> externals;
  std::vector<double> scalars;
  std::vector<std::pair<uint64_t, uint64_t>> random;
};

// Runs the captured plan on `bindings`: the results, in CapturedRun::outputs order, as new
// realized nodes (the prototypes' op, type and autograd marks; no inputs). A parameter update
// writes over its old value's buffer only where `bindings` and at most one Var hold that value,
// so the caller points that Var at the result. An Error (a binding of another type, a plan the
// cache dropped, a failed kernel) leaves every value as it was.
std::vector<NodePtr> replay(const CapturedRun& run, ReplayBindings bindings);

// The memory layout of the plan the most recent realize call ran.
memory::PlanLayout last_plan_memory();

}  // namespace kiln::jit
