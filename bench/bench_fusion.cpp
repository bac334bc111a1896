// bench_fusion: bandwidth of one fused elementwise kernel, y = gelu(x * a + b) * c over 16M
// float32, against std::memcpy of the same bytes measured in the same run.
//
// Three variants:
//   scalars  a, b, c are plain numbers (bound at run time, a changes every iteration): the
//            kernel reads x and writes y, 64 MiB + 64 MiB, the traffic of a 64 MiB memcpy.
//   tensors  a, b, c are float32 tensors shaped like x: the kernel reads 4 x 64 MiB, writes 64 MiB.
//   x*a+b    y = x * a + b with scalars: the same traffic as `scalars` without GELU's arithmetic.
// Outputs larger than the last-level cache are written with non-temporal stores;
// KILN_STREAM_BYTES=0 switches that off for comparison.
// GB/s counts each input read once and the output written once (1 GB = 1e9 bytes). Every
// iteration records a new graph over realized inputs (rotating through three sets, so no result
// can be reused) and realizes it: a plan cache hit that really runs the kernel. The figure is
// the median over iterations; the baseline is single-thread memcpy of 64 MiB between mapped
// buffers, sampled before and after the fused runs (median of both).
//
// Diagnostics printed with it: 2-thread memcpy; the cost of first-touch page faults of a fresh
// 64 MiB buffer (the executor allocates every kernel output anew); and the fused runs again with
// glibc told to keep freed memory mapped, which is what a caching allocator would give.
//
// Build and run (from the repository root):
//   cmake -S . -B build-bench -DKILN_BUILD_TESTS=OFF && cmake --build build-bench -j2
//   ./build-bench/bench/bench_fusion [iterations]          # default 15
//   KILN_LOG=2 ./build-bench/bench/bench_fusion 3          # a timing line per kernel
//   KILN_LOG=3 ./build-bench/bench/bench_fusion 1          # print the generated kernels
#include <kiln/kiln.h>

#include <benchmark/benchmark.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fmt/format.h>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kElements = 16 * 1024 * 1024;  // 16M float32 = 64 MiB per tensor
constexpr size_t kBytes = kElements * sizeof(float);
constexpr double kTargetRatio = 0.70;         // x single-thread memcpy (the first target)
constexpr double kTargetRatioThreads = 0.80;  // x memcpy on every thread (issue 19's)

using Samples = std::vector<double>;  // seconds per iteration

double median(Samples v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
double best(const Samples& v) { return *std::min_element(v.begin(), v.end()); }
double gbps(double bytes, double seconds) { return bytes / seconds / 1e9; }

Samples time_repeated(int iterations, const std::function<void(int)>& f) {
  Samples times;
  for (int i = 0; i < iterations; ++i) {
    auto start = std::chrono::steady_clock::now();
    f(i);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return times;
}

using Buffer = std::unique_ptr<void, decltype(&std::free)>;

Buffer mapped_buffer(char fill) {
  Buffer p(std::aligned_alloc(64, kBytes), &std::free);
  std::memset(p.get(), fill, kBytes);  // touch every page up front
  return p;
}

// memcpy of 64 MiB between buffers whose pages are already mapped, split over `threads`.
Samples memcpy_samples(int iterations, int threads) {
  Buffer src = mapped_buffer(1), dst = mapped_buffer(0);
  auto copy = [&](int) {
    size_t chunk = kBytes / threads;
    auto part = [&](int t) {
      std::memcpy(static_cast<char*>(dst.get()) + t * chunk, static_cast<char*>(src.get()) + t * chunk, chunk);
    };
    if (threads == 1) {
      part(0);
    } else {
      std::vector<std::thread> team;
      for (int t = 0; t < threads; ++t) team.emplace_back(part, t);
      for (auto& member : team) member.join();
    }
    benchmark::DoNotOptimize(dst.get());
    benchmark::ClobberMemory();
  };
  copy(0);  // warm-up
  return time_repeated(iterations, copy);
}

// memset of 64 MiB into a buffer allocated just before (as the executor does for every kernel
// output) or into one kept mapped: the difference is the price of first-touch page faults.
Samples memset_samples(int iterations, bool fresh) {
  Buffer kept = mapped_buffer(0);
  auto write = [&](int i) {
    Buffer fresh_buffer(fresh ? std::aligned_alloc(64, kBytes) : nullptr, &std::free);
    void* p = fresh ? fresh_buffer.get() : kept.get();
    std::memset(p, i & 0x7f, kBytes);
    benchmark::DoNotOptimize(p);
    benchmark::ClobberMemory();
  };
  write(0);
  return time_repeated(iterations, write);
}

struct Variant {
  const char* name;
  bool tensor_operands;
  bool linear = false;  // y = x * a + b: no GELU, so nothing but memory traffic bounds it
  double bytes() const { return (tensor_operands ? 5.0 : 2.0) * kBytes; }
};

struct FusedRun {
  Samples times;
  int64_t plan_cache_hits = 0, kernels_run = 0;  // over the timed iterations
};

// Realizes y = gelu(x * a + b) * c `iterations` times, each a new graph over realized inputs.
FusedRun fused_samples(const Variant& variant, int iterations) {
  constexpr int kInputSets = 3;
  std::vector<std::vector<kiln::Tensor>> inputs;  // per set: x (N), then a, b, c (N) for tensors
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
                     : variant.linear        ? in[0] * (1.5 + 0.01 * i) + 0.25
                                             : kiln::gelu(in[0] * (1.5 + 0.01 * i) + 0.25) * 0.75;
    y.realize();
    benchmark::DoNotOptimize(y.data());
  };
  for (int i = 0; i < 3; ++i) run(i);  // the first is a plan miss: schedule, compile or load
  kiln::jit::reset_stats();
  FusedRun r;
  r.times = time_repeated(iterations, run);
  r.plan_cache_hits = kiln::jit::stats().plan_cache_hits;
  r.kernels_run = kiln::jit::stats().kernels_run;
  return r;
}

void print_row(const std::string& name, const Samples& t, double bytes, double baseline_gbps, const std::string& note) {
  fmt::print("{:<36} {:>7.2f}ms {:>7.2f}ms", name, median(t) * 1e3, best(t) * 1e3);
  if (bytes > 0) fmt::print(" {:>9.2f} {:>9.2f}", gbps(bytes, median(t)), gbps(bytes, median(t)) / baseline_gbps);
  fmt::print("{}\n", note);
}

}  // namespace

int main(int argc, char** argv) {
  int iterations = argc > 1 ? std::atoi(argv[1]) : 15;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (kiln::flags().num_threads > 0) threads = kiln::flags().num_threads;
  fmt::print("bench_fusion: y = gelu(x * a + b) * c, {} float32 ({} MiB per tensor), {} iterations, {} threads\n\n",
             kElements, kBytes >> 20, iterations, threads);

  const Variant variants[] = {{"fused, a/b/c scalars (128 MiB)", false},
                              {"fused, a/b/c tensors (320 MiB)", true},
                              {"y = x * a + b, scalars (128 MiB)", false, true}};
  Samples copy1 = memcpy_samples(iterations, 1);
  std::vector<FusedRun> fused;
  for (const Variant& v : variants) fused.push_back(fused_samples(v, iterations));
  Samples after = memcpy_samples(iterations, 1);
  copy1.insert(copy1.end(), after.begin(), after.end());
  Samples copyN = threads > 1 ? memcpy_samples(iterations, threads) : Samples{};
  Samples touched = memset_samples(iterations, false), fresh = memset_samples(iterations, true);

  const double copy_bytes = 2.0 * kBytes;  // read 64 MiB + write 64 MiB
  const double baseline = gbps(copy_bytes, median(copy1));
  fmt::print("{:<36} {:>9} {:>9} {:>9} {:>9}\n", "", "median", "best", "GB/s", "x memcpy");
  print_row("memcpy 64 MiB, 1 thread (baseline)", copy1, copy_bytes, baseline, "");
  if (threads > 1) print_row(fmt::format("memcpy 64 MiB, {} threads", threads), copyN, copy_bytes, baseline, "");
  bool met = true, met_threads = threads > 1;
  const double baseline_threads = threads > 1 ? gbps(copy_bytes, median(copyN)) : 0;
  for (size_t i = 0; i < fused.size(); ++i) {
    const Variant& v = variants[i];
    met &= gbps(v.bytes(), median(fused[i].times)) / baseline >= kTargetRatio;
    if (threads > 1) met_threads &= gbps(v.bytes(), median(fused[i].times)) / baseline_threads >= kTargetRatioThreads;
    print_row(v.name, fused[i].times, v.bytes(), baseline,
              fmt::format("   ({} kernels run, {} plan cache hits)", fused[i].kernels_run, fused[i].plan_cache_hits));
  }
  print_row("memset 64 MiB, mapped buffer", touched, 0, 0, "");
  print_row("memset 64 MiB, fresh allocation", fresh, 0, 0,
            fmt::format("   -> {:.1f} ms of page faults per fresh 64 MiB buffer", (median(fresh) - median(touched)) * 1e3));

#ifdef __GLIBC__
  // Diagnostic: glibc serves every block from the heap and never returns memory, so a freed
  // 64 MiB output is reused with its pages mapped, as a caching allocator would do.
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
  fmt::print("\nthe same with malloc keeping freed memory mapped (what a caching allocator would give):\n");
  for (const Variant& v : variants) print_row(v.name, fused_samples(v, iterations).times, v.bytes(), baseline, "");
#endif
  fmt::print("\ntarget: fused GB/s >= {:.2f} x single-thread memcpy GB/s, default allocator: {}\n", kTargetRatio,
             met ? "met" : "MISSED");
  if (threads > 1) {
    fmt::print("target: fused GB/s >= {:.2f} x {}-thread memcpy GB/s ({:.2f} GB/s):", kTargetRatioThreads, threads,
               baseline_threads);
    for (size_t i = 0; i < fused.size(); ++i)
      fmt::print(" {} {:.2f}x", variants[i].tensor_operands ? "tensors" : variants[i].linear ? "x*a+b" : "scalars",
                 gbps(variants[i].bytes(), median(fused[i].times)) / baseline_threads);
    fmt::print(", {}\n", met_threads ? "met" : "MISSED");
  }
  return 0;
}
