// bench_cuda: kiln on a CUDA GPU, each figure next to a baseline measured in the same run.
//
//   1  fused elementwise chain  y = relu(x * a + b) * c, 256M float32, a/b/c scalars (a changes
//      every run, so each run computes a fresh result); GB/s counting x read once and y written
//      once, against a device-to-device copy of the same bytes (read + write).      target >= 0.80
//   2  row softmax and layer norm over 65536 x 1024 float32; GB/s counting the input read once
//      and the output written once, against the same copy of the same bytes.        target >= 0.70
//   2b a full reduction: sum of 256M float32 into one value (kiln splits it over ~1024 blocks);
//      GB/s counting x read once, against the same copy.              kiln's own target >= 0.70
//   3  matmul 8192 x 8192 x 8192 bfloat16 (fp32 accumulation) through kiln, against cublasGemmEx
//      on kiln's stream in the same process; TFLOP/s = 2 M N K / time.              target >= 0.90
//   4  training steps on Fashion-MNIST shapes (synthetic batch on the device): the MLP
//      784-512-512-10 and the CNN of samples/train_mnist.cpp, batch 128, SGD momentum 0.9 lr 0.05,
//      cross entropy, opt.step(loss), loss.item() every step; examples/s against PyTorch on the
//      same GPU (bench/pytorch_cuda.py, read from --pytorch-json).                 target >= 1.0
//
// Timing: every sample is `inner` runs queued back to back, then cuda::synchronize(0); the
// sample's time is the total over `inner` (host work overlaps the GPU, as in a real program).
// Figures are medians over --reps samples, after warm-up runs (the first runs compile kernels).
// The copy baseline is sampled before and after kiln's runs, and both halves enter its median.
// Results are checked too: 1-3 against a host reference on their first row (3 also against
// cuBLAS's output), 4 by its loss falling; a figure whose check fails reads "WRONG RESULT".
//
// --scale F multiplies the work of every figure: the element count of 1 and 2, the flop count of
// 3 (each matmul dimension by F^(1/3), a multiple of 16) and the batch of 4 (8 to 128). Under
// KILN_CUDA_EMULATOR=1 (no GPU) everything runs on the host emulator: use a tiny scale; the
// figures then say nothing about speed, and PASS/FAIL reads "n/a (emulator)".
//
// Build and run (from the repository root; needs the CUDA toolkit for the cuBLAS baseline):
//   cmake -S . -B build-bench -DKILN_BUILD_TESTS=OFF && cmake --build build-bench -j2 --target bench_cuda
//   python3 bench/pytorch_cuda.py --json /tmp/pytorch_cuda.json           # PyTorch's side
//   ./build-bench/bench/bench_cuda --pytorch-json /tmp/pytorch_cuda.json [--reps 20] [--json out.json]
//   KILN_CUDA_EMULATOR=1 ./build-bench/bench/bench_cuda --scale 0.0001 --reps 3   # no GPU
#include <kiln/kiln.h>

#include "backends/cuda/cuda_runtime.h"  // measures kiln's stream and copies against raw ones
#include "samples/mnist_models.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <fmt/format.h>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if KILN_BENCH_CUBLAS
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#endif

namespace {

namespace nn = kiln::nn;
namespace cuda = kiln::cuda;
using kiln::Tensor;
using json = nlohmann::ordered_json;

const kiln::Device kGpu = kiln::Device::cuda(0);
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr int kWarmup = 3;  // untimed runs before each measurement: compile, load, fill the pool

using Samples = std::vector<double>;  // seconds per run

double median(Samples v) {
  if (v.empty()) return kNaN;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Seconds per run of `run(i)` (i counts every call, warm-up included): `reps` samples of `inner`
// runs each, the sample closed by a synchronize.
Samples time_on_device(int reps, int inner, const std::function<void(int)>& run) {
  int i = 0;
  for (int w = 0; w < kWarmup; ++w) run(i++);
  cuda::synchronize(0);
  Samples samples;
  for (int r = 0; r < reps; ++r) {
    auto start = std::chrono::steady_clock::now();
    for (int k = 0; k < inner; ++k) run(i++);
    cuda::synchronize(0);
    samples.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / inner);
  }
  return samples;
}

// New tensors made inside `make` start on cuda:0: large inputs are generated on the device
// instead of on the host and copied.
Tensor on_device(const std::function<Tensor()>& make) {
  kiln::FlagsGuard guard;
  kiln::flags().use_cuda = true;
  return make().realize();
}

// The first `count` elements of a realized tensor, as doubles on the host.
std::vector<double> head(const Tensor& t, int64_t count) {
  return t.reshape({t.numel()}).slice(0, 0, std::min(count, t.numel())).to_doubles();
}

// The largest |got - want| relative to the largest |want|: elements near zero do not count more.
// NaN anywhere (or a size mismatch) gives NaN, which no tolerance accepts.
double max_relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return kNaN;
  double scale = 1e-6, err = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < want.size(); ++i) {
    double e = std::abs(got[i] - want[i]) / scale;
    if (!(e <= err)) err = e;  // keeps a NaN
  }
  return err;
}

// One row of the table. `value` and `baseline` are in `unit`, higher is better; the target is a
// floor on value / baseline.
struct Figure {
  Figure(std::string id_, std::string name_, std::string unit_, std::string baseline_name_, double target_)
      : id(std::move(id_)), name(std::move(name_)), unit(std::move(unit_)),
        baseline_name(std::move(baseline_name_)), target(target_) {}
  std::string id, name, unit, baseline_name;
  double target;
  double value = kNaN, baseline = kNaN;
  std::string note, error;
  double pytorch = kNaN;  // PyTorch's figure on the same GPU (rows 1-3: for reference)
  // The result checked against a reference before timing: its error and the error allowed. A
  // figure of wrong results is no figure.
  double check_error = kNaN, check_tolerance = 1e-4;

  double ratio() const { return value / baseline; }
  bool wrong() const { return !(check_error <= check_tolerance); }
  std::string result() const {
    if (!error.empty()) return "ERROR";
    if (wrong()) return "WRONG RESULT";
    if (cuda::emulated()) return "n/a (emulator)";
    if (std::isnan(ratio())) return "n/a (no baseline)";
    return ratio() >= target ? "PASS" : "FAIL";
  }
};

struct Sizes {
  int64_t elements, rows, cols = 1024, matmul, batch;
  explicit Sizes(double scale)
      : elements(std::max<int64_t>(1024, std::llround(256.0 * (1 << 20) * scale))),
        rows(std::max<int64_t>(1, std::llround(65536 * scale))),
        matmul(std::max<int64_t>(16, 16 * std::llround(8192 * std::cbrt(scale) / 16))),
        batch(std::clamp<int64_t>(std::llround(128 * scale), 8, 128)) {}
};

// "256M" for whole multiples of 2^20, the number otherwise.
std::string count(int64_t n) { return n % (1 << 20) == 0 ? fmt::format("{}M", n >> 20) : fmt::format("{}", n); }

// ---- baseline: device-to-device copy ----

// A device-to-device copy of `bytes`, timed as kiln's runs are.
Samples copy_samples(size_t bytes, int reps, int inner) {
  auto src = kiln::memory::allocate_storage(bytes, kGpu), dst = kiln::memory::allocate_storage(bytes, kGpu);
  cuda::fill_bytes(0, src->data, 1, bytes);
  return time_on_device(reps, inner, [&](int) { cuda::copy_on_device(0, dst->data, src->data, bytes); });
}

// Times `run`, which moves `moved` bytes, between two halves of the copy baseline over `bytes`
// (moved: read + write).
void bandwidth_figure(Figure& f, size_t bytes, double moved, int reps, int inner, const std::function<void(int)>& run) {
  Samples copy = copy_samples(bytes, reps, inner);
  Samples kiln_runs = time_on_device(reps, inner, run);
  Samples after = copy_samples(bytes, reps, inner);
  copy.insert(copy.end(), after.begin(), after.end());
  f.value = moved / median(kiln_runs) / 1e9;
  f.baseline = 2.0 * static_cast<double>(bytes) / median(copy) / 1e9;
}

// ---- 1: fused elementwise chain ----

Figure fused_chain(const Sizes& s, int reps) {
  Figure f("fused_chain", fmt::format("fused relu(x*a+b)*c, {} f32", count(s.elements)), "GB/s", "D2D copy", 0.80);
  Tensor x = on_device([&] { return kiln::randn({s.elements}); });  // (N)
  auto chain = [&](int i) { return kiln::relu(x * (1.5 + 1e-3 * (i % 64)) + 0.25) * 0.75; };
  std::vector<double> xs = head(x, 4096), want;
  for (double v : xs) want.push_back(std::max(v * 1.5 + 0.25, 0.0) * 0.75);
  f.check_error = max_relative_error(head(chain(0).realize(), 4096), want);
  f.note = fmt::format("check {:.1e}", f.check_error);
  const size_t bytes = static_cast<size_t>(s.elements) * sizeof(float);
  bandwidth_figure(f, bytes, 2.0 * static_cast<double>(bytes), reps, 10, [&](int i) {
    Tensor y = chain(i);  // a fresh result every run; the last handle goes at the end of the run
    y.realize();
  });
  return f;
}

// ---- 2: softmax and layer norm over rows ----

Figure row_op(const Sizes& s, int reps, bool softmax) {
  const char* id = softmax ? "softmax" : "layer_norm";
  Figure f(id, fmt::format("{} {}x{} f32", id, s.rows, s.cols), "GB/s", "D2D copy", 0.70);
  Tensor x = on_device([&] { return kiln::randn({s.rows, s.cols}); });  // (R, C)
  Tensor w = on_device([&] { return kiln::rand({s.cols}) + 0.5; });     // (C)
  Tensor b = on_device([&] { return kiln::randn({s.cols}); });          // (C)
  auto op = [&] { return softmax ? kiln::softmax(x, -1) : kiln::layer_norm(x, {s.cols}, w, b); };
  // Host reference of the first row.
  std::vector<double> row = head(x, s.cols), ws = head(w, s.cols), bs = head(b, s.cols), want(row.size());
  double peak = *std::max_element(row.begin(), row.end()), total = 0, mean = 0, var = 0;
  for (double v : row) total += std::exp(v - peak), mean += v / static_cast<double>(row.size());
  for (double v : row) var += (v - mean) * (v - mean) / static_cast<double>(row.size());
  for (size_t j = 0; j < row.size(); ++j)
    want[j] = softmax ? std::exp(row[j] - peak) / total : (row[j] - mean) / std::sqrt(var + 1e-5) * ws[j] + bs[j];
  f.check_error = max_relative_error(head(op().realize(), s.cols), want);
  f.note = fmt::format("check {:.1e}", f.check_error);
  const size_t bytes = static_cast<size_t>(s.rows * s.cols) * sizeof(float);
  bandwidth_figure(f, bytes, 2.0 * static_cast<double>(bytes), reps, 10, [&](int) {
    Tensor y = op();
    y.realize();
  });
  return f;
}

// ---- 2b: a full reduction ----

Figure full_sum(const Sizes& s, int reps) {
  Figure f("sum", fmt::format("sum of {} f32", count(s.elements)), "GB/s", "D2D copy", 0.70);
  Tensor x = on_device([&] { return kiln::rand({s.elements}); });  // (N)
  double want = 0;
  for (float v : x.to_vector<float>()) want += v;
  f.check_error = max_relative_error({kiln::sum(x).item()}, {want});
  f.note = fmt::format("check {:.1e}", f.check_error);
  const size_t bytes = static_cast<size_t>(s.elements) * sizeof(float);
  bandwidth_figure(f, bytes, static_cast<double>(bytes), reps, 10, [&](int) {
    Tensor total = kiln::sum(x);
    total.realize();
  });
  return f;
}

// ---- 3: bf16 matmul against raw cuBLAS ----

#if KILN_BENCH_CUBLAS
void check_cublas(cublasStatus_t status, const char* what) {
  KILN_CHECK(status == CUBLAS_STATUS_SUCCESS, "bench_cuda", "{}: {}", what, cublasGetStatusString(status));
}
// A cuBLAS handle destroyed however the figure ends (a failed call throws).
struct CublasDestroy {
  void operator()(cublasHandle_t handle) const { cublasDestroy(handle); }
};
using CublasHandle = std::unique_ptr<std::remove_pointer_t<cublasHandle_t>, CublasDestroy>;
#endif

Figure matmul_bf16(const Sizes& s, int reps) {
  const int64_t n = s.matmul;
  Figure f("matmul_bf16", fmt::format("matmul {}^3 bf16", n), "TFLOP/s", "cublasGemmEx", 0.90);
  const double flops = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  Tensor a = on_device([&] { return kiln::cast(kiln::randn({n, n}), kiln::DType::BFloat16); });  // (M, K)
  Tensor b = on_device([&] { return kiln::cast(kiln::randn({n, n}), kiln::DType::BFloat16); });  // (K, N)
  Samples kiln_runs = time_on_device(reps, 5, [&](int) {
    Tensor c = kiln::matmul(a, b);  // (M, N) bf16
    c.realize();
  });
  f.value = flops / median(kiln_runs) / 1e12;
  // Row 0 of C against the host: bf16 inputs, products summed in double, rounded once to bf16 by
  // kiln and cuBLAS alike, so 1e-2 of the row's largest value covers the rounding.
  Tensor c = kiln::matmul(a, b).realize();
  std::vector<double> kiln_row = head(c, n), a_row = head(a, n), want(static_cast<size_t>(n), 0.0);
  std::vector<double> b_all = b.to_doubles();  // (K, N)
  for (int64_t k = 0; k < n; ++k)
    for (int64_t j = 0; j < n; ++j) want[j] += a_row[k] * b_all[k * n + j];
  f.check_error = max_relative_error(kiln_row, want);
  f.check_tolerance = 1e-2;
  f.note = fmt::format("row 0 check {:.1e}", f.check_error);

#if KILN_BENCH_CUBLAS
  if (cuda::emulated()) {
    f.note += "; cuBLAS needs a real GPU";
    return f;
  }
  // Row-major C = A B is column-major C^T = B^T A^T: cuBLAS gets B first, with leading dimension N.
  auto out = kiln::memory::allocate_storage(static_cast<size_t>(n * n) * 2, kGpu);  // (M, N) bf16
  cublasHandle_t raw_handle = nullptr;
  check_cublas(cublasCreate(&raw_handle), "cublasCreate");
  CublasHandle handle(raw_handle);
  check_cublas(cublasSetStream(raw_handle, static_cast<cudaStream_t>(cuda::stream(0))), "cublasSetStream");
  const float alpha = 1, beta = 0;
  const int dim = static_cast<int>(n);
  auto gemm = [&](int) {
    check_cublas(cublasGemmEx(raw_handle, CUBLAS_OP_N, CUBLAS_OP_N, dim, dim, dim, &alpha, b.data(), CUDA_R_16BF, dim,
                              a.data(), CUDA_R_16BF, dim, &beta, out->data, CUDA_R_16BF, dim, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
  };
  Samples cublas_runs = time_on_device(reps, 5, gemm);
  std::vector<uint16_t> raw(static_cast<size_t>(n));
  cuda::copy_to_host(0, raw.data(), out->data, raw.size() * 2);
  std::vector<double> cublas_row;
  for (uint16_t v : raw) cublas_row.push_back(kiln::bfloat16_to_float(v));
  f.baseline = flops / median(cublas_runs) / 1e12;
  f.note += fmt::format(", vs cuBLAS {:.1e}", max_relative_error(kiln_row, cublas_row));
#else
  f.note += "; built without the CUDA toolkit: no cuBLAS baseline";
#endif
  return f;
}

// ---- 4: training steps ----

// The models of samples/train_mnist.cpp.
using kiln::samples::Cnn;
using kiln::samples::Mlp;

constexpr int kStepsPerSample = 10;

template <typename Model>
// `amp`: the autocast type of the forward (Float32: none), as torch.autocast on PyTorch's side.
Figure training(const Sizes& s, int reps, const char* id, const char* title, kiln::DType amp = kiln::DType::Float32) {
  Figure f(id, fmt::format("{} train step{}, batch {}", title, amp == kiln::DType::Float32 ? "" : " (bf16 autocast)", s.batch),
           "ex/s", "PyTorch", 1.0);
  kiln::manual_seed(0);
  Model model;
  model.to(kGpu);
  kiln::optim::SGD opt(model.parameters(), kiln::optim::SGDOptions(0.05).momentum(0.9));
  Tensor x = kiln::randn({s.batch, 784}).realize().to(kGpu);  // (B, 784): one synthetic batch
  Tensor y = kiln::cast(kiln::floor(kiln::rand({s.batch}) * 10.0), kiln::DType::Int64).realize().to(kGpu);  // (B)
  double first = kNaN, last = kNaN;
  auto step = [&](int) {
    Tensor loss;
    {
      kiln::AutocastGuard autocast(amp);
      loss = nn::cross_entropy(model.forward(x), y);
    }
    opt.step(loss);
    last = loss.item();  // as train_mnist does: the host waits for every step
    if (std::isnan(first)) first = last;
  };
  // item() already waits for each step, so the synchronize closing each sample costs nothing.
  Samples per_step = time_on_device(reps, kStepsPerSample, step);
  f.value = static_cast<double>(s.batch) / median(per_step);
  // One batch again and again: the loss must fall (and stay finite), or the steps are wrong.
  f.check_error = std::isfinite(last) && last < first ? 0.0 : kNaN;
  f.note = fmt::format("loss {:.4g} -> {:.4g}", first, last);
  return f;
}

// ---- the PyTorch side, table and JSON ----

// Reads bench/pytorch_cuda.py's JSON into each figure's `pytorch` when it measured the same sizes;
// for the training figures it is the baseline, when PyTorch ran on a GPU. Returns a line about
// what it read.
std::string read_pytorch(const std::string& path, std::vector<Figure>& figures, double scale, int64_t batch) {
  if (path.empty()) return "PyTorch: not given (--pytorch-json)";
  json torch;
  try {
    std::ifstream in(path);
    if (!in) return fmt::format("PyTorch: {} not found", path);
    torch = json::parse(in);
  } catch (const std::exception& e) {
    return fmt::format("PyTorch: {} unreadable ({})", path, e.what());
  }
  if (!torch.value("available", false))
    return fmt::format("PyTorch: did not run ({})", torch.value("reason", "no reason given"));
  std::string device = torch.value("device", "?");
  double torch_scale = torch.value("scale", 0.0);
  if (std::abs(torch_scale - scale) > 1e-9 * scale)
    return fmt::format("PyTorch: measured other sizes (--scale {} there, {} here); not compared", torch_scale, scale);
  bool comparable = device == "cuda" && torch.value("batch", int64_t{0}) == batch;
  for (Figure& f : figures) {
    if (!torch.contains("figures") || !torch["figures"].contains(f.id)) continue;
    const json& t = torch["figures"][f.id];
    if (!t.contains("value") || !t["value"].is_number()) continue;
    f.pytorch = t["value"].get<double>();
    if (f.unit == "ex/s" && comparable) f.baseline = f.pytorch;
  }
  return fmt::format("PyTorch {} on {} ({}){}", torch.value("torch", "?"), device, torch.value("gpu", "?"),
                     comparable ? "" : fmt::format(": not comparable (device {}, batch {} vs {})", device,
                                                   torch.value("batch", int64_t{0}), batch));
}

std::string number(double v) {
  if (std::isnan(v)) return "-";
  return std::abs(v) >= 100 ? fmt::format("{:.0f}", v) : std::abs(v) >= 1 ? fmt::format("{:.2f}", v)
                                                                           : fmt::format("{:.3g}", v);
}

void print_table(const std::vector<Figure>& figures) {
  fmt::print("{:<36} {:>9} {:>9} {:<13} {:>6} {:>7}  {:<18} {:>9}  {}\n", "figure", "kiln", "baseline", "(baseline)",
             "ratio", "target", "result", "PyTorch", "notes");
  for (const Figure& f : figures) {
    fmt::print("{:<36} {:>9} {:>9} {:<13} {:>6} {:>7}  {:<18} {:>9}  {}\n", f.name, number(f.value),
               number(f.baseline), f.baseline_name, std::isnan(f.ratio()) ? "-" : fmt::format("{:.2f}", f.ratio()),
               fmt::format(">={:.2f}", f.target), f.result(), number(f.pytorch),
               f.unit + (f.error.empty() ? "; " + f.note : "; error: " + f.error));
  }
}

json to_json(const std::vector<Figure>& figures) {
  auto num = [](double v) { return std::isnan(v) ? json(nullptr) : json(v); };
  json out = json::array();
  for (const Figure& f : figures)
    out.push_back({{"id", f.id}, {"name", f.name}, {"unit", f.unit}, {"value", num(f.value)},
                   {"baseline_name", f.baseline_name}, {"baseline", num(f.baseline)}, {"ratio", num(f.ratio())},
                   {"target", f.target}, {"result", f.result()}, {"pytorch", num(f.pytorch)}, {"note", f.note},
                   {"error", f.error}});
  return out;
}

// Runs one figure; a kiln::Error (or any other) becomes the row's error instead of ending the run.
void add(std::vector<Figure>& figures, Figure placeholder, const std::function<Figure()>& measure) {
  try {
    figures.push_back(measure());
  } catch (const std::exception& e) {
    placeholder.error = e.what();
    std::replace(placeholder.error.begin(), placeholder.error.end(), '\n', ' ');
    figures.push_back(placeholder);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kiln on a CUDA GPU against copy, cuBLAS and PyTorch baselines"};
  double scale = 1.0;
  int reps = 20;
  std::string json_path, pytorch_path;
  app.add_option("--scale", scale, "multiply every size by this (e.g. 0.0001 on the emulator)")
      ->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "timed samples per figure (medians are reported)")->check(CLI::PositiveNumber);
  app.add_option("--json", json_path, "write the figures to this JSON file");
  app.add_option("--pytorch-json", pytorch_path, "PyTorch's figures, from bench/pytorch_cuda.py --json");
  CLI11_PARSE(app, argc, argv);

  if (!cuda::available()) {
    fmt::print("bench_cuda: skipped, no CUDA device ({}); KILN_CUDA_EMULATOR=1 runs it on the host\n",
               cuda::unavailable_reason());
    return 0;
  }
  const Sizes sizes(scale);
  const std::string device = cuda::emulated() ? "host emulator (KILN_CUDA_EMULATOR=1)" : cuda::device_info(0).name;
  fmt::print("bench_cuda on cuda:0 = {}; scale {}, {} samples per figure after {} warm-up runs\n", device, scale,
             reps, kWarmup);
  fmt::print("timing: each sample queues several runs back to back, then synchronizes; medians\n");
  fmt::print("training: loss.item() read after every step (the host waits for each step), {} steps per sample\n\n",
             kStepsPerSample);

  // Each figure is followed by a progress line and the JSON rewritten ("complete": false until
  // the last), so a run stopped by a timeout still leaves what it measured.
  struct Measurement {
    Figure placeholder;  // the row reported if `measure` throws
    std::function<Figure()> measure;
  };
  const std::vector<Measurement> plan = {
      {{"fused_chain", "fused relu(x*a+b)*c", "GB/s", "D2D copy", 0.80}, [&] { return fused_chain(sizes, reps); }},
      {{"softmax", "softmax", "GB/s", "D2D copy", 0.70}, [&] { return row_op(sizes, reps, true); }},
      {{"layer_norm", "layer_norm", "GB/s", "D2D copy", 0.70}, [&] { return row_op(sizes, reps, false); }},
      {{"sum", "sum", "GB/s", "D2D copy", 0.70}, [&] { return full_sum(sizes, reps); }},
      {{"matmul_bf16", "matmul bf16", "TFLOP/s", "cublasGemmEx", 0.90}, [&] { return matmul_bf16(sizes, reps); }},
      {{"train_mlp", "MLP train step", "ex/s", "PyTorch", 1.0},
       [&] { return training<Mlp>(sizes, reps, "train_mlp", "MLP"); }},
      {{"train_cnn", "CNN train step", "ex/s", "PyTorch", 1.0},
       [&] { return training<Cnn>(sizes, reps, "train_cnn", "CNN"); }},
      {{"train_mlp_bf16", "MLP train step (bf16 autocast)", "ex/s", "PyTorch", 1.0},
       [&] { return training<Mlp>(sizes, reps, "train_mlp_bf16", "MLP", kiln::DType::BFloat16); }},
      {{"train_cnn_bf16", "CNN train step (bf16 autocast)", "ex/s", "PyTorch", 1.0},
       [&] { return training<Cnn>(sizes, reps, "train_cnn_bf16", "CNN", kiln::DType::BFloat16); }},
  };
  std::vector<Figure> figures;
  std::string torch_line;
  double seconds = 0;
  auto start = std::chrono::steady_clock::now();
  for (const Measurement& m : plan) {
    add(figures, m.placeholder, m.measure);
    kiln::empty_cache();  // the figure's tensors are gone; the next figure gets the whole device
    torch_line = read_pytorch(pytorch_path, figures, scale, sizes.batch);  // small file; fills every row so far
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const Figure& f = figures.back();
    fmt::print(stderr, "[bench_cuda] {:.1f} s: {}: {} {} vs {} {}: {}\n", seconds, f.name, number(f.value), f.unit,
               f.baseline_name, number(f.baseline), f.error.empty() ? f.result() : f.error);
    if (json_path.empty()) continue;
    json out = {{"complete", figures.size() == plan.size()}, {"device", device}, {"emulated", cuda::emulated()},
                {"scale", scale}, {"reps", reps}, {"batch", sizes.batch}, {"seconds", seconds},
                {"pytorch", torch_line}, {"train_policy", "loss.item() every step"}, {"figures", to_json(figures)}};
    std::ofstream file(json_path);
    file << out.dump(2) << "\n";
    if (!file) {
      fmt::print(stderr, "bench_cuda: cannot write {}\n", json_path);
      return 1;
    }
  }

  print_table(figures);
  fmt::print("\n{}\n", torch_line);
  const auto& jit = kiln::jit::stats();
  fmt::print("{:.1f} s in all; jit: {} kernels compiled ({:.2f} s), {} plan cache hits\n", seconds,
             jit.kernels_compiled, jit.compile_seconds, jit.plan_cache_hits);
  return 0;
}
