// libFuzzer target: optimizer and GradScaler state files (optim/serialize.h), loaded into SGD
// with momentum, Adam, and Adam with a GradScaler, each over the parameters of a small fixed
// model; the seeds are files those optimizers saved after a step (corpus/optim_state).
#include <kiln/kiln.h>

#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/fuzz_models.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln;
  static fuzz::Optimizers o;  // built once: load replaces the whole state or nothing
  fuzz::MemoryFile file(data, size);
  fuzz::expect_only_kiln_errors([&] { optim::load(o.sgd, file.path()); });
  fuzz::expect_only_kiln_errors([&] { optim::load(o.adam, file.path()); });
  fuzz::expect_only_kiln_errors([&] { optim::load(o.adam, o.scaler, file.path()); });
  return 0;
}
