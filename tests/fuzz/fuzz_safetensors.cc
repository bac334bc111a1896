// libFuzzer target: safetensors files, as kiln's readers meet them. The bytes are read with
// nn::load_tensors (any tensors, kiln's or foreign files) and with nn::load into a small module
// (strict and not), whose parameters and buffers the seed checkpoints match, so mutations reach
// the shape, dtype and key checks as well as the header parser. Seeds: corpus/safetensors.
#include <kiln/kiln.h>

#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/fuzz_models.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln;
  static fuzz::CheckpointNet net;  // built once: load replaces every value or none
  fuzz::MemoryFile file(data, size);
  fuzz::expect_only_kiln_errors([&] {
    nn::Metadata metadata;
    nn::TensorMap tensors = nn::load_tensors(file.path(), &metadata);
    // Every element read back through kiln's own conversion: a tensor must hold what its shape
    // and dtype promise.
    double sum = 0;
    for (const auto& [name, t] : tensors)
      for (int64_t i = 0; i < t.numel(); ++i) sum += load_as_double(t.data(), t.dtype(), static_cast<size_t>(i));
    (void)sum;
  });
  fuzz::expect_only_kiln_errors([&] { nn::load(net, file.path(), /*strict=*/true); });
  fuzz::expect_only_kiln_errors([&] { nn::load(net, file.path(), /*strict=*/false); });
  return 0;
}
