#include "jit/stats.h"

namespace kiln::jit {

JitStats& stats() {
  static JitStats counters;
  return counters;
}

void reset_stats() { stats() = JitStats{}; }

}  // namespace kiln::jit
