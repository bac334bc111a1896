// Scheduling: which nodes of a pending graph get a buffer of their own (and so a kernel), and
// which fuse into the kernels that read them. jit/lower.h turns the decisions into kernels.
#pragma once
#include <vector>

#include "jit/collect.h"

namespace kiln::jit {

struct Schedule {
  std::vector<bool> materialized;  // per node: gets a buffer, written by its own kernel
  std::vector<int> alias_base;     // per node: the node whose buffer an alias output shares, or -1
};

// A node is materialized when it is an output, a reduction, a library op (matmul, convolutions),
// a convolution operand (contiguous, reshapes aside), a scatter, the source of a gather, a matmul
// operand that is not a strided view of a buffer, or read by several consumers and more expensive
// than a few elementwise ops to recompute. An output that only reshapes a buffer shares it.
Schedule schedule(const PendingGraph& graph);

}  // namespace kiln::jit
