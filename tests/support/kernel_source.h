// Test helper: the C++ text the CPU backend renders for the first kernel that computes a tensor,
// for tests that check what the JIT emits (streamed stores, roundings left out).
#pragma once
#include <kiln/kiln.h>

#include <string>
#include <vector>

#include "backends/cpu/render_cpp.h"
#include "jit/executor.h"

namespace kiln::testing {

inline std::string cpu_source_of(const Tensor& t) {
  std::vector<NodePtr> targets = {t.node()};
  return cpu::render_cpp(jit::lower_for(targets).kernels).functions.at(0);
}

}  // namespace kiln::testing
