// libFuzzer target: IDX files (the MNIST family's format), plain or gzip-compressed, through
// nn::data::read_idx. A file it accepts must hold exactly the bytes its dims promise.
// Seeds: corpus/idx.
#include <kiln/kiln.h>

#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kiln::fuzz::MemoryFile file(data, size);
  kiln::fuzz::expect_only_kiln_errors([&] {
    kiln::nn::data::IdxArray array = kiln::nn::data::read_idx(file.path());
    size_t expected = 1;
    for (int64_t d : array.dims) {
      if (d < 0) std::abort();
      expected *= static_cast<size_t>(d);
    }
    if (expected != array.data.size()) {
      std::fprintf(stderr, "fuzz: read_idx accepted dims promising %zu bytes with %zu bytes of data\n", expected,
                   array.data.size());
      std::abort();
    }
  });
  return 0;
}
