// From a realize call's pending graph to an ordered list of kernels: collects the unrealized
// subgraph in a canonical order (whose structural key selects a cached plan), decides which
// nodes are materialized, and fuses everything else into the kernels that consume it.
#pragma once
#include <string>
#include <vector>

#include "core/node.h"
#include "jit/kernel_ir.h"

namespace kiln::jit {

struct PendingGraph {
  std::vector<NodePtr> nodes;      // unrealized nodes, inputs before consumers
  std::vector<NodePtr> externals;  // realized nodes read by them, in first-use order
  std::vector<int> outputs;        // positions in `nodes` left realized after the run
  std::vector<int> external_edges; // per external: input edges from `nodes` pointing at it
  std::vector<int> replaced_external;  // per output: the external it replaces (assign), or -1
  std::string key;                 // structure only: ops, shapes, dtypes, attributes, wiring
};

// Walks back from `targets` to realized nodes. Besides the targets, nodes still held by a user
// handle are kept as outputs (except cheap views and constants), so nothing computed is redone.
PendingGraph collect_pending(const std::vector<NodePtr>& targets);

// A buffer of the plan: an external input, or the result of a materialized node.
struct PlanSlot {
  int external = -1;  // position in PendingGraph::externals
  int node = -1;      // position in PendingGraph::nodes
  DType dtype = DType::Float32;
  int64_t numel = 0;
  bool output = false;  // attached to its node after the run
  bool keep = false;    // survives the run (an output, or the buffer an alias output shares)
};

// An output that is a reshape of a materialized node shares that node's buffer: no copy.
struct PlanAlias {
  int node;  // position in PendingGraph::nodes
  int slot;  // the buffer it shares
};

struct Schedule {
  std::vector<PlanSlot> slots;
  std::vector<Kernel> kernels;
  std::vector<int> scalar_nodes;  // node position giving each float scalar (Full values)
  std::vector<int> rand_nodes;    // node position giving each Rand seed/offset pair
  std::vector<PlanAlias> aliases;
};

Schedule schedule(const PendingGraph& graph);

}  // namespace kiln::jit
