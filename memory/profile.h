// What the memory tools read: the layout of each plan the executor built (its arena, every
// intermediate's offset and lifetime) and, while tracing, a timeline of kernels with memory use.
// The executor writes these; memory/report.h turns them into a report, a trace and pictures.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kiln::memory {

struct PlannedBuffer {
  int64_t offset = 0, bytes = 0;
  int first = 0, last = 0;  // kernels that write it and last read it
  int in_place_of = -1;     // index of the buffer whose memory it took over, if any
  std::string made_by;      // summary of the kernel that writes it
};

// One plan's memory: intermediates share an arena; outputs (results kept by tensors) do not.
struct PlanLayout {
  std::vector<std::string> kernels;  // kernel summaries in run order
  std::vector<PlannedBuffer> buffers;
  int64_t arena_bytes = 0;
  int64_t lower_bound = 0;   // most bytes live during one kernel
  int64_t working_set = 0;   // most arena bytes one kernel reads and writes (what no plan goes below)
  int working_set_kernel = -1;
  int64_t output_bytes = 0;
  uint64_t runs = 0;         // how many times the plan ran
  // Saved activations the plan keeps compressed (memory/compress.h): how many, their bytes at
  // full width, and the bytes kept instead.
  int compressed_values = 0;
  int64_t compressed_from = 0, compressed_to = 0;
  // Saved activations the backward recomputes instead (KILN_RECOMPUTE, KILN_MEMORY_BUDGET; not
  // checkpoint segments): how many, their bytes (some of which the scheduler would have fused
  // rather than stored anyway), and the elements the copies compute (one per op: the extra work,
  // mostly elementwise).
  int recomputed_values = 0;
  int64_t recomputed_bytes = 0, recomputed_elements = 0;
  // The work of the step and of its copies (memory::node_flops), and, from the last run timed
  // (KILN_LOG=2 or a trace), the time of its kernels and of those that only make copies.
  int64_t step_flops = 0, recomputed_flops = 0;
  double kernel_us = 0, recompute_us = 0;
  // Saved activations offloaded to host memory between forward and backward (jit/offload.h):
  // how many, their bytes, the host arena holding them, and the time of the waits for the
  // copies in the last run timed.
  int offloaded_values = 0;
  int64_t offloaded_bytes = 0, host_arena_bytes = 0;
  double offload_wait_us = 0;
};

// Called by the executor when it builds a plan; the most recent plans are kept for reports.
void note_plan(std::shared_ptr<PlanLayout> layout);
std::vector<std::shared_ptr<const PlanLayout>> recent_plans();
std::shared_ptr<const PlanLayout> last_plan();  // the plan the most recent realize ran
void note_plan_run(const std::shared_ptr<PlanLayout>& layout);

struct KernelEvent {
  std::string name;
  std::string label;     // core/trace_label.h; the trace puts each label's first word on a row of its own
  bool message = false;  // a collective or a wait for one: the trace's "communication" row
  double start_us = 0, duration_us = 0;  // since the trace started
  int64_t tensor_bytes = 0;              // allocated tensor bytes after the kernel
  int64_t reserved_bytes = 0;            // pool reserve after the kernel
};

// Timeline recording (off by default: it costs a clock read and a push per kernel).
void start_trace();
void stop_trace();
bool tracing();
double trace_clock_us();  // microseconds since start_trace()
void record_kernel(KernelEvent event);
// The trace's process name ("kiln" until set): distributed code names the rank and stage.
void set_trace_process_name(const std::string& name);
std::string trace_process_name();
std::vector<KernelEvent> trace_events();

}  // namespace kiln::memory
