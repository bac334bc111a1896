// Lowering: each materialized node of a scheduled graph becomes one kernel of the backend-neutral
// IR (jit/kernel_ir.h), with the fused nodes under it inlined as per-element values; buffers
// become plan slots, constants and random generators bound scalars.
#pragma once
#include <vector>

#include "jit/collect.h"
#include "jit/kernel_ir.h"
#include "jit/schedule.h"

namespace kiln::jit {

// A buffer of the plan: an external input, or the result of a materialized node.
struct PlanSlot {
  int external = -1;  // position in PendingGraph::externals
  int node = -1;      // position in PendingGraph::nodes
  DType dtype = DType::Float32;
  int64_t numel = 0;
  bool output = false;  // attached to its node after the run
  bool keep = false;    // survives the run (an output, or the buffer an alias output shares)
  bool host = false;    // an offloaded activation's copy in pinned host memory (jit/offload.h)
};

// An output that is a reshape of a materialized node shares that node's buffer: no copy.
struct PlanAlias {
  int node;  // position in PendingGraph::nodes
  int slot;  // the buffer it shares
};

// The kernels of one graph, in order, and what they read and write.
struct Program {
  std::vector<PlanSlot> slots;
  std::vector<Kernel> kernels;
  std::vector<int> scalar_nodes;  // node position giving each float scalar (Full values)
  std::vector<int> rand_nodes;    // node position giving each Rand seed/offset pair
  std::vector<PlanAlias> aliases;
};

// Whether every read of kernel buffer `b` in `k` is a plain load of the element `k` stores (each
// element is read before it is written, and no other element is read).
bool reads_at_store_index(const Kernel& k, int b);

// A matmul operand that turns out not to be a strided view of a buffer (a reshape that mixes
// dimensions) is given a buffer of its own: `schedule` is amended and lowering starts over.
Program lower(const PendingGraph& graph, Schedule schedule);

}  // namespace kiln::jit
