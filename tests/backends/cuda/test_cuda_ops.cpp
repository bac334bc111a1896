// Every op on a CUDA device against the CPU: the same function runs on CPU tensors and on copies
// of them on cuda:0, and the results must agree within a tolerance per dtype. On a GPU this runs
// the NVRTC kernels and cuBLAS/cuDNN; without one, under KILN_CUDA_EMULATOR=1 (how CTest runs the
// "emulated." entries), the same CUDA kernels run on the host emulator; otherwise each case says
// that it was skipped and why.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>

#include <kiln/kiln.h>

#include "backends/cuda/cuda_runtime.h"
#include "tests/support/compare.h"

using namespace kiln;

namespace {

using kiln::testing::have_cuda;

const Device kGpu = Device::cuda(0);

// Relative tolerance by dtype: the kernels compute alike, but libraries (cuBLAS, cuDNN) sum in
// other orders, and fp16/bf16 results round at the last bit either way.
double tolerance(DType t) {
  switch (t) {
    case DType::Float64: return 1e-10;
    case DType::Float32: return 2e-4;
    case DType::Float16: return 4e-3;
    case DType::BFloat16: return 2e-2;
    default: return 0;
  }
}

void check_same(const Tensor& cpu, const Tensor& gpu, const std::string& what) {
  INFO(what << ": " << shape_str(cpu.shape()) << " " << dtype_name(cpu.dtype()));
  REQUIRE(gpu.device() == kGpu);
  REQUIRE(gpu.shape() == cpu.shape());
  REQUIRE(gpu.dtype() == cpu.dtype());
  std::vector<double> want = cpu.to_doubles(), got = gpu.to_doubles();
  const double rtol = tolerance(cpu.dtype());
  double scale = 0;
  for (double v : want)
    if (std::isfinite(v)) scale = std::max(scale, std::abs(v));
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    bool ok = std::isnan(want[i]) ? std::isnan(got[i])
              : std::isinf(want[i]) ? got[i] == want[i]
                                    : std::abs(got[i] - want[i]) <= rtol * (std::abs(want[i]) + 1e-3 * scale) + 1e-30;
    if (!ok && bad++ == 0) first = i;
  }
  INFO("first mismatch at " << first << ": cpu " << (want.empty() ? 0 : want[first]) << ", cuda "
                            << (got.empty() ? 0 : got[first]));
  CHECK(bad == 0);
}

using Fn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

// Runs `f` on `inputs` (CPU tensors) and on their copies on cuda:0; compares every result.
void compare(const std::string& what, const std::vector<Tensor>& inputs, const Fn& f) {
  std::vector<Tensor> on_gpu;
  for (const Tensor& x : inputs) on_gpu.push_back(x.to(kGpu));
  std::vector<Tensor> want = f(inputs), got = f(on_gpu);
  REQUIRE(want.size() == got.size());
  for (size_t i = 0; i < want.size(); ++i) check_same(want[i], got[i], what + " #" + std::to_string(i));
}

Tensor positive(Shape s, DType t = DType::Float32) { return cast(rand(std::move(s)) + 0.5, t).realize(); }
Tensor normal(Shape s, DType t = DType::Float32) { return cast(randn(std::move(s)), t).realize(); }

}  // namespace

TEST_CASE("CUDA elementwise ops match the CPU in every float dtype", "[cuda][device][cuda_ops]") {
  if (!have_cuda()) return;
  using U = Tensor (*)(const Tensor&);
  const std::vector<std::pair<const char*, U>> unary = {
      {"neg", neg}, {"exp", exp}, {"log", log}, {"sqrt", sqrt}, {"rsqrt", rsqrt}, {"sin", sin}, {"cos", cos},
      {"tanh", tanh}, {"erf", erf}, {"abs", abs}, {"reciprocal", reciprocal}, {"sign", sign}, {"floor", floor},
      {"relu", relu}, {"sigmoid", sigmoid}, {"silu", silu}};
  for (DType t : {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16}) {
    Tensor a = positive({37, 29}, t), b = normal({37, 29}, t);
    for (auto [name, op] : unary) compare(name, {a, b}, [op](auto& x) { return std::vector<Tensor>{op(x[0]), op(x[1])}; });
    compare("binary", {a, b}, [t](auto& x) {
      return std::vector<Tensor>{x[0] + x[1], x[0] - x[1], x[0] * x[1], x[0] / x[1], pow(x[0], x[1]),
                                 maximum(x[0], x[1]), minimum(x[0], x[1]), where(gt(x[0], x[1]), x[0], x[1] * 2.0),
                                 cast(le(x[0], x[1]), t), cast(eq(x[0], x[0]), t), clamp(x[1], -0.5, 0.5)};
    });
    compare("gelu", {b}, [](auto& x) { return std::vector<Tensor>{gelu(x[0]), gelu(x[0], true)}; });
  }
}

TEST_CASE("CUDA casts, integer and boolean ops match the CPU", "[cuda][device][cuda_ops]") {
  if (!have_cuda()) return;
  Tensor x = (normal({5, 63}) * 40.0).realize();
  compare("casts", {x}, [](auto& v) {
    std::vector<Tensor> out;
    for (DType t : {DType::Float64, DType::Float16, DType::BFloat16, DType::Int32, DType::Int64, DType::Int8,
                    DType::UInt8, DType::Bool})
      out.push_back(cast(cast(v[0], t), DType::Float32));
    Tensor i = cast(v[0], DType::Int32);
    out.push_back(i + i * 3);
    Tensor positive = gt(v[0], zeros_like(v[0]));
    out.push_back(logical_and(positive, lt(v[0], scalar_like(20.0, v[0]))));
    out.push_back(logical_not(positive));
    out.push_back(sum(cast(positive, DType::Int64), {1}));
    return out;
  });
}

TEST_CASE("CUDA reductions match the CPU: rows, columns, small windows, all", "[cuda][device][cuda_ops]") {
  if (!have_cuda()) return;
  for (DType t : {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16}) {
    Tensor x = normal({6, 50, 70}, t);
    compare("reduce", {x}, [](auto& v) {
      const Tensor& a = v[0];
      return std::vector<Tensor>{sum(a), sum(a, {2}), sum(a, {1}), sum(a, {0}), sum(a, {0, 2}), max(a, {2}),
                                 max(a, {1}), max(a), mean(a, {1}, true), var(a, {2}), min(a, {0}),
                                 cast(argmax(a, 2), DType::Float32), logsumexp(a, {2})};
    });
  }
  Tensor big = normal({3, 5000});  // rows longer than a block, and short rows folded per thread
  compare("long rows", {big}, [](auto& v) { return std::vector<Tensor>{sum(v[0], {1}), max(v[0], {1}), sum(reshape(v[0], {1500, 10}), {1})}; });
  Tensor windows = normal({4, 8, 12, 12});
  compare("2x2 windows", {windows}, [](auto& v) {
    return std::vector<Tensor>{max(reshape(v[0], {4, 8, 6, 2, 6, 2}), {3, 5})};
  });
}

TEST_CASE("CUDA views, padding, concatenation and indexing match the CPU", "[cuda][device][cuda_ops]") {
  if (!have_cuda()) return;
  Tensor x = normal({4, 6, 10});
  Tensor idx = from_vector<int64_t>({3, 0, 5, 5, 1, 2}, {6}).realize();
  compare("views", {x, idx}, [](auto& v) {
    const Tensor& a = v[0];
    return std::vector<Tensor>{permute(a, {2, 0, 1}) * 1.0, slice(a, 2, 1, 9, 3) + 0.0, pad(a, {{0, 0}, {1, 2}, {3, 0}}),
                               concat({a, a * 2.0}, 1), expand(reshape(sum(a, {2}), {4, 6, 1}), {4, 6, 5}) + 0.0,
                               index_select(a, 1, v[1]), gather(a, 1, expand(reshape(v[1], {1, 6, 1}), {4, 6, 10})),
                               scatter_add({4, 6, 10}, 1, expand(reshape(v[1], {1, 6, 1}), {4, 6, 10}), a),
                               one_hot(v[1], 7)};
  });
}

// KILN_DETERMINISTIC=1: scatter-adds without atomics add in the CPU kernel's order, so an
// embedding's gradient (rows scattered into a table, many to one row) has the CPU's bits, in every
// float dtype, and the same bits run after run.
TEST_CASE("KILN_DETERMINISTIC: CUDA scatter-adds give the CPU's bits", "[cuda][device][cuda_ops][deterministic]") {
  if (!have_cuda()) return;
  FlagsGuard guard;
  flags().deterministic = true;
  std::vector<int64_t> ids(300);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 7 + i / 13) % 11);
  const Tensor idx = from_vector<int64_t>(ids, {300}).realize();
  for (DType t : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16}) {
    const Tensor table = normal({11, 24}, t), weights = normal({300, 24}, t);
    auto embedding_grad = [&](const Device& device) {
      Tensor w = table.to(device).requires_grad_();
      Tensor loss = sum(index_select(w, 0, idx.to(device)) * weights.to(device));
      Tensor g = grad(loss, {w})[0];
      Tensor direct = scatter_add({11, 24}, 0, expand(reshape(idx.to(device), {300, 1}), {300, 24}), weights.to(device));
      return std::vector<std::vector<double>>{cast(g, DType::Float64).to(Device::cpu()).to_vector<double>(),
                                              cast(direct, DType::Float64).to(Device::cpu()).to_vector<double>()};
    };
    INFO(dtype_name(t));
    const auto cpu = embedding_grad(Device::cpu());
    CHECK(embedding_grad(kGpu) == cpu);
    CHECK(embedding_grad(kGpu) == cpu);
  }
}

TEST_CASE("a CUDA index out of range is a kiln::Error and changes nothing", "[cuda][device][cuda_ops][errors]") {
  if (!have_cuda()) return;
  Tensor a = normal({4, 5}).to(kGpu);
  Tensor bad = from_vector<int64_t>({0, 7}, {2}).to(kGpu);
  Tensor w = normal({4, 5}).to(kGpu);
  auto before = w.to_vector<float>();
  w.assign(w * 2.0 + sum(index_select(a, 1, bad)));
  CHECK_THROWS_WITH(w.realize(), Catch::Contains("out of range") && Catch::Contains("7"));
}

TEST_CASE("CUDA random numbers are the CPU's", "[cuda][device][cuda_ops]") {
  if (!have_cuda()) return;
  for (DType t : {DType::Float32, DType::Float64}) {
    FlagsGuard guard;
    manual_seed(1234);
    Tensor u = rand({1000}, t), n = randn({1000}, t), d = dropout(ones({1000}, t), 0.3);
    sync({u, n, d});
    flags().use_cuda = true;
    manual_seed(1234);
    Tensor gu = rand({1000}, t), gn = randn({1000}, t), gd = dropout(ones({1000}, t), 0.3);
    check_same(u, gu, "rand");
    check_same(n, gn, "randn");
    check_same(d, gd, "dropout");
  }
}

TEST_CASE("CUDA matmul and conv match the CPU, forward and backward", "[cuda][device][cuda_ops]") {
  if (!have_cuda()) return;
  for (DType t : {DType::Float32, DType::Float64}) {
    Tensor a = normal({3, 17, 33}, t), b = normal({33, 21}, t), w = normal({21, 33}, t);
    compare("matmul", {a, b, w}, [](auto& v) {
      return std::vector<Tensor>{matmul(v[0], v[1]), matmul(v[0], transpose(v[2], 0, 1)), matmul(v[2], transpose(v[0], 1, 2))};
    });
    Tensor x = normal({2, 3, 11, 9}, t), k = normal({8, 3, 3, 3}, t), bias = normal({8}, t), g = normal({6, 3, 3, 3}, t);
    compare("conv", {x, k, bias, g}, [](auto& v) {
      Tensor xl = v[0].detach().requires_grad_(), kl = v[1].detach().requires_grad_();
      Tensor y = conv2d(xl, kl, v[2], {2, 1}, {1, 1});
      auto grads = grad(sum(y * y), {xl, kl});
      Tensor grouped = conv2d(concat({v[0], v[0]}, 1), v[3], {}, {1, 1}, {0, 1}, {2, 1}, 2);
      return std::vector<Tensor>{y, grads[0], grads[1], grouped};
    });
  }
}

TEST_CASE("CUDA composites match the CPU: softmax, layer norm, losses, pooling", "[cuda][device][cuda_ops]") {
  if (!have_cuda()) return;
  Tensor x = normal({64, 100}), labels = from_vector<int64_t>(std::vector<int64_t>(64, 3), {64}).realize();
  Tensor gamma = normal({100}), beta = normal({100}), img = normal({2, 3, 9, 9});
  compare("composites", {x, labels, gamma, beta, img}, [](auto& v) {
    return std::vector<Tensor>{softmax(v[0]), log_softmax(v[0], 0), layer_norm(v[0], {100}, v[2], v[3]),
                               cross_entropy(v[0], v[1], CrossEntropyOptions().label_smoothing(0.1)),
                               mse_loss(v[0], v[0] * 0.5),
                               max_pool2d(v[4], {2, 2}), avg_pool2d(v[4], {3, 3}, {2, 2}, {1, 1}),
                               max_pool2d(v[4], {3, 3}, {2, 2}, {1, 1}, {1, 1}, true)};
  });
}

TEST_CASE("an MLP and a CNN train alike on CUDA and on the CPU", "[cuda][device][cuda_ops][train]") {
  if (!have_cuda()) return;
  auto train = [](Device device) {
    manual_seed(7);
    nn::Sequential model(nn::Conv2d(nn::Conv2dOptions(1, 4, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),
                         nn::Flatten(), nn::Linear(4 * 4 * 4, 10));
    model.to(device);
    optim::SGD opt(model.parameters(), optim::SGDOptions(0.05).momentum(0.9));
    Tensor x = randn({16, 1, 8, 8}).realize().to(device);
    Tensor y = from_vector<int64_t>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5}, {16}).to(device);
    std::vector<double> losses;
    for (int step = 0; step < 3; ++step) {
      Tensor loss = cross_entropy(model.forward(x), y);
      opt.step(loss);
      losses.push_back(loss.item());
    }
    std::vector<Tensor> params = model.parameters();
    for (Tensor& p : params) p = p.to(Device::cpu());
    return std::make_pair(losses, params);
  };
  auto [cpu_losses, cpu_params] = train(Device::cpu());
  auto [gpu_losses, gpu_params] = train(kGpu);
  for (size_t i = 0; i < cpu_losses.size(); ++i) CHECK(gpu_losses[i] == Approx(cpu_losses[i]).epsilon(1e-4));
  REQUIRE(cpu_params.size() == gpu_params.size());
  for (size_t i = 0; i < cpu_params.size(); ++i) {
    auto a = cpu_params[i].to_vector<float>(), b = gpu_params[i].to_vector<float>();
    for (size_t j = 0; j < a.size(); ++j) REQUIRE(b[j] == Approx(a[j]).margin(1e-4).epsilon(1e-3));
  }
}

TEST_CASE("one sync realizes CPU and CUDA work as a plan per device", "[cuda][device][cuda_ops]") {
  if (!have_cuda()) return;
  Tensor x = normal({8, 8});
  Tensor on_cpu = exp(x) + 1.0, on_gpu = exp(x.to(kGpu)) + 1.0;
  sync({on_cpu, on_gpu});
  CHECK(on_cpu.is_realized());
  CHECK(on_gpu.is_realized());
  check_same(on_cpu, on_gpu, "exp + 1");
  CHECK_THROWS_WITH(x + x.to(kGpu), Catch::Contains("different devices") && Catch::Contains(kGpu.str()));
}

std::vector<float> before_doubled(std::vector<float> v) {
  for (float& x : v) x *= 2.0f;
  return v;
}

TEST_CASE("running out of device memory is a kiln::Error with a report, and nothing is lost", "[cuda][device][cuda_ops][errors]") {
  if (!have_cuda()) return;
  Tensor kept = normal({4, 4}).to(kGpu);
  auto before = kept.to_vector<float>();
  FlagsGuard guard;
  flags().use_cuda = true;
  Tensor huge = zeros({int64_t{1} << 43});  // 32 TiB: more than any GPU (or the emulator's host) has
  CHECK_THROWS_WITH(huge.realize(), Catch::Contains("cuda"));
  // Outputs are allocated before any kernel runs: the update of `kept` in the same plan is not
  // applied when another output does not fit.
  kept.assign(kept * 2.0);
  Tensor shifted = huge + 1.0;
  CHECK_THROWS_AS(sync({kept, shifted}), Error);
  CHECK(kept.to_vector<float>() == before_doubled(before));
}

// Elementwise kernels over contiguous data read and write 16-byte vectors when every pointer is
// aligned, else element by element; both paths, the remainder of n / V, row broadcasts and
// offsets. On the emulator a misaligned vector access is a kiln::Error, so a wrong alignment
// check fails here as it would fault on a GPU.
TEST_CASE("CUDA vector loads: aligned, offset, broadcast and odd-sized operands", "[cuda][device][cuda_ops][vector]") {
  if (!have_cuda()) return;
  for (DType t : {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16}) {
    Tensor a = normal({10007}, t), b = normal({10007}, t);
    compare("flat", {a, b}, [](auto& x) { return std::vector<Tensor>{x[0] * x[1] + 1.0, exp(x[0])}; });
    compare("offset slices", {a, b}, [](auto& x) {
      return std::vector<Tensor>{slice(x[0], 0, 1, 9001) + slice(x[1], 0, 3, 9003),     // misaligned: scalar path
                                 slice(x[0], 0, 8, 9008) * slice(x[1], 0, 16, 9016)};  // aligned with an offset
    });
    Tensor m = normal({96, 256}, t), row = normal({256}, t), odd = normal({41, 131}, t), odd_row = normal({131}, t);
    compare("row broadcast", {m, row, odd, odd_row}, [](auto& x) {
      return std::vector<Tensor>{x[0] + x[1], x[2] * x[3], relu(x[2] - 0.25)};
    });
  }
  // Half operands of a float kernel are 8-byte vectors: aligned 8 bytes in (vector path), or
  // 4 bytes in (scalar path).
  Tensor hf = normal({10000}, DType::Float16), ff = normal({10000});
  compare("mixed-width offsets", {hf, ff}, [](auto& x) {
    return std::vector<Tensor>{cast(slice(x[0], 0, 4, 9604), DType::Float32) + slice(x[1], 0, 0, 9600),
                               cast(slice(x[0], 0, 2, 9602), DType::Float32) * slice(x[1], 0, 4, 9604)};
  });
  Tensor h = normal({64, 160}, DType::Float16), f = normal({64, 160});
  compare("mixed widths", {h, f}, [](auto& x) {
    return std::vector<Tensor>{cast(x[0], DType::Float32) * x[1], cast(gt(x[1], zeros_like(x[1])), DType::Float32),
                               where(gt(x[0], cast(x[1], DType::Float16)), x[0], cast(x[1], DType::Float16))};
  });
}

// Few outputs over long rows split each row over many blocks and fold the parts in a second
// function (backends/cuda/render_cuda.cc): full reductions, a few long rows or columns, max and sum, half
// types (batch-norm statistics among them), and a
// softmax over long rows (its reductions split rather than forming a row group). Summing in
// parts changes the order of float additions, so results stay within the tolerance, and the
// same run twice gives the same bits.
TEST_CASE("CUDA reductions of long rows into few outputs split over blocks", "[cuda][device][cuda_ops][split]") {
  if (!have_cuda()) return;
  for (DType t : {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16}) {
    // Positive values: sums of many that cancel would leave only rounding to compare.
    Tensor flat = positive({300001}, t), rows = positive({3, 70007}, t);
    compare("split", {flat, rows}, [](auto& v) {
      return std::vector<Tensor>{sum(v[0]), max(v[0]), mean(v[0]), min(v[1], {1}), sum(v[1], {1}),
                                 mean(v[1] * v[1]), sum(reshape(v[1], {3, 7, 10001}), {1, 2})};
    });
    // Columns: few tiles of 32 columns over many rows.
    Tensor tall = positive({20011, 45}, t), batch = positive({64, 3, 50, 50}, t);
    compare("split columns", {tall, batch}, [](auto& v) {
      return std::vector<Tensor>{sum(v[0], {0}), max(v[0], {0}), mean(v[1], {0, 2, 3}), sum(v[1], {0, 2})};
    });
  }
  Tensor logits = normal({2, 100000});
  compare("softmax over long rows", {logits}, [](auto& v) {
    return std::vector<Tensor>{softmax(v[0], 1), log_softmax(v[0], 1)};
  });
  Tensor x = normal({1 << 19}).to(kGpu);
  CHECK(sum(x).item() == sum(x).item());  // a fixed order of additions
  Tensor ints = from_vector<int64_t>(std::vector<int64_t>(200000, 3), {200000}).to(kGpu);
  CHECK(sum(ints).item() == 600000);
}
