// Collecting: from a realize call's targets to the pending graph, every unrealized node they need
// in one canonical order, with the structural key that selects a cached plan.
#pragma once
#include <string>
#include <vector>

#include "core/node.h"

namespace kiln::jit {

struct PendingGraph {
  std::vector<NodePtr> nodes;      // unrealized nodes, inputs before consumers
  std::vector<NodePtr> externals;  // realized nodes read by them, in first-use order
  std::vector<int> outputs;        // positions in `nodes` left realized after the run
  std::vector<int> external_edges; // per external: input edges from `nodes` pointing at it
  std::vector<int> replaced_external;  // per output: the external it replaces (assign), or -1
  std::string key;                 // structure only: ops, shapes, dtypes, devices, attributes, wiring
};

// Walks back from `targets` to realized nodes. Besides the targets, nodes still held by a user
// handle are kept as outputs (except cheap views and constants), so nothing computed is redone.
PendingGraph collect_pending(const std::vector<NodePtr>& targets);

}  // namespace kiln::jit
