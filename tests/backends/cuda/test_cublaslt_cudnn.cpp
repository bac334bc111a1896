// cuda::cublaslt_matmul and cuda::cudnn_conv2d against naive loops in double, on a real GPU: the
// operand layouts kiln's views produce (transposed, padded, strided, reversed, repeated rows,
// broadcast batches, unaligned pointers), size-1 and empty dims, and every convolution pass. On
// every machine: what the unit claims to support, and a kiln::Error for anything else.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <cstddef>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/flags.h"
#include "memory/allocator.h"
#include "backends/cuda/cuda_runtime.h"
#include "backends/cuda/cublaslt.h"
#include "backends/cuda/cudnn.h"
#include "backends/cuda/nvrtc.h"
#include "tests/backends/matmul_layouts.h"

using kiln::DType;
using namespace kiln::test;
using kiln::ConvGeometry;
using kiln::ConvPass;

namespace {

// The library kernels need a real GPU; the host emulator's memory is the host's.
bool have_gpu() {
  if (kiln::cuda::available() && !kiln::cuda::emulated()) return true;
  const std::string reason =
      kiln::cuda::emulated() ? std::string("cuda:0 is the host emulator") : kiln::cuda::unavailable_reason();
  WARN("SKIPPED: no CUDA device (" << reason << ")");
  return false;
}

// `count` values of dtype t on the host: random in [-1, 1] (already rounded to t, so the double
// reference sees exactly what the GPU reads), or NaN, to catch elements nobody writes.
std::vector<std::byte> random_values(DType t, size_t count, std::mt19937& rng) {
  std::vector<std::byte> out(count * kiln::dtype_size(t));
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  for (size_t i = 0; i < count; ++i) kiln::store_from_double(out.data(), t, i, dist(rng));
  return out;
}

std::vector<std::byte> nan_values(DType t, size_t count) {
  std::vector<std::byte> out(count * kiln::dtype_size(t));
  for (size_t i = 0; i < count; ++i) kiln::store_from_double(out.data(), t, i, std::numeric_limits<double>::quiet_NaN());
  return out;
}

std::shared_ptr<kiln::Storage> to_device(const std::vector<std::byte>& host) {
  auto storage = kiln::memory::allocate_storage(host.size(), kiln::Device::cuda(0));
  kiln::cuda::copy_to_device(0, storage->data, host.data(), host.size());
  return storage;
}

// Waits for everything queued before it, so a failed library call shows up here at the latest.
std::vector<std::byte> to_host(const kiln::Storage& storage, size_t bytes) {
  std::vector<std::byte> host(bytes);
  kiln::cuda::copy_to_host(0, host.data(), storage.data, bytes);
  return host;
}

double at(const std::vector<std::byte>& buffer, DType t, int64_t i) {
  return kiln::load_as_double(buffer.data(), t, static_cast<size_t>(i));
}

// Counts elements off the double reference by more than tol * sum |products| (NaN counts too).
int64_t count_bad(const std::vector<std::byte>& got, DType t, const std::vector<double>& expected,
                  const std::vector<double>& magnitude, double tol) {
  int64_t bad = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double err = std::abs(at(got, t, static_cast<int64_t>(i)) - expected[i]);
    if (!(err <= tol * magnitude[i] + 1e-6)) ++bad;
  }
  return bad;
}

// Error bounds relative to sum |a*b|: fp32 and fp64 accumulate exactly enough; fp16 and bf16
// round the output (2^-11 and 2^-8) and may round split-K partial sums too.
double matmul_tolerance(DType t) {
  switch (t) {
    case DType::Float64: return 1e-12;
    case DType::Float16: return 4e-3;
    case DType::BFloat16: return 2e-2;
    default: return 2e-5;
  }
}

// ---------------------------------------------------------------------------------------------
// Matmul
// ---------------------------------------------------------------------------------------------

// A (batch, rows, cols) operand: host values, their device copy, and the strides and element
// offset at which the matmul reads them.
struct Operand {
  DType dtype = DType::Float32;
  std::vector<std::byte> host;
  std::shared_ptr<kiln::Storage> device;
  int64_t strides[3] = {0, 0, 0};
  int64_t base = 0;  // element offset of (0, 0, 0)

  const void* device_data() const { return static_cast<const std::byte*>(device->data) + base * kiln::dtype_size(dtype); }
  double value(int64_t n, int64_t i, int64_t j) const {
    return at(host, dtype, base + n * strides[0] + i * strides[1] + j * strides[2]);
  }
};

// `shift` elements in front of the data leave the pointer less aligned than the allocation.
Operand make_operand(DType t, int64_t batch, int64_t rows, int64_t cols, Layout layout, bool broadcast,
                     int64_t shift, std::mt19937& rng) {
  const OperandShape shape = operand_shape(batch, rows, cols, layout, broadcast);
  Operand op;
  op.dtype = t;
  std::copy(std::begin(shape.strides), std::end(shape.strides), op.strides);
  op.base = shape.base + shift;
  op.host = random_values(t, static_cast<size_t>(shift + shape.stored), rng);
  op.device = to_device(op.host);
  return op;
}

void check_matmul(const MatmulCase& cs, double tol) {
  INFO(describe(cs));
  std::mt19937 rng(static_cast<unsigned>(cs.batch * 1000003 + cs.M * 10007 + cs.K * 101 + cs.N));
  const DType t = cs.dtype;
  const Operand a = make_operand(t, cs.batch, cs.M, cs.K, cs.a_layout, cs.a_broadcast, cs.a_shift, rng);
  const Operand b = make_operand(t, cs.batch, cs.K, cs.N, cs.b_layout, cs.b_broadcast, cs.b_shift, rng);
  const int64_t c_count = cs.batch * cs.M * cs.N;
  auto c = to_device(nan_values(t, static_cast<size_t>(cs.c_shift + c_count)));
  void* c_data = static_cast<std::byte*>(c->data) + cs.c_shift * kiln::dtype_size(t);

  kiln::cuda::cublaslt_matmul(0, t, a.device_data(), a.strides, b.device_data(), b.strides, c_data, cs.batch, cs.M,
                             cs.K, cs.N);

  const auto got_all = to_host(*c, static_cast<size_t>(cs.c_shift + c_count) * kiln::dtype_size(t));
  const std::vector<std::byte> got(got_all.begin() + cs.c_shift * static_cast<int64_t>(kiln::dtype_size(t)),
                                   got_all.end());
  std::vector<double> expected(static_cast<size_t>(c_count)), magnitude(static_cast<size_t>(c_count));
  for (int64_t n = 0; n < cs.batch; ++n)
    for (int64_t i = 0; i < cs.M; ++i)
      for (int64_t j = 0; j < cs.N; ++j) {
        const auto out = static_cast<size_t>((n * cs.M + i) * cs.N + j);
        for (int64_t k = 0; k < cs.K; ++k) {
          const double p = a.value(n, i, k) * b.value(n, k, j);
          expected[out] += p;
          magnitude[out] += std::abs(p);
        }
      }
  CHECK(count_bad(got, t, expected, magnitude, tol) == 0);
}

const DType kMatmulTypes[] = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16};
const Layout kLayouts[] = {Layout::RowMajor, Layout::Transposed, Layout::Padded,
                           Layout::Strided,  Layout::Reversed,   Layout::Repeated};

// ---------------------------------------------------------------------------------------------
// Convolution
// ---------------------------------------------------------------------------------------------

ConvGeometry make_geometry(int64_t N, int64_t C, int64_t H, int64_t W, int64_t OC, int64_t KH, int64_t KW,
                           int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h,
                           int64_t dilation_w, int64_t groups) {
  ConvGeometry g;
  g.N = N, g.C = C, g.H = H, g.W = W, g.OC = OC, g.KH = KH, g.KW = KW;
  g.stride[0] = stride_h, g.stride[1] = stride_w;
  g.padding[0] = pad_h, g.padding[1] = pad_w;
  g.dilation[0] = dilation_h, g.dilation[1] = dilation_w;
  g.groups = groups;
  g.OH = (H + 2 * pad_h - dilation_h * (KH - 1) - 1) / stride_h + 1;  // PyTorch's output size
  g.OW = (W + 2 * pad_w - dilation_w * (KW - 1) - 1) / stride_w + 1;
  return g;
}

int64_t x_count(const ConvGeometry& g) { return g.N * g.C * g.H * g.W; }
int64_t w_count(const ConvGeometry& g) { return g.OC * (g.C / g.groups) * g.KH * g.KW; }
int64_t y_count(const ConvGeometry& g) { return g.N * g.OC * g.OH * g.OW; }

// Calls f(x index, w index, y index) for every product the convolution sums: the definition of
// all three passes, in one loop nest.
template <class F>
void for_each_product(const ConvGeometry& g, F f) {
  const int64_t group_in = g.C / g.groups, group_out = g.OC / g.groups;
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t oc = 0; oc < g.OC; ++oc)
      for (int64_t oh = 0; oh < g.OH; ++oh)
        for (int64_t ow = 0; ow < g.OW; ++ow)
          for (int64_t c = 0; c < group_in; ++c)
            for (int64_t kh = 0; kh < g.KH; ++kh)
              for (int64_t kw = 0; kw < g.KW; ++kw) {
                const int64_t ih = oh * g.stride[0] - g.padding[0] + kh * g.dilation[0];
                const int64_t iw = ow * g.stride[1] - g.padding[1] + kw * g.dilation[1];
                if (ih < 0 || ih >= g.H || iw < 0 || iw >= g.W) continue;
                const int64_t channel = (oc / group_out) * group_in + c;
                f(((n * g.C + channel) * g.H + ih) * g.W + iw, ((oc * group_in + c) * g.KH + kh) * g.KW + kw,
                  ((n * g.OC + oc) * g.OH + oh) * g.OW + ow);
              }
}

double conv_tolerance(DType t) {
  switch (t) {
    case DType::Float16: return 1e-2;
    case DType::BFloat16: return 3e-2;
    default: return 5e-4;  // Winograd and FFT algorithms round more than a direct sum
  }
}

const char* pass_name(ConvPass pass) {
  switch (pass) {
    case ConvPass::Forward: return "forward";
    case ConvPass::BackwardData: return "backward data";
    case ConvPass::BackwardWeight: return "backward weight";
  }
  return "?";
}

void check_conv(ConvPass pass, DType t, const ConvGeometry& g, double tol) {
  INFO(pass_name(pass) << " " << kiln::dtype_name(t) << " x (" << g.N << ", " << g.C << ", " << g.H << ", " << g.W
       << ") OC " << g.OC << " kernel " << g.KH << "x" << g.KW << " stride " << g.stride[0] << "," << g.stride[1]
       << " padding " << g.padding[0] << "," << g.padding[1] << " dilation " << g.dilation[0] << ","
       << g.dilation[1] << " groups " << g.groups << " -> " << g.OH << "x" << g.OW);
  std::mt19937 rng(static_cast<unsigned>(g.N * 7919 + g.C * 104729 + g.OC * 31 + g.groups));
  // (a, b, out) element counts by pass, as ops/conv_geometry.h assigns the buffers.
  const int64_t a_count = pass == ConvPass::BackwardData ? y_count(g) : x_count(g);
  const int64_t b_count = pass == ConvPass::BackwardWeight ? y_count(g) : w_count(g);
  const int64_t out_count = pass == ConvPass::Forward        ? y_count(g)
                            : pass == ConvPass::BackwardData ? x_count(g)
                                                             : w_count(g);
  const auto a = random_values(t, static_cast<size_t>(a_count), rng);
  const auto b = random_values(t, static_cast<size_t>(b_count), rng);
  auto a_device = to_device(a), b_device = to_device(b);
  auto out_device = to_device(nan_values(t, static_cast<size_t>(out_count)));

  kiln::cuda::cudnn_conv2d(0, pass, t, g, a_device->data, b_device->data, out_device->data);

  const auto got = to_host(*out_device, static_cast<size_t>(out_count) * kiln::dtype_size(t));
  std::vector<double> expected(static_cast<size_t>(out_count)), magnitude(static_cast<size_t>(out_count));
  for_each_product(g, [&](int64_t x, int64_t w, int64_t y) {
    int64_t ia = x, ib = w, io = y;  // forward: a = x, b = w, out = y
    if (pass == ConvPass::BackwardData) ia = y, ib = w, io = x;
    if (pass == ConvPass::BackwardWeight) ia = x, ib = y, io = w;
    const double p = at(a, t, ia) * at(b, t, ib);
    expected[static_cast<size_t>(io)] += p;
    magnitude[static_cast<size_t>(io)] += std::abs(p);
  });
  CHECK(count_bad(got, t, expected, magnitude, tol) == 0);
}

const DType kConvTypes[] = {DType::Float32, DType::Float16, DType::BFloat16};
const ConvPass kPasses[] = {ConvPass::Forward, ConvPass::BackwardData, ConvPass::BackwardWeight};

}  // namespace

TEST_CASE("cuBLASLt and cuDNN answer which dtypes they run and refuse the others", "[cuda][device]") {
  for (int i = 0; i < kiln::kNumDTypes; ++i) {
    const auto t = static_cast<DType>(i);
    INFO(kiln::dtype_name(t));
    const bool matmul_type = t == DType::Float32 || t == DType::Float64 || t == DType::Float16 || t == DType::BFloat16;
    const bool conv_type = t == DType::Float32 || t == DType::Float16 || t == DType::BFloat16;
    CHECK(kiln::cuda::cublaslt_supports_matmul(t) == (KILN_WITH_CUDA && matmul_type));
    CHECK(kiln::cuda::cudnn_supports_conv(t) == (KILN_WITH_CUDA && KILN_WITH_CUDNN && conv_type));
  }
  // Refused before any pointer is touched.
  const int64_t s[3] = {1, 1, 1};
  CHECK_THROWS_AS(kiln::cuda::cublaslt_matmul(0, DType::Int32, nullptr, s, nullptr, s, nullptr, 1, 1, 1, 1),
                  kiln::Error);
  CHECK_THROWS_WITH(kiln::cuda::cublaslt_matmul(0, DType::Int32, nullptr, s, nullptr, s, nullptr, 1, 1, 1, 1),
                    Catch::Contains("matmul (cuBLASLt)") && Catch::Contains("int32"));
  CHECK_THROWS_AS(kiln::cuda::cublaslt_matmul(0, DType::Float32, nullptr, s, nullptr, s, nullptr, 1, -1, 1, 1),
                  kiln::Error);
  const ConvGeometry g = make_geometry(1, 1, 3, 3, 1, 3, 3, 1, 1, 0, 0, 1, 1, 1);
  CHECK_THROWS_AS(kiln::cuda::cudnn_conv2d(0, ConvPass::Forward, DType::Int32, g, nullptr, nullptr, nullptr),
                  kiln::Error);
  CHECK_THROWS_WITH(kiln::cuda::cudnn_conv2d(0, ConvPass::Forward, DType::Float64, g, nullptr, nullptr, nullptr),
                    Catch::Contains("conv2d (cuDNN)"));
  const ConvGeometry bad_groups = make_geometry(1, 3, 3, 3, 2, 1, 1, 1, 1, 0, 0, 1, 1, 2);
  CHECK_THROWS_AS(kiln::cuda::cudnn_conv2d(0, ConvPass::Forward, DType::Float32, bad_groups, nullptr, nullptr,
                                             nullptr),
                  kiln::Error);
  if (!kiln::cuda::available() || kiln::cuda::emulated()) {
    // No GPU to run on (none, or only the emulator): a clear error, not a crash.
    CHECK_THROWS_AS(kiln::cuda::cublaslt_matmul(0, DType::Float32, nullptr, s, nullptr, s, nullptr, 1, 1, 1, 1),
                    kiln::Error);
    CHECK_THROWS_AS(kiln::cuda::cudnn_conv2d(0, ConvPass::Forward, DType::Float32, g, nullptr, nullptr, nullptr),
                    kiln::Error);
  }
}

TEST_CASE("cuda::cublaslt_matmul over every operand layout matches a reference loop", "[cuda][device]") {
  if (!have_gpu()) return;
  for (DType t : kMatmulTypes)
    for (Layout la : kLayouts)
      for (Layout lb : kLayouts) {
        check_matmul({t, 2, 17, 33, 9, la, lb}, matmul_tolerance(t));
        check_matmul({t, 1, 9, 5, 33, la, lb}, matmul_tolerance(t));
      }
}

TEST_CASE("cuda::cublaslt_matmul: broadcast batches, size-1 dims, unaligned pointers, tensor-core sizes",
          "[cuda][device]") {
  if (!have_gpu()) return;
  for (DType t : kMatmulTypes) {
    const double tol = matmul_tolerance(t);
    for (bool a_broadcast : {false, true})
      for (bool b_broadcast : {false, true})
        for (Layout l : {Layout::RowMajor, Layout::Transposed, Layout::Strided}) {
          check_matmul({t, 3, 17, 33, 9, l, Layout::RowMajor, a_broadcast, b_broadcast}, tol);
          check_matmul({t, 4, 9, 17, 33, Layout::Transposed, l, a_broadcast, b_broadcast}, tol);
        }
    // A size-1 dim makes its stride meaningless; it must not change the result.
    for (Layout l : {Layout::RowMajor, Layout::Transposed, Layout::Padded, Layout::Strided})
      for (int64_t M : {1, 3})
        for (int64_t K : {1, 5})
          for (int64_t N : {1, 3}) check_matmul({t, 2, M, K, N, l, l}, tol);
    check_matmul({t, 2, 17, 33, 9, Layout::RowMajor, Layout::Transposed, false, false, 1, 3, 1}, tol);
    check_matmul({t, 4, 128, 96, 80}, tol);
    check_matmul({t, 3, 128, 96, 80, Layout::Transposed, Layout::Transposed, false, true}, tol);
  }
}

TEST_CASE("cuda::cublaslt_matmul with tf32 rounds float32 inputs and stays close", "[cuda][device]") {
  if (!have_gpu()) return;
  kiln::FlagsGuard guard;
  kiln::flags().tf32 = true;
  check_matmul({DType::Float32, 2, 64, 128, 48}, 5e-3);  // TF32 keeps 10 mantissa bits (2^-11)
  check_matmul({DType::Float32, 2, 17, 33, 9, Layout::Transposed, Layout::Strided}, 5e-3);
}

TEST_CASE("cuda::cublaslt_matmul: K == 0 writes zeros, empty outputs write nothing", "[cuda][device]") {
  if (!have_gpu()) return;
  for (DType t : kMatmulTypes) {
    INFO(kiln::dtype_name(t));
    const int64_t s[3] = {0, 1, 1};
    auto dummy = to_device(nan_values(t, 1));
    auto c = to_device(nan_values(t, 6));
    kiln::cuda::cublaslt_matmul(0, t, dummy->data, s, dummy->data, s, c->data, 2, 1, 0, 3);
    const auto zeros = to_host(*c, 6 * kiln::dtype_size(t));
    for (int64_t i = 0; i < 6; ++i) CHECK(at(zeros, t, i) == 0.0);
    auto d = to_device(nan_values(t, 1));
    kiln::cuda::cublaslt_matmul(0, t, dummy->data, s, dummy->data, s, d->data, 0, 1, 1, 1);
    kiln::cuda::cublaslt_matmul(0, t, dummy->data, s, dummy->data, s, d->data, 1, 0, 1, 1);
    kiln::cuda::cublaslt_matmul(0, t, dummy->data, s, dummy->data, s, d->data, 1, 1, 1, 0);
    CHECK(std::isnan(at(to_host(*d, kiln::dtype_size(t)), t, 0)));
  }
}

TEST_CASE("cuda::cudnn_conv2d: all three passes match a reference loop", "[cuda][device]") {
  if (!have_gpu()) return;
  if (!kiln::cuda::cudnn_supports_conv(DType::Float32)) {
    WARN("SKIPPED: kiln was built without cuDNN");
    return;
  }
  const ConvGeometry geometries[] = {
      make_geometry(2, 3, 9, 8, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1),     // plain 3x3, same padding
      make_geometry(2, 4, 11, 10, 6, 3, 2, 2, 1, 1, 0, 2, 1, 1),   // stride, padding, dilation per axis
      make_geometry(2, 4, 7, 7, 6, 3, 3, 1, 1, 1, 1, 1, 1, 2),     // two groups
      make_geometry(2, 8, 6, 6, 8, 3, 3, 2, 2, 1, 1, 1, 1, 8),     // depthwise, strided
      make_geometry(4, 16, 8, 8, 32, 1, 1, 1, 1, 0, 0, 1, 1, 1),   // 1x1, tensor-core friendly
      make_geometry(3, 16, 12, 12, 32, 5, 5, 1, 1, 2, 2, 1, 1, 1), // 5x5 (FFT / Winograd candidates)
  };
  for (DType t : kConvTypes)
    for (const ConvGeometry& g : geometries)
      for (ConvPass pass : kPasses) check_conv(pass, t, g, conv_tolerance(t));
}

TEST_CASE("cuda::cudnn_conv2d with tf32, and empty batches", "[cuda][device]") {
  if (!have_gpu()) return;
  if (!kiln::cuda::cudnn_supports_conv(DType::Float32)) {
    WARN("SKIPPED: kiln was built without cuDNN");
    return;
  }
  {
    kiln::FlagsGuard guard;
    kiln::flags().tf32 = true;
    const ConvGeometry g = make_geometry(2, 16, 10, 10, 16, 3, 3, 1, 1, 1, 1, 1, 1, 1);
    for (ConvPass pass : kPasses) check_conv(pass, DType::Float32, g, 1e-2);
  }
  // N == 0: the weight gradient is an empty sum, zeros; the other outputs are empty.
  const ConvGeometry empty = make_geometry(0, 3, 5, 5, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1);
  auto dummy = to_device(nan_values(DType::Float32, 1));
  auto dw = to_device(nan_values(DType::Float32, static_cast<size_t>(w_count(empty))));
  kiln::cuda::cudnn_conv2d(0, ConvPass::BackwardWeight, DType::Float32, empty, dummy->data, dummy->data, dw->data);
  const auto zeros = to_host(*dw, static_cast<size_t>(w_count(empty)) * sizeof(float));
  for (int64_t i = 0; i < w_count(empty); ++i) CHECK(at(zeros, DType::Float32, i) == 0.0);
}

namespace {
// Whether a library whose file name contains `name` is mapped into this process.
bool mapped(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    if (line.find(name) != std::string::npos) return true;
  return false;
}
}  // namespace

TEST_CASE("cuBLASLt and NVRTC are mapped on first use, with every function kiln calls", "[cuda]") {
  // (That a CPU-only program maps neither is the ctest entry cpu_only.no_cuda_libraries: this
  // process may have compiled CUDA kernels in an earlier test.)
#if KILN_WITH_CUDA
  kiln::cuda::cublaslt_load();
  CHECK(mapped("libcublasLt"));
  CHECK_FALSE(kiln::cuda::nvrtc_version().empty());
  CHECK(mapped("libnvrtc"));
#else
  CHECK_THROWS_WITH(kiln::cuda::cublaslt_load(), Catch::Contains("without the CUDA toolkit"));
#endif
}
