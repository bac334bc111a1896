// The JIT's public face: process-wide counters (kernels compiled and run, cache hits), the kernel
// cache directory, and resetting the caches. The one JIT header a program or a test needs.
//
//   kiln::jit::reset_stats();
//   train_step();
//   fmt::print("{} kernels, {} compiled\n", kiln::jit::stats().kernels_run, kiln::jit::stats().kernels_compiled);
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace kiln::jit {

// The compilers count compiles and cache hits; the executor counts kernels_run, plan_cache_hits,
// plans_built, graphs_rewired and the collectives: those started, and the kernels run while one was in flight
// (the overlap of communication with computation).
struct JitStats {
  int64_t kernels_run = 0;
  int64_t kernels_compiled = 0;
  int64_t functions_compiled = 0;  // distinct functions among them (identical kernels share one)
  int64_t modules_compiled = 0;
  int64_t disk_cache_hits = 0;
  int64_t memory_cache_hits = 0;
  // Modules built in a temporary directory because the cache directory could not be written
  // (full disk, read-only): they live in memory for this process only.
  int64_t cache_write_failures = 0;
  int64_t plan_cache_hits = 0;
  int64_t plans_built = 0;
  // Graphs the recomputation passes rewired (KILN_RECOMPUTE, KILN_MEMORY_BUDGET), by realize (the
  // first run of a graph: its replays run the rewired plan on the graph as collected) and by the
  // executor's lower_for / schedule_for.
  int64_t graphs_rewired = 0;
  double compile_seconds = 0;
  int64_t collectives_started = 0;
  int64_t kernels_during_collectives = 0;
  double collective_wait_seconds = 0;  // blocked in waits for collectives (not hidden by kernels)
  double recv_wait_seconds = 0;        // of which waiting for point-to-point messages (Recv)
  int64_t messages_sent = 0, messages_received = 0;
};

JitStats& stats();
void reset_stats();

// flags().cache_dir, else $HOME/.cache/kiln, else /tmp/kiln-cache; created if missing. Absolute.
std::string cache_directory();

// Forgets every cached plan: the next realize schedules, plans and compiles (or finds compiled
// kernels in the kernel caches) again.
void clear_plan_cache();
size_t plan_cache_size();

// What a training step keeps in memory for its backward, as the scheduler would plan it: the bytes
// of forward values that the gradient kernels of `loss` (with respect to `params`) read from
// memory. Values fused into those kernels are recomputed there and not counted. The step is
// scheduled as a training step runs it (the loss and the gradients in one plan); nothing runs:
// the gradient graph is built with retain_graph and dropped.
struct SavedForBackward {
  int64_t activations = 0;  // values the step computes (activations, casts, compressed copies)
  int64_t inputs = 0;       // realized values the step is given that are not weights (a batch)
  int64_t weights = 0;      // parameters and autocast's low-precision copies of them
};
SavedForBackward saved_for_backward(const Tensor& loss, const std::vector<Tensor>& params);

}  // namespace kiln::jit
