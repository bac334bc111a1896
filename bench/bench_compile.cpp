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
//
// Then the GPT of samples/train_gpt (4 layers, dim 128, 4 heads, ctx 64, vocab 96, batch 32): its
// first training step (forward, backward, clipping, AdamW) cold, in three configurations measured
// alternately in the same run: the baseline compiles every kernel as its own function in one
// translation unit (KILN_SHARE_FUNCTIONS=0 KILN_COMPILE_JOBS=1, kiln before sharing); then
// identical kernels share a function; then the module is also split over two compiler processes.
// Each prints the kernels and the distinct functions compiled. Last, the same step warm (disk
// cache populated, memory and plan caches cleared): what the cold step costs besides compiling.
//
// Build and run (from the repository root):
//   cmake -S . -B build-bench -DKILN_BUILD_TESTS=OFF && cmake --build build-bench -j2
//   ./build-bench/bench/bench_compile [repeats] [gpt repeats]   # default 5 and 3
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
constexpr const char* kJitFlags = "-O2 -march=native -fno-math-errno -fno-trapping-math -ffp-contract=off -fopenmp -shared -fPIC -std=c++17 -w";

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

// What one cold GPT step compiled and how long it took.
struct GptCold {
  double step_seconds = 0, compile_seconds = 0;
  int64_t kernels = 0, functions = 0, modules = 0;
};

// The first training step of a fresh GPT in an empty kernel cache directory under `dir`, with
// the given sharing and compiler processes. The model and its optimizer are made (and their
// initialization compiled) before timing; the step is one plan for forward, backward and update
// plus the small ones clipping and the optimizer's first step record.
GptCold gpt_cold_step(const fs::path& dir, bool share, int jobs) {
  namespace nn = kiln::nn;
  constexpr int64_t kBatch = 32, kCtx = 64, kVocab = 96;
  kiln::flags().share_functions = share;
  kiln::flags().compile_jobs = jobs;
  kiln::flags().cache_dir = dir.string();
  kiln::cpu::clear_memory_cache();
  kiln::jit::clear_plan_cache();
  kiln::manual_seed(1);
  nn::GPT gpt(nn::GPTConfig().vocab(kVocab).ctx(kCtx).layers(4).heads(4).dim(128));
  kiln::optim::AdamW opt(gpt.parameters(), kiln::optim::AdamWOptions(3e-4).betas(0.9, 0.95).weight_decay(0.1));
  // A fixed stream of tokens; the targets are the inputs shifted by one.
  std::vector<int64_t> tokens(kBatch * kCtx + 1);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>((i * 7919) % kVocab);
  kiln::Tensor x = kiln::from_vector<int64_t>(std::vector<int64_t>(tokens.begin(), tokens.end() - 1), {kBatch, kCtx});
  kiln::Tensor y = kiln::from_vector<int64_t>(std::vector<int64_t>(tokens.begin() + 1, tokens.end()), {kBatch, kCtx});
  kiln::sync(gpt.parameters());
  kiln::sync({x, y});

  kiln::jit::reset_stats();
  GptCold result;
  result.step_seconds = seconds_of([&] {
    kiln::Tensor loss = kiln::nn::cross_entropy(gpt.forward(x).reshape({-1, kVocab}), y.reshape({-1}));
    opt.zero_grad();
    loss.backward();
    kiln::optim::clip_grad_norm(gpt.parameters(), 1.0);
    opt.step({loss});
    (void)loss.item();
  });
  const kiln::jit::JitStats& s = kiln::jit::stats();
  result.compile_seconds = s.compile_seconds;
  result.kernels = s.kernels_compiled;
  result.functions = s.functions_compiled;
  result.modules = s.modules_compiled;
  return result;
}

void gpt_benchmark(int repeats) {
  struct Case {
    const char* name;
    bool share;
    int jobs;
    std::vector<double> step, compile;
    GptCold last;
  };
  std::vector<Case> cases = {{"before: a function per kernel, 1 compiler", false, 1, {}, {}, {}},
                             {"identical kernels share a function, 1 compiler", true, 1, {}, {}, {}},
                             {"shared functions, 2 compilers at once", true, 2, {}, {}, {}}};
  std::vector<fs::path> dirs;
  dirs.push_back(fresh_directory());
  gpt_cold_step(dirs.back(), true, 2);  // not timed: oneDNN's primitives and the page cache, once
  std::vector<double> warm;
  for (int r = 0; r < repeats; ++r) {
    for (Case& c : cases) {
      dirs.push_back(fresh_directory());
      c.last = gpt_cold_step(dirs.back(), c.share, c.jobs);
      c.step.push_back(c.last.step_seconds);
      c.compile.push_back(c.last.compile_seconds);
    }
    // The last case's modules from its disk cache: the step's cost outside the compiler.
    warm.push_back(gpt_cold_step(dirs.back(), cases.back().share, cases.back().jobs).step_seconds);
  }
  for (const fs::path& dir : dirs) fs::remove_all(dir);

  fmt::print("\nGPT (4 layers, dim 128, 4 heads, ctx 64, batch 32): first training step, cold, {} repeats\n", repeats);
  fmt::print("{:<50} {:>8} {:>9} {:>8} {:>11} {:>11} {:>8}\n", "", "kernels", "functions", "modules", "step",
             "compiling", "ratio");
  const double before = median(cases.front().step);
  for (const Case& c : cases)
    fmt::print("{:<50} {:>8} {:>9} {:>8} {:>9.0f}ms {:>9.0f}ms {:>7.2f}x\n", c.name, c.last.kernels, c.last.functions,
               c.last.modules, median(c.step) * 1e3, median(c.compile) * 1e3, before / median(c.step));
  fmt::print("{:<50} {:>8} {:>9} {:>8} {:>9.0f}ms {:>11}\n", "warm: the last one's disk cache, new plans", "", "", "",
             median(warm) * 1e3, "0ms");
  fmt::print("(medians; ratio: the baseline's cold step over this one's)\n");
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

  const int gpt_repeats = argc > 2 ? std::atoi(argv[2]) : 3;
  if (gpt_repeats > 0) gpt_benchmark(gpt_repeats);
  return 0;
}
