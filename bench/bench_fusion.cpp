// bench_fusion: bandwidth of one fused elementwise kernel, y = gelu(x * a + b) * c over 16M
// float32, against std::memcpy of the same bytes measured in the same run.
//
// Two variants:
//   scalars  a, b, c are plain numbers (bound at run time): the kernel reads x, writes y
//            -> 64 MiB in + 64 MiB out, the same traffic as a 64 MiB memcpy.
//   tensors  a, b, c are float32 tensors shaped like x: the kernel reads 4 x 64 MiB, writes 64 MiB.
// GB/s counts each input read once and the output written once (1 GB = 1e9 bytes). Every
// iteration records a new graph over realized inputs (rotating through several, so no result can
// be reused) and realizes it: a plan cache hit that really runs the kernel. Medians are reported.
//
// Build and run (from the repository root):
//   cmake -S . -B build-bench -DKILN_BUILD_TESTS=OFF && cmake --build build-bench -j2
//   ./build-bench/bench/bench_fusion [iterations]          # default 15
//   KILN_LOG=3 ./build-bench/bench/bench_fusion 1          # print the generated kernel
#include <kiln/kiln.h>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fmt/format.h>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kElements = 16 * 1024 * 1024;  // 16M float32 = 64 MiB per tensor
constexpr size_t kBytes = kElements * sizeof(float);
constexpr double kTargetRatio = 0.70;

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

struct Timing {
  double median_s, best_s;
};

Timing time_repeated(int iterations, const std::function<void(int)>& f) {
  std::vector<double> times;
  for (int i = 0; i < iterations; ++i) times.push_back(seconds_of([&] { f(i); }));
  return {median(times), *std::min_element(times.begin(), times.end())};
}

void* aligned_buffer(size_t bytes, char fill) {
  void* p = std::aligned_alloc(64, bytes);
  std::memset(p, fill, bytes);  // touch every page up front
  return p;
}

// memcpy of 64 MiB between buffers that stay allocated (pages already mapped).
Timing memcpy_baseline(int iterations, int threads) {
  std::unique_ptr<void, decltype(&std::free)> src(aligned_buffer(kBytes, 1), &std::free);
  std::unique_ptr<void, decltype(&std::free)> dst(aligned_buffer(kBytes, 0), &std::free);
  auto copy = [&](int) {
    if (threads == 1) {
      std::memcpy(dst.get(), src.get(), kBytes);
    } else {
      std::vector<std::thread> team;
      size_t chunk = kBytes / threads;
      for (int t = 0; t < threads; ++t)
        team.emplace_back([&, t] {
          std::memcpy(static_cast<char*>(dst.get()) + t * chunk, static_cast<char*>(src.get()) + t * chunk, chunk);
        });
      for (auto& th : team) th.join();
    }
    benchmark::DoNotOptimize(dst.get());
    benchmark::ClobberMemory();
  };
  copy(0);  // warm-up
  return time_repeated(iterations, copy);
}

double gbps(double bytes, double seconds) { return bytes / seconds / 1e9; }

struct Variant {
  const char* name;
  bool tensor_operands;
};

// Times realize() of y = gelu(x * a + b) * c; returns {median, best} seconds per iteration.
Timing fused_chain(const Variant& variant, int iterations) {
  constexpr int kInputSets = 3;
  std::vector<std::vector<kiln::Tensor>> inputs;  // per set: x, a, b, c (a, b, c unused for scalars)
  for (int s = 0; s < kInputSets; ++s) {
    std::vector<kiln::Tensor> set = {kiln::randn({kElements})};
    if (variant.tensor_operands)
      for (int k = 0; k < 3; ++k) set.push_back(kiln::rand({kElements}) + 0.5);
    kiln::sync(set);
    inputs.push_back(std::move(set));
  }
  auto run = [&](int i) {
    const std::vector<kiln::Tensor>& in = inputs[i % kInputSets];
    kiln::Tensor y = variant.tensor_operands ? kiln::gelu(in[0] * in[1] + in[2]) * in[3]
                                             : kiln::gelu(in[0] * (1.5 + 0.01 * i) + 0.25) * 0.75;
    y.realize();
    benchmark::DoNotOptimize(y.data());
  };
  run(0);  // plan miss: schedule + compile (or load from the disk cache)
  run(1);
  return time_repeated(iterations, run);
}

}  // namespace

int main(int argc, char** argv) {
  int iterations = argc > 1 ? std::atoi(argv[1]) : 15;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (kiln::flags().num_threads > 0) threads = kiln::flags().num_threads;
  fmt::print("bench_fusion: y = gelu(x * a + b) * c, {} float32 ({} MiB per tensor), {} iterations, {} threads\n\n",
             kElements, kBytes >> 20, iterations, threads);

  Timing copy1 = memcpy_baseline(iterations, 1);
  Timing copyN = memcpy_baseline(iterations, threads);
  double copy_bytes = 2.0 * kBytes;  // read 64 MiB + write 64 MiB
  double copy1_gbps = gbps(copy_bytes, copy1.median_s);
  fmt::print("{:<34} {:>9} {:>9} {:>10} {:>8}\n", "", "median", "best", "GB/s(med)", "vs memcpy");
  fmt::print("{:<34} {:>7.2f}ms {:>7.2f}ms {:>10.2f} {:>8}\n", "memcpy 64 MiB, 1 thread (baseline)",
             copy1.median_s * 1e3, copy1.best_s * 1e3, copy1_gbps, "1.00");
  fmt::print("{:<34} {:>7.2f}ms {:>7.2f}ms {:>10.2f} {:>8.2f}\n", fmt::format("memcpy 64 MiB, {} threads", threads),
             copyN.median_s * 1e3, copyN.best_s * 1e3, gbps(copy_bytes, copyN.median_s),
             gbps(copy_bytes, copyN.median_s) / copy1_gbps);

  const Variant variants[] = {{"fused, a/b/c scalars (128 MiB)", false}, {"fused, a/b/c tensors (320 MiB)", true}};
  bool all_met = true;
  for (const Variant& v : variants) {
    kiln::jit::reset_stats();
    Timing t = fused_chain(v, iterations);
    double bytes = (v.tensor_operands ? 5.0 : 2.0) * kBytes;
    double ratio = gbps(bytes, t.median_s) / copy1_gbps;
    all_met &= ratio >= kTargetRatio;
    const kiln::jit::JitStats& s = kiln::jit::stats();
    fmt::print("{:<34} {:>7.2f}ms {:>7.2f}ms {:>10.2f} {:>8.2f}   ({} kernels run, {} plan cache hits)\n", v.name,
               t.median_s * 1e3, t.best_s * 1e3, gbps(bytes, t.median_s), ratio, s.kernels_run, s.plan_cache_hits);
  }
  fmt::print("\ntarget: fused GB/s >= {:.2f} x single-thread memcpy GB/s: {}\n", kTargetRatio,
             all_met ? "met" : "MISSED");
  return 0;
}
