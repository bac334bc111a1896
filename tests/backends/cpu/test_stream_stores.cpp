// Flat CPU kernels whose output is at least flags().stream_bytes write it with non-temporal
// stores (backends/cpu/render_cpp.cc, render_streamed): the same values as the plain loop, bit for
// bit, for every output type and for lengths that end inside a tile, with Rand kernels counting
// elements as before; only parallel flat kernels with one output take the path.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <cstring>
#include <functional>
#include <vector>

#include "backends/cpu/render_cpp.h"
#include "tests/support/kernel_source.h"

using namespace kiln;

namespace {

// The bytes of `make()`'s result with the given threshold (a fresh plan: the key includes it).
std::vector<unsigned char> bytes_with(int64_t stream_bytes, const std::function<Tensor()>& make) {
  FlagsGuard guard;
  flags().stream_bytes = stream_bytes;
  flags().debug_memory = true;  // freed blocks come back as 0xFF bytes: an element not written shows
  Tensor out = make().realize();
  std::vector<unsigned char> bytes(out.node()->nbytes());  // a kernel's output: one whole buffer
  std::memcpy(bytes.data(), out.data(), bytes.size());
  return bytes;
}


}  // namespace

TEST_CASE("streamed outputs equal the plain loop's, bit for bit", "[cpu][jit][stream]") {
  manual_seed(3);
  const int64_t n = 3 * 1024 * 37 + 5;  // parallel-sized, and the last tile is partial
  Tensor x = randn({n}).realize(), w = rand({n}).realize();
  const std::vector<std::pair<const char*, std::function<Tensor()>>> cases = {
      {"float32", [&] { return gelu(x * w + 0.25) * 0.75; }},
      {"float16", [&] { return cast(x * 3.0, DType::Float16); }},
      {"bfloat16", [&] { return cast(tanh(x), DType::BFloat16); }},
      {"float64", [&] { return cast(x, DType::Float64) * 1e-3; }},
      {"bool", [&] { return x > w; }},
      {"int64", [&] { return cast(x * 100.0, DType::Int64); }},
      {"rand", [&] { return rand({n}) * x; }},  // Philox counts elements: i, not the tile's index
      {"randn", [] { return randn({n}); }},
  };
  for (const auto& [name, make] : cases) {
    INFO(name);
    manual_seed(11);
    const auto plain = bytes_with(0, make);
    manual_seed(11);
    const auto streamed = bytes_with(1, make);
    CHECK(plain == streamed);
  }
}

TEST_CASE("only parallel flat kernels with one output render the streamed path", "[cpu][jit][stream]") {
  Tensor big = randn({100000}).realize(), small = randn({1000}).realize();
  CHECK(testing::cpu_source_of(big * 2.0 + 1.0).find("kiln_stream(") != std::string::npos);
  CHECK(testing::cpu_source_of(small * 2.0 + 1.0).find("kiln_stream(") == std::string::npos);  // one thread, in cache
  Tensor wide = randn({400, 250}).realize();
  CHECK(testing::cpu_source_of(wide * 2.0 + 1.0).find("kiln_stream(") != std::string::npos);  // contiguous: flattened
  Tensor row = randn({250}).realize();
  CHECK(testing::cpu_source_of(wide + row).find("kiln_stream(") == std::string::npos);  // a broadcast: two loops
  CHECK(cpu::stream_threshold_bytes() > 0);
  FlagsGuard guard;
  flags().stream_bytes = 0;
  CHECK(cpu::stream_threshold_bytes() == 0);
  CHECK(testing::cpu_source_of(big * 2.0 + 1.0).find("kiln_stream(") == std::string::npos);  // off: not even rendered
  flags().stream_bytes = 4096;
  CHECK(cpu::stream_threshold_bytes() == 4096);
}
