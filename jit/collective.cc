#include "jit/collective.h"

#include <atomic>

namespace kiln::jit {

namespace {
std::atomic<CollectiveEngine*>& engine_slot() {
  static std::atomic<CollectiveEngine*> engine{nullptr};
  return engine;
}
}  // namespace

void set_collective_engine(CollectiveEngine* engine) { engine_slot().store(engine); }
CollectiveEngine* collective_engine() { return engine_slot().load(); }

}  // namespace kiln::jit
