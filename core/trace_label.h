// Names for what a program records next ("forward 3", "backward 3"), carried by the nodes into
// the kernels that compute them, so that a trace (memory::export_trace) and KILN_LOG=2 show which
// part of a step each kernel belongs to. Cosmetic: labels are not part of a plan's identity, and a
// replayed plan shows the labels of the graph it was built from.
//
//   { kiln::TraceLabel label("forward"); y = model.forward(x); }
#pragma once
#include <cstdint>
#include <string>

namespace kiln {

class TraceLabel {
 public:
  explicit TraceLabel(const std::string& name);
  ~TraceLabel();
  TraceLabel(const TraceLabel&) = delete;
  TraceLabel& operator=(const TraceLabel&) = delete;

 private:
  uint32_t previous_;
};

// The label nodes recorded now get (0: none), and the name of a label (empty for 0).
uint32_t current_trace_label();
std::string trace_label_name(uint32_t label);

}  // namespace kiln
