// The CUDA emulator itself (backends/cuda/cuda_emulator.h), on hand-written kernels: block-wide barriers
// and warp shuffles give what a GPU gives, grid-stride loops cover a grid larger than the blocks
// emulated, and code that would hang a GPU (a barrier some threads never reach) is an error.
#include <catch2/catch.hpp>

#include <numeric>
#include <string>
#include <vector>

#include <kiln/kiln.h>

#include "backends/cpu/compiler.h"
#include "backends/cuda/cuda_emulator.h"
#include "backends/cuda/cuda_emulator_prelude.h"

using namespace kiln;
using kiln::cpu::CompiledModule;
using kiln::cpu::compile_cached;
using kiln::cuda::kCudaEmulatorTypes;
namespace emulator = kiln::cuda::emulator;

namespace {

// A module of `kernels` (CUDA source, each taking (float* out, const float* in, long long n)) with
// an emulator entry for each name.
std::shared_ptr<CompiledModule> emulated_module(const std::string& kernels, const std::vector<std::string>& names) {
  std::string source = std::string(kCudaEmulatorTypes) + kernels;
  for (const std::string& n : names)
    source += "extern \"C\" void kiln_emu_" + n + "(void** a) { " + n +
              "(*(float**)a[0], *(const float**)a[1], *(long long*)a[2]); }\n";
  return compile_cached(source, static_cast<int>(names.size()));
}

void run(const CompiledModule& m, const std::string& name, int64_t blocks, int threads, std::vector<float>& out,
         const std::vector<float>& in) {
  float* o = out.data();
  const float* i = in.data();
  long long n = static_cast<long long>(in.size());
  void* args[] = {&o, &i, &n};
  emulator::launch(emulator::entry(m, name), {name, blocks, threads}, args);
}

const char* kKernels = R"(
// Each block folds its grid-stride share of `in` with shuffles and shared memory; out[block] = sum.
extern "C" __global__ void block_sum(float* out, const float* in, long long n) {
  __shared__ float partial[32];
  float acc = 0;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    acc += in[i];
  for (int d = 16; d > 0; d >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, d);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) total += partial[w];
    out[blockIdx.x] = total;
  }
}
// Reverses each block's 64 elements through shared memory (wrong without the barrier).
extern "C" __global__ void reverse64(float* out, const float* in, long long n) {
  __shared__ float tile[64];
  tile[threadIdx.x] = in[blockIdx.x * 64 + threadIdx.x];
  __syncthreads();
  out[blockIdx.x * 64 + threadIdx.x] = tile[63 - threadIdx.x];
}
// Even threads wait at the block barrier, odd ones at a shuffle half their warp never joins:
// a GPU hangs.
extern "C" __global__ void divergent_sync(float* out, const float* in, long long n) {
  if (threadIdx.x % 2 == 0) __syncthreads();
  else out[threadIdx.x] = __shfl_down_sync(0xffffffffu, in[threadIdx.x], 1);
}
// Lanes 16..31 exit before a full-warp shuffle.
extern "C" __global__ void partial_shuffle(float* out, const float* in, long long n) {
  if ((threadIdx.x & 31) >= 16) return;
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, in[threadIdx.x], 1);
}
)";

}  // namespace

TEST_CASE("the CUDA emulator runs barriers and shuffles as a GPU does", "[cuda][emulator]") {
  auto m = emulated_module(kKernels, {"block_sum", "reverse64", "divergent_sync", "partial_shuffle"});
  std::vector<float> in(10000);
  std::iota(in.begin(), in.end(), 0.0f);
  SECTION("a grid of 1000 blocks: the emulated blocks cover every element through the grid-stride loop") {
    std::vector<float> out(1000, 0.0f);
    run(*m, "block_sum", 1000, 128, out, in);
    double total = std::accumulate(out.begin(), out.end(), 0.0);
    CHECK(total == Approx(10000.0 * 9999.0 / 2));
    CHECK(out[0] > 0);
  }
  SECTION("shared memory written before __syncthreads is read after it") {
    std::vector<float> out(128, -1.0f);
    std::vector<float> small(in.begin(), in.begin() + 128);
    run(*m, "reverse64", 2, 64, out, small);
    for (int b = 0; b < 2; ++b)
      for (int t = 0; t < 64; ++t) CHECK(out[b * 64 + t] == small[b * 64 + 63 - t]);
  }
  SECTION("a barrier that some threads never reach is an error, not a hang") {
    std::vector<float> out(64);
    CHECK_THROWS_WITH(run(*m, "divergent_sync", 1, 64, out, in), Catch::Contains("divergent_sync") &&
                                                                     Catch::Contains("__syncthreads"));
  }
  SECTION("a full-warp shuffle after some lanes exited is an error") {
    std::vector<float> out(32);
    CHECK_THROWS_WITH(run(*m, "partial_shuffle", 1, 32, out, in), Catch::Contains("exited lanes"));
  }
  SECTION("launch shapes a GPU refuses are refused") {
    std::vector<float> out(64);
    CHECK_THROWS_WITH(run(*m, "block_sum", 1, 48, out, in), Catch::Contains("multiple of 32"));
  }
}
