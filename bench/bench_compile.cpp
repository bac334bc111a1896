// bench_compile: JIT latency of the quickstart's training step (a 16 -> 64 -> 1 tanh MLP,
// MSE loss, SGD update; forward + backward + update recorded lazily and run as one plan).
//
//   cold  empty kernel cache directory, memory and plan caches cleared: schedule, render,
//         run the host compiler, dlopen, run.               target < 3 s
//   warm  disk cache populated, memory and plan caches cleared (a new process, in effect):
//         schedule, render, hash, dlopen from disk, run.     target < 100 ms
//   hot   plan cache hit (every step after the first): record, replay.
// Baseline, measured in the same run: the host compiler building an empty shared object with
// the JIT's flags, i.e. the fixed cost of starting the compiler at all.
// Each case is repeated (cold in a fresh temporary cache directory each time); medians reported.
// Not cleared between repeats: oneDNN's primitive cache (creating a matmul primitive costs a few
// ms per shape the first time in a process) and the data/parameter plans made before timing.
//
// Build and run (from the repository root):
//   cmake -S . -B build-bench -DKILN_BUILD_TESTS=OFF && cmake --build build-bench -j2
//   ./build-bench/bench/bench_compile [repeats]          # default 5
#include <kiln/kiln.h>

#include "backends/cpu/compiler.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#ifndef KILN_BENCH_CXX
#define KILN_BENCH_CXX "c++"
#endif

namespace {

namespace fs = std::filesystem;
constexpr int64_t N = 256, D = 16, H = 64;  // as in samples/quickstart.cpp
// Same flags as kCompileFlags in backends/cpu/compiler.cc (keep in sync; used for the baseline only).
constexpr const char* kJitFlags = "-O2 -march=native -fno-math-errno -fno-trapping-math -fopenmp -shared -fPIC -std=c++17 -w";

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double seconds_of(const std::function<void()>& f) {
  auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

fs::path fresh_directory() {
  std::string pattern = (fs::temp_directory_path() / "kiln-bench-compile-XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return pattern;
}

// The quickstart's model and data, created once (their own small plans are not what is timed).
struct Model {
  kiln::Tensor x, y, w1, b1, w2, b2;
};

Model make_model() {
  kiln::manual_seed(42);
  Model m;
  m.x = kiln::randn({N, D});
  m.y = kiln::sin(kiln::matmul(m.x, kiln::randn({D, 1})) / std::sqrt(double(D)));
  m.w1 = kiln::randn({D, H}) * (1.0 / std::sqrt(double(D)));
  m.b1 = kiln::zeros({H});
  m.w2 = kiln::randn({H, 1}) * (1.0 / std::sqrt(double(H)));
  m.b2 = kiln::zeros({1});
  kiln::sync({m.x, m.y, m.w1, m.b1, m.w2, m.b2});
  for (kiln::Tensor* p : {&m.w1, &m.b1, &m.w2, &m.b2}) p->requires_grad_();
  return m;
}

// One SGD step of the quickstart, recorded and synced as one plan.
void train_step(Model& m, double lr) {
  kiln::Tensor loss;
  {
    loss = kiln::mse_loss(kiln::matmul(kiln::tanh(kiln::matmul(m.x, m.w1) + m.b1), m.w2) + m.b2, m.y);
    std::vector<kiln::Tensor> params = {m.w1, m.b1, m.w2, m.b2};
    std::vector<kiln::Tensor> grads = kiln::grad(loss, params);
    kiln::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].assign(params[i] - lr * grads[i]);
  }
  kiln::sync({loss, m.w1, m.b1, m.w2, m.b2});
}

// Seconds for the host compiler to build an empty shared object with the JIT's flags.
double empty_compile_seconds(const fs::path& dir) {
  fs::path src = dir / "empty.cc", so = dir / "empty.so";
  std::ofstream(src) << "extern \"C\" int kiln_empty() { return 0; }\n";
  std::string command = fmt::format("'{}' {} -o '{}' '{}'", KILN_BENCH_CXX, kJitFlags, so.string(), src.string());
  double s = seconds_of([&] {
    if (std::system(command.c_str()) != 0) throw std::runtime_error("compiler failed: " + command);
  });
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = argc > 1 ? std::atoi(argv[1]) : 5;
  kiln::FlagsGuard guard;
  kiln::flags().disk_cache = true;
  kiln::flags().plan_cache = true;
  Model m = make_model();  // compiled with whatever cache the environment gives; not timed

  std::vector<double> cold, cold_compile, warm, hot, baseline;
  int64_t modules_per_cold = 0, kernels_per_cold = 0, disk_hits_per_warm = 0;
  std::vector<fs::path> dirs;
  for (int r = 0; r < repeats; ++r) {
    fs::path dir = fresh_directory();
    dirs.push_back(dir);
    baseline.push_back(empty_compile_seconds(dir));

    kiln::flags().cache_dir = (dir / "kernels").string();
    kiln::cpu::clear_memory_cache();
    kiln::jit::clear_plan_cache();
    kiln::jit::reset_stats();
    cold.push_back(seconds_of([&] { train_step(m, 0.01); }));
    cold_compile.push_back(kiln::jit::stats().compile_seconds);
    modules_per_cold = kiln::jit::stats().modules_compiled;
    kernels_per_cold = kiln::jit::stats().kernels_compiled;

    kiln::cpu::clear_memory_cache();
    kiln::jit::clear_plan_cache();
    kiln::jit::reset_stats();
    warm.push_back(seconds_of([&] { train_step(m, 0.01); }));
    disk_hits_per_warm = kiln::jit::stats().disk_cache_hits;

    for (int i = 0; i < 20; ++i) hot.push_back(seconds_of([&] { train_step(m, 0.01); }));
  }
  for (const fs::path& dir : dirs) fs::remove_all(dir);

  fmt::print("bench_compile: quickstart training step (MLP {} -> {} -> 1, batch {}), {} repeats\n", D, H, N, repeats);
  fmt::print("  cold: {} module(s), {} kernels compiled per run; warm: {} disk cache hit(s) per run\n\n",
             modules_per_cold, kernels_per_cold, disk_hits_per_warm);
  fmt::print("{:<58} {:>10} {:>10} {:>8}\n", "", "median", "best", "target");
  auto row = [](const std::string& name, const std::vector<double>& v, const char* target) {
    fmt::print("{:<58} {:>8.1f}ms {:>8.1f}ms {:>8}\n", name, median(v) * 1e3, *std::min_element(v.begin(), v.end()) * 1e3,
               target);
  };
  row("host compiler, empty shared object (baseline)", baseline, "");
  row("cold: empty cache dir, memory + plan caches cleared", cold, "< 3 s");
  row("  of which inside the host compiler (compile_seconds)", cold_compile, "");
  row("warm: disk cache populated, memory + plan caches cleared", warm, "< 100ms");
  row("hot: plan cache hit", hot, "");
  bool met = median(cold) < 3.0 && median(warm) < 0.1;
  fmt::print("\ntargets (cold < 3 s, warm < 100 ms): {}\n", met ? "met" : "MISSED");
  return 0;
}
