// Kernels that differ only in the buffers, scalars and seeds they touch share one compiled
// function (jit/canonical_kernel.h): fewer functions than kernels, the same bits as with every
// kernel compiled on its own, no sharing between kernels whose code differs (index arithmetic of
// another size, a dtype) while flat kernels of any size share one, and
// modules that still load from the disk cache in a fresh process; on CUDA (the emulator in CI),
// shared functions and row groups with each kernel's own scalars and seeds.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>

#include "backends/cpu/compiler.h"
#include "backends/cpu/render_cpp.h"
#include "backends/cuda/cuda_runtime.h"
#include "backends/cuda/render_cuda.h"
#include "jit/canonical_kernel.h"
#include "jit/executor.h"
#include "jit/lower.h"

using namespace kiln;

namespace {

std::vector<float> ramp(int64_t n, float scale, float shift) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = scale * static_cast<float>((i * 37) % 101) + shift;
  return v;
}

// An empty kernel cache directory and no plans or modules in memory, as a new process sees them;
// the flags and the directory are restored and removed afterwards.
struct ColdJit {
  FlagsGuard guard;
  std::filesystem::path dir;
  ColdJit() {
    char pattern[] = "/tmp/kiln-test-shared-XXXXXX";
    REQUIRE(mkdtemp(pattern) != nullptr);
    dir = pattern;
    flags().use_cuda = false;
    flags().cache_dir = dir.string();
    flags().disk_cache = true;
    forget();
  }
  // Forgets plans and modules in memory (the disk cache stays): a fresh process.
  static void forget() {
    cpu::clear_memory_cache();
    jit::clear_plan_cache();
    jit::reset_stats();
  }
  ~ColdJit() {
    forget();
    std::filesystem::remove_all(dir);
  }
};

// One layer: tanh(x * w + b) * scale, then its mean, a reduction over the rows.
Tensor layer(const Tensor& x, const Tensor& w, const Tensor& b, double scale) {
  return (tanh(x * w + b) * scale).mean({1});
}

struct Results {
  std::vector<std::vector<float>> values;
  int64_t kernels = 0, functions = 0;
};

// Builds `outputs` on fresh inputs and realizes them as one plan in a cold JIT.
Results run_cold(bool share, const std::function<std::vector<Tensor>()>& outputs) {
  ColdJit jit;
  flags().share_functions = share;
  std::vector<Tensor> ys = outputs();
  sync(ys);
  Results r;
  for (Tensor& y : ys) r.values.push_back(y.to_vector<float>());
  r.kernels = jit::stats().kernels_compiled;
  r.functions = jit::stats().functions_compiled;
  return r;
}

// `layers` layers side by side, each on its own inputs of shape (rows, cols[l]) and its own scale.
std::vector<Tensor> side_by_side(const std::vector<int64_t>& cols, const std::vector<double>& scales) {
  std::vector<Tensor> ys;
  for (size_t l = 0; l < cols.size(); ++l) {
    const float shift = -0.5f + 0.1f * static_cast<float>(l);
    Tensor x = from_vector<float>(ramp(4 * cols[l], 0.01f, shift), {4, cols[l]});
    Tensor w = from_vector<float>(ramp(cols[l], 0.02f, -shift), {cols[l]});
    Tensor b = from_vector<float>(ramp(cols[l], 0.003f, 0.1f), {cols[l]});
    ys.push_back(layer(x, w, b, scales[l]));
  }
  return ys;
}

// The layer of side_by_side in plain C++.
std::vector<float> reference_layer(int64_t cols, double scale, size_t l) {
  const float shift = -0.5f + 0.1f * static_cast<float>(l);
  auto x = ramp(4 * cols, 0.01f, shift), w = ramp(cols, 0.02f, -shift), b = ramp(cols, 0.003f, 0.1f);
  std::vector<float> y(4);
  for (int64_t r = 0; r < 4; ++r) {
    double sum = 0;
    for (int64_t c = 0; c < cols; ++c)
      sum += std::tanh(x[static_cast<size_t>(r * cols + c)] * w[static_cast<size_t>(c)] + b[static_cast<size_t>(c)]) * scale;
    y[static_cast<size_t>(r)] = static_cast<float>(sum / static_cast<double>(cols));
  }
  return y;
}

// A whole float sum in kiln's fixed order (render_cpp.cc, render_blocked_sum): blocks of 16384,
// in each block element i to lane i % 16, lanes folded by halves, block sums added in order.
float blocked_sum(const std::vector<float>& x) {
  const size_t n = x.size(), block = 16384;
  float total = 0;
  for (size_t lo = 0; lo < std::max<size_t>(n, 1); lo += block) {
    const size_t hi = std::min(n, lo + block), full = lo + (hi - lo) / 16 * 16;
    float part[16] = {};
    for (size_t i = lo; i < full; ++i) part[(i - lo) % 16] += x[i];
    for (size_t i = full; i < hi; ++i) part[i - full] += x[i];
    for (size_t w = 8; w > 0; w /= 2)
      for (size_t j = 0; j < w; ++j) part[j] += part[j + w];
    total += part[0];
  }
  return total;
}

}  // namespace

TEST_CASE("identical layers on different buffers compile one function each kind", "[jit][shared-functions]") {
  // The scales differ: a constant is a bound scalar, so layers with other constants still share.
  auto three = [] { return side_by_side({16, 16, 16}, {1.0, 2.0, -0.5}); };
  const Results shared = run_cold(true, three);
  const Results alone = run_cold(false, three);
  CHECK(alone.functions == alone.kernels);
  CHECK(shared.kernels == alone.kernels);
  CHECK(shared.functions * 3 == shared.kernels);  // one function per kernel of a layer
  CHECK(shared.values == alone.values);           // the same bits
  for (size_t l = 0; l < 3; ++l) {
    const auto expected = reference_layer(16, std::vector<double>{1.0, 2.0, -0.5}[l], l);
    for (size_t r = 0; r < 4; ++r) CHECK(shared.values[l][r] == Approx(expected[r]).epsilon(1e-5));
  }
}

TEST_CASE("kernels that differ in a size or a dtype keep their own functions", "[jit][shared-functions]") {
  // A bias added along the last axis: its index arithmetic (the column count) is in the text, so
  // one more column is other code. (The means of side_by_side would share their last kernel, a
  // division of 4 sums by a scalar.)
  const Results sizes = run_cold(true, [] {
    Tensor a = from_vector<float>(ramp(4 * 16, 0.01f, -0.5f), {4, 16});
    Tensor b = from_vector<float>(ramp(4 * 17, 0.01f, -0.5f), {4, 17});
    Tensor bias_a = from_vector<float>(ramp(16, 0.02f, 0.1f), {16});
    Tensor bias_b = from_vector<float>(ramp(17, 0.02f, 0.1f), {17});
    return std::vector<Tensor>{tanh(a * 2.0 + bias_a), tanh(b * 2.0 + bias_b)};
  });
  CHECK(sizes.kernels == 2);
  CHECK(sizes.functions == 2);
  for (size_t l = 0; l < 2; ++l) {
    const int64_t cols = l == 0 ? 16 : 17;
    const auto x = ramp(4 * cols, 0.01f, -0.5f), bias = ramp(cols, 0.02f, 0.1f);
    REQUIRE(sizes.values[l].size() == x.size());
    for (size_t i = 0; i < x.size(); ++i)
      CHECK(sizes.values[l][i] == Approx(std::tanh(x[i] * 2.0 + bias[i % static_cast<size_t>(cols)])).epsilon(1e-5));
  }

  const Results dtypes = run_cold(true, [] {
    Tensor a = from_vector<float>(ramp(64, 0.01f, -0.3f), {64});
    Tensor b = from_vector<double>(std::vector<double>(64, 0.25), {64});
    return std::vector<Tensor>{exp(a) + 1.0, (exp(b) + 1.0).cast(DType::Float32)};
  });
  CHECK(dtypes.functions == dtypes.kernels);
  CHECK(dtypes.values[1][0] == Approx(std::exp(0.25) + 1.0));
}

TEST_CASE("flat kernels of any size share one function that reads its extent", "[jit][shared-functions]") {
  // An optimizer's update and a gradient norm's squares, once per parameter size: one loop over
  // whole buffers, so the extent is an argument and sizes share code (short ones run on one
  // thread, long ones in parallel: two functions per kind at most). Sums keep their blocks of
  // 16384 in order, so the bits are those of kernels compiled one by one.
  const std::vector<int64_t> lengths = {7, 128, 16384, 16385, 49152, 70001};
  auto updates = [&] {
    std::vector<Tensor> ys;
    for (size_t l = 0; l < lengths.size(); ++l) {
      Tensor p = from_vector<float>(ramp(lengths[l], 0.01f, -0.5f + 0.1f * static_cast<float>(l)), {lengths[l]});
      Tensor g = from_vector<float>(ramp(lengths[l], 0.003f, 0.2f), {lengths[l]});
      ys.push_back(p - (g * 0.1) / (sqrt(g * g) + 1e-8));
      ys.push_back((g + 0.5).sum());
    }
    return ys;
  };
  const Results shared = run_cold(true, updates);
  const Results alone = run_cold(false, updates);
  CHECK(shared.kernels == static_cast<int64_t>(2 * lengths.size()));
  CHECK(shared.functions <= 4);
  CHECK(alone.functions == alone.kernels);
  CHECK(shared.values == alone.values);
  for (size_t l = 0; l < lengths.size(); ++l) {
    const auto p = ramp(lengths[l], 0.01f, -0.5f + 0.1f * static_cast<float>(l)), g = ramp(lengths[l], 0.003f, 0.2f);
    const std::vector<float>& update = shared.values[2 * l];
    REQUIRE(update.size() == p.size());
    for (size_t i = 0; i < p.size(); ++i)
      CHECK(update[i] == Approx(p[i] - g[i] * 0.1 / (std::fabs(g[i]) + 1e-8)).margin(1e-5));
    std::vector<float> shifted(g.size());
    for (size_t i = 0; i < g.size(); ++i) shifted[i] = g[i] + 0.5f;
    CHECK(shared.values[2 * l + 1].at(0) == blocked_sum(shifted));
  }
}

TEST_CASE("shared functions read each kernel's own random stream", "[jit][shared-functions]") {
  // Two identical dropout-like kernels: each Rand has its own seed and offset, bound per kernel.
  auto noisy = [] {
    manual_seed(7);
    Tensor x = from_vector<float>(ramp(256, 0.01f, 0.5f), {256});
    Tensor y = from_vector<float>(ramp(256, 0.02f, 0.25f), {256});
    return std::vector<Tensor>{x * rand({256}), y * rand({256})};
  };
  const Results shared = run_cold(true, noisy);
  const Results alone = run_cold(false, noisy);
  CHECK(shared.functions < shared.kernels);
  CHECK(shared.values == alone.values);
  CHECK(shared.values[0] != shared.values[1]);
}

TEST_CASE("a plan of shared functions loads from the disk cache in a new process", "[jit][shared-functions]") {
  ColdJit jit;
  std::vector<Tensor> ys = side_by_side({8, 8, 8, 8}, {1.0, 1.5, 2.0, 2.5});
  sync(ys);
  const int64_t compiled = jit::stats().modules_compiled;
  CHECK(compiled >= 1);
  CHECK(jit::stats().functions_compiled < jit::stats().kernels_compiled);
  std::vector<std::vector<float>> first;
  for (Tensor& y : ys) first.push_back(y.to_vector<float>());

  ColdJit::forget();
  std::vector<Tensor> again = side_by_side({8, 8, 8, 8}, {1.0, 1.5, 2.0, 2.5});
  sync(again);
  CHECK(jit::stats().modules_compiled == 0);
  CHECK(jit::stats().disk_cache_hits == compiled);
  for (size_t l = 0; l < again.size(); ++l) CHECK(again[l].to_vector<float>() == first[l]);

  // Another size is other code: a miss, compiled anew.
  ColdJit::forget();
  std::vector<Tensor> wider = side_by_side({9, 9, 9, 9}, {1.0, 1.5, 2.0, 2.5});
  sync(wider);
  CHECK(jit::stats().modules_compiled >= 1);
}

TEST_CASE("flat kernels with random streams read their extent after every Rand pair", "[jit][shared-functions]") {
  // x * rand + randn: one flat kernel with two Rand pairs (isc[0..3]), its extent at isc[4];
  // rand and randn realized on their own afterwards (one pair each, extent at isc[2]) give the
  // same streams, element for element.
  ColdJit jit;
  for (int64_t n : {100, 5000, 40000}) {
    manual_seed(11);
    Tensor x = from_vector<float>(ramp(n, 0.01f, -0.4f), {n});
    Tensor u = rand({n}), z = randn({n});
    Tensor y = x * u + z;
    sync({y});
    const std::vector<float> ys = y.to_vector<float>(), us = u.to_vector<float>(), zs = z.to_vector<float>();
    const std::vector<float> xs = ramp(n, 0.01f, -0.4f);
    REQUIRE(ys.size() == static_cast<size_t>(n));
    for (size_t i = 0; i < ys.size(); ++i) {
      CHECK(us[i] >= 0.0f);
      CHECK(us[i] < 1.0f);
      CHECK(ys[i] == Approx(xs[i] * us[i] + zs[i]).margin(1e-6));
    }
    CHECK(us.front() != us.back());
    CHECK(zs.front() != zs.back());
  }
  // 5000 elements run the code of 100 (on one thread): no module of its own.
  CHECK(jit::stats().modules_compiled <= 6);
}

TEST_CASE("plans whose code differs only in sizes and notes share one module", "[jit][shared-functions]") {
  // Two parameter initializations of other shapes (separate plans): the kernels' note lines
  // (compiler.h kNotePrefix) name their shapes, the code reads its extent, so the second finds
  // the first's module in memory.
  ColdJit jit;
  auto init = [](const Shape& shape) {
    Tensor t = from_vector<float>(std::vector<float>(static_cast<size_t>(numel(shape)), 0.5f), shape);
    Tensor y = tanh(t * 3.0 + 1.0);
    sync({y});
    return y.to_vector<float>();
  };
  const std::vector<float> first = init({384});
  CHECK(jit::stats().modules_compiled == 1);
  const std::vector<float> second = init({12, 10});
  CHECK(jit::stats().modules_compiled == 1);
  REQUIRE(second.size() == 120);
  CHECK(second[119] == first[0]);
  CHECK(second[0] == Approx(std::tanh(2.5)));
  init({40000});  // long enough for the parallel loop: other code
  CHECK(jit::stats().modules_compiled == 2);
}

TEST_CASE("canonical kernels number slots in order of first use", "[jit][shared-functions]") {
  std::vector<Tensor> ys = side_by_side({8, 8}, {3.0, 4.0});
  const jit::Program program = jit::lower_for({ys[0].node(), ys[1].node()});
  std::vector<jit::KernelBinding> bindings;
  const jit::FunctionSharing sharing = jit::share_functions(
      program.kernels, [](const jit::Kernel& k) { return cpu::render_cpp({k}).functions.at(0); }, true, &bindings);
  for (size_t k = 0; k < program.kernels.size(); ++k) {
    const jit::Kernel& kernel = program.kernels[k];
    if (jit::is_library(kernel.kind)) continue;
    REQUIRE(bindings[k].buffer_slots.size() == kernel.buffers.size());
    for (size_t b = 0; b < kernel.buffers.size(); ++b) CHECK(bindings[k].buffer_slots[b] == kernel.buffers[b].slot);
    const jit::Kernel canonical = jit::canonical_kernel(kernel, nullptr);
    CHECK(canonical.name == jit::kCanonicalName);
    for (size_t b = 0; b < canonical.buffers.size(); ++b) CHECK(canonical.buffers[b].slot == static_cast<int>(b));
  }
  CHECK(sharing.texts.size() == sharing.first_kernel.size());
  CHECK(sharing.texts.size() < program.kernels.size());
  CHECK(jit::rename_function(std::string("void ") + jit::kCanonicalName + "_parts(" + jit::kCanonicalName + ")", "k7") ==
        "void k7_parts(k7)");
}

TEST_CASE("CUDA kernels and row groups that differ only in their slots share functions", "[jit][shared-functions][cuda]") {
  // Two softmaxes (a row group on CUDA) of identical shape, scaled by different constants.
  Tensor a = from_vector<float>(ramp(8 * 64, 0.01f, -0.3f), {8, 64});
  Tensor b = from_vector<float>(ramp(8 * 64, 0.02f, 0.1f), {8, 64});
  Tensor ya = softmax(a * 2.0, 1), yb = softmax(b * 3.0, 1);
  const jit::Program program = jit::lower_for({ya.node(), yb.node()});
  const std::vector<int> groups = cuda::cuda_row_groups(program.kernels);
  const cuda::CudaSource shared = cuda::render_cuda(program.kernels, groups, true);
  const cuda::CudaSource alone = cuda::render_cuda(program.kernels, groups, false);
  CHECK(shared.function_count * 2 == alone.function_count);
  CHECK(shared.source.size() < alone.source.size());
  // Each launch of the second softmax names a function of the first, on its own slots and scalars.
  int reused = 0;
  for (size_t k = 0; k < program.kernels.size(); ++k)
    for (size_t j = 0; j < k; ++j) {
      if (shared.launches[k].empty() || shared.launches[k].size() != shared.launches[j].size()) continue;
      if (shared.launches[k][0].function != shared.launches[j][0].function) continue;
      reused++;
      CHECK(shared.parameter_slots[k] != shared.parameter_slots[j]);
      CHECK(shared.scalar_slots[k] != shared.scalar_slots[j]);
      CHECK(alone.launches[k][0].function != alone.launches[j][0].function);
    }
  CHECK(reused >= 1);
}

TEST_CASE("CUDA row groups leave out rows one thread folds alone, so a sum's order does not depend on its neighbours",
          "[jit][cuda]") {
  // A softmax's max, sum and division over rows: one group from 33 columns up. At 32 and below a
  // row's reductions fold in one thread each on their own but as a block's tree in a group, so
  // grouping them would change their bits with the kernels around them (recomputed copies move
  // kernels about: a GPT step under a budget differed in its embeddings' updates).
  for (int64_t cols : {16, 32, 33, 64}) {
    Tensor x = from_vector<float>(ramp(8 * cols, 0.01f, -0.3f), {8, cols});
    const jit::Program program = jit::lower_for({softmax(x, 1).node()});
    const std::vector<int> groups = cuda::cuda_row_groups(program.kernels);
    int grouped = 0;
    for (size_t k = 0; k < groups.size(); ++k) grouped += groups[k] != static_cast<int>(k);
    INFO(cols << " columns");
    CHECK((grouped > 0) == (cols > 32));
  }
}

TEST_CASE("shared CUDA functions give each kernel its own buffers, scalars and random stream", "[jit][shared-functions][device]") {
  if (!cuda::available()) return;
  auto layers = [](Device device) {
    manual_seed(3);
    std::vector<Tensor> ys;
    for (int l = 0; l < 3; ++l) {
      Tensor x = from_vector<float>(ramp(8 * 64, 0.01f, -0.3f * static_cast<float>(l)), {8, 64}).to(device);
      ys.push_back(softmax(x * (1.0 + l), 1) * rand({8, 64}));
    }
    sync(ys);
    std::vector<std::vector<float>> values;
    for (Tensor& y : ys) values.push_back(y.to(Device::cpu()).to_vector<float>());
    return values;
  };
  const auto on_cpu = layers(Device::cpu());
  const auto on_cuda = layers(Device::cuda(0));
  for (size_t l = 0; l < on_cpu.size(); ++l)
    for (size_t i = 0; i < on_cpu[l].size(); ++i) CHECK(on_cuda[l][i] == Approx(on_cpu[l][i]).epsilon(1e-5).margin(1e-7));
  CHECK(on_cpu[0] != on_cpu[1]);
}
