// bench_overhead: host cost of recording and replaying a cached step that does almost no
// arithmetic. The step is 50 ops (elementwise, broadcasts and row reductions) on (8, 8) float32
// tensors; the reductions split it into several kernels. After the first step every realize is
// a plan cache hit, so what is left is kiln's own overhead: recording the nodes, collecting the
// pending graph and its structural key, finding the plan, allocating buffers, calling kernels.
//
// Prints the median µs per step, split into recording (building the lazy graph: 50 ops become
// about 90 nodes with the scalar constants and broadcasts), realize, and releasing the result,
// next to the same 50 ops written as plain C++ loops with libm's tanhf, measured in this run.
//
// Build and run (from the repository root):
//   cmake -S . -B build-bench -DKILN_BUILD_TESTS=OFF && cmake --build build-bench -j2
//   ./build-bench/bench/bench_overhead [steps]             # default 20000
//   KILN_LOG=1 ./build-bench/bench/bench_overhead 2        # see the kernels of one step
#include <kiln/kiln.h>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fmt/format.h>
#include <vector>

namespace {

constexpr int64_t R = 8, C = 8;  // every tensor is (R, C) or a row reduction (R, 1)
constexpr int kBlocks = 10;      // 5 ops per block -> 50 ops
constexpr double kTargetMicros = 50;

using Clock = std::chrono::steady_clock;

double micros(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The step: per block h = tanh(h * w + 0.1); m = sum(h, 1); h = h - m  (5 ops: mul, add, tanh,
// sum, sub), 10 blocks. Each row sum ends a kernel.
kiln::Tensor record_step(const kiln::Tensor& x, const kiln::Tensor& w) {
  kiln::Tensor h = x;  // (R, C)
  for (int b = 0; b < kBlocks; ++b) {
    h = kiln::tanh(h * w + 0.1);
    kiln::Tensor m = kiln::sum(h, {1}, true);  // (R, 1)
    h = h - m;                                  // broadcast back to (R, C)
  }
  return h;
}

// The same arithmetic as plain C++ loops: what the step would cost with no framework at all.
void reference_step(const std::vector<float>& x, const std::vector<float>& w, std::vector<float>& h) {
  h = x;
  for (int b = 0; b < kBlocks; ++b) {
    for (int64_t i = 0; i < R * C; ++i) h[i] = std::tanh(h[i] * w[i] + 0.1f);
    for (int64_t r = 0; r < R; ++r) {
      float m = 0;
      for (int64_t c = 0; c < C; ++c) m += h[r * C + c];
      for (int64_t c = 0; c < C; ++c) h[r * C + c] -= m;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int steps = argc > 1 ? std::atoi(argv[1]) : 20000;
  kiln::manual_seed(1);
  kiln::Tensor x = kiln::randn({R, C}), w = kiln::rand({R, C});
  kiln::sync({x, w});

  // Warm-up: the first step builds the plan (compiles or loads from the disk cache).
  for (int i = 0; i < 3; ++i) record_step(x, w).realize();
  kiln::jit::reset_stats();

  std::vector<double> record_us, realize_us, release_us, total_us;
  for (int i = 0; i < steps; ++i) {
    Clock::time_point t0, t1, t2, t3;
    t0 = Clock::now();
    {
      kiln::Tensor out = record_step(x, w);
      t1 = Clock::now();
      out.realize();
      t2 = Clock::now();
      benchmark::DoNotOptimize(out.data());
    }
    t3 = Clock::now();  // the result and what is left of the graph are freed
    record_us.push_back(micros(t0, t1));
    realize_us.push_back(micros(t1, t2));
    release_us.push_back(micros(t2, t3));
    total_us.push_back(micros(t0, t3));
  }
  const kiln::jit::JitStats s = kiln::jit::stats();  // a copy: the check below runs one more step
  double kernels_per_step = static_cast<double>(s.kernels_run) / steps;

  // Baseline: the same math in plain loops, data from the same tensors.
  std::vector<float> xs = x.to_vector<float>(), ws = w.to_vector<float>(), h;
  std::vector<double> reference_us;
  for (int i = 0; i < steps; ++i) {
    auto t0 = Clock::now();
    reference_step(xs, ws, h);
    benchmark::DoNotOptimize(h.data());
    reference_us.push_back(micros(t0, Clock::now()));
  }
  // Check the two agree, so the benchmark measures the right thing.
  std::vector<float> kiln_h = record_step(x, w).to_vector<float>();
  double max_diff = 0;
  for (size_t i = 0; i < h.size(); ++i) max_diff = std::max(max_diff, std::fabs(double(h[i]) - kiln_h[i]));

  fmt::print("bench_overhead: {} ops/step on ({}, {}) float32, {:.0f} kernels/step, {} steps\n", 5 * kBlocks, R, C,
             kernels_per_step, steps);
  fmt::print("  plan cache hits {} of {} realizes; {} kernels compiled during the timed loop\n\n", s.plan_cache_hits,
             steps, s.kernels_compiled);
  fmt::print("{:<40} {:>10} {:>10}\n", "", "median us", "p90 us");
  auto row = [](const char* name, std::vector<double> v) {
    std::sort(v.begin(), v.end());
    fmt::print("{:<40} {:>10.2f} {:>10.2f}\n", name, median(v), v[v.size() * 9 / 10]);
  };
  row("kiln step (record + realize + release)", total_us);
  row("  record (build the lazy graph)", record_us);
  row("  realize (collect, key, plan hit, run)", realize_us);
  row("  release (drop the result handle)", release_us);
  row("plain C++ loops, same math (baseline)", reference_us);
  fmt::print("\nper op: {:.2f} us recorded+replayed; max |kiln - reference| = {:.2e}\n", median(total_us) / (5 * kBlocks),
             max_diff);
  fmt::print("target: step < {:.0f} us: {}\n", kTargetMicros, median(total_us) < kTargetMicros ? "met" : "MISSED");
  return 0;
}
