// Compression of saved activations (memory/compress.h): what the backward reads is the int8
// reading within one scale step, signs and zeros exact, NaN kept; a value only compared with a
// constant is kept as bits and gives the exact gradients; what a step saves shrinks to about a
// quarter; the flag, the guard and nn::compress_activations decide what is compressed; and an
// MLP trained with it for an epoch learns as well as in float32.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include "backends/cuda/cuda_runtime.h"

#include <cmath>
#include <limits>
#include <random>

using namespace kiln;

namespace {

// The gradient of sum(u * c) with respect to c is u = 2x itself, as the backward reads it. The
// loss is realized with it, as in a training step: u is read by both. (A value still held is
// kept as it is, so no handle to u outlives its recording.)
std::vector<float> reading_of(const Tensor& x, bool compress) {
  Tensor c = ones(x.shape()).realize().requires_grad_();
  CompressActivationsGuard guard(compress);
  Tensor loss = (x * 2.0 * c).sum();
  Tensor g = grad(loss, {c})[0];
  sync({loss, g});
  return g.to_vector<float>();
}

}  // namespace

TEST_CASE("compressed activations: the backward reads int8 within one scale step, signs, zeros, inf and NaN kept",
          "[compress]") {
  const int64_t rows = 5, cols = 64;
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> values(rows * cols);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (int64_t j = 0; j < cols; ++j) {
    values[0 * cols + j] = normal(rng);                      // ordinary
    values[1 * cols + j] = 1000.0f * normal(rng);            // another scale: its own group
    values[2 * cols + j] = 0.0f;                             // all zero: no division by zero
    values[3 * cols + j] = j == 0 ? 1.0f : 1e-6f * (j % 3);  // tiny values next to a large one
    values[4 * cols + j] = normal(rng);
  }
  values[4 * cols + 5] = std::numeric_limits<float>::quiet_NaN();
  values[4 * cols + 6] = -inf;  // as attention scores masked with -inf
  values[4 * cols + 7] = inf;
  Tensor x = from_vector<float>(values, {rows, cols});
  std::vector<float> exact = reading_of(x, false), read = reading_of(x, true);
  for (int64_t r = 0; r < rows; ++r) {
    float amax = 0;
    for (int64_t j = 0; j < cols; ++j)
      if (std::isfinite(exact[r * cols + j])) amax = std::max(amax, std::abs(exact[r * cols + j]));
    const float step = amax / 126.0f;  // finite values take the codes -126..126
    for (int64_t j = 0; j < cols; ++j) {
      const float e = exact[r * cols + j], v = read[r * cols + j];
      INFO("row " << r << " column " << j << ": exact " << e << ", read " << v);
      if (!std::isfinite(e)) {  // kept exactly, and the rest of the group keeps its scale
        CHECK((std::isnan(e) ? std::isnan(v) : v == e));
        continue;
      }
      CHECK(std::abs(v - e) <= (std::abs(e) >= step / 2 ? step / 2 : step) * 1.0001f);
      CHECK((v > 0) == (e > 0));
      CHECK((v < 0) == (e < 0));
    }
  }
  CHECK(exact != read);  // it did read int8
}

TEST_CASE("compressed activations: a step saves int8 plus one scale per row", "[compress][planner]") {
  Tensor x = randn({16, 64}).realize();
  Tensor c = randn({16, 64}).realize().requires_grad_();
  auto saved = [&](bool compress) {
    CompressActivationsGuard guard(compress);
    Tensor loss = (exp(x * 0.5) * c).sum();  // c's gradient reads the exp (no handle to it outlives this line)
    return jit::saved_for_backward(loss, {c});
  };
  // Uncompressed, the backward computes the exp again from the input; compressed, it reads the
  // int8 copy and one float32 scale per row, and the input is not kept.
  jit::SavedForBackward wide = saved(false), compressed = saved(true);
  CHECK(wide.activations == 0);
  CHECK(wide.inputs == 16 * 64 * 4);
  CHECK(compressed.activations == 16 * 64 + 16 * 4);
  CHECK(compressed.inputs == 0);
}

TEST_CASE("compressed activations: a relu output the backward only compares with zero is kept as 1-bit masks, "
          "gradients exact", "[compress][planner]") {
  Tensor x = randn({2, 3, 16, 16}).realize();
  Tensor w = randn({2, 3, 16, 16}).realize().requires_grad_();
  auto step = [&](bool compress, int64_t* saved) {
    CompressActivationsGuard guard(compress);
    FlagsGuard flags_guard;
    flags().recompute = "off";  // (cheap recomputation would recompute the relu output instead)
    Tensor loss = max_pool2d(relu(x * w), {2, 2}).sum();  // runs as relu(max_pool2d(x * w))
    *saved = jit::saved_for_backward(loss, {w}).activations;
    return grad(loss, {w})[0].to_vector<float>();
  };
  int64_t wide = 0, packed = 0;
  std::vector<float> exact = step(false, &wide), masked = step(true, &packed);
  CHECK(masked == exact);
  // The pooled relu output (float32, (2, 3, 8, 8)) became one bit per element. (Also kept, either
  // way: max pooling's window offsets, a byte per output; and the input x, which w's gradient
  // reads, an input rather than an activation.)
  CHECK(wide == 2 * 3 * 8 * 8 * (4 + 1));
  CHECK(packed == wide - 2 * 3 * 8 * 8 * 4 + 2 * 3 * 8 * 8 / 8 + 8 * 4);  // and the 8 bit weights
}

TEST_CASE("compressed activations follow the flag, the guard and nn::compress_activations", "[compress]") {
  nn::Sequential block(nn::Linear(64, 64), nn::ReLU(), nn::Linear(64, 64), nn::ReLU());
  nn::Linear head(64, 8);
  Tensor x = randn({32, 64}).realize();
  auto saved = [&](auto forward) {
    Tensor out = forward();
    Tensor loss = (out * out).mean();
    out = Tensor();
    std::vector<Tensor> params = block.parameters();
    for (const Tensor& p : head.parameters()) params.push_back(p);
    return jit::saved_for_backward(loss, params).activations;
  };
  // Both hidden (32, 64) relu outputs go from float32 to int8 with a float32 scale per row;
  // the input and the (32, 8) output (one group: kept) stay as they are.
  const int64_t wide = saved([&] { return head.forward(block.forward(x)); });
  const int64_t compressed = wide - 2 * (32 * 64 * 4 - (32 * 64 + 32 * 4));
  {
    FlagsGuard restore;
    flags().set("compress_activations", "int8");
    CHECK(saved([&] { return head.forward(block.forward(x)); }) == compressed);
    CompressActivationsGuard off(false);  // the guard wins over the flag
    CHECK(saved([&] { return head.forward(block.forward(x)); }) == wide);
  }
  CHECK(saved([&] { return head.forward(nn::compress_activations(block, x)); }) == compressed);
  CHECK(saved([&] { return head.forward(block.forward(x)); }) == wide);
}

TEST_CASE("an MLP trained an epoch with compressed activations learns as well as in float32", "[compress][train]") {
  // A synthetic 10-class problem: noisy copies of 10 random prototypes in 256 dimensions.
  const int64_t classes = 10, dim = 256, examples = 6144, batch = 128;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<float> prototypes(classes * dim);
  for (float& p : prototypes) p = normal(rng);
  auto make = [&](int64_t count, std::vector<float>& xs, std::vector<int64_t>& ys) {
    for (int64_t i = 0; i < count; ++i) {
      int64_t label = static_cast<int64_t>(rng() % classes);
      ys.push_back(label);
      for (int64_t j = 0; j < dim; ++j) xs.push_back(0.2f * prototypes[label * dim + j] + normal(rng));
    }
  };
  std::vector<float> train_x, test_x;
  std::vector<int64_t> train_y, test_y;
  make(examples, train_x, train_y);
  make(2048, test_x, test_y);
  Tensor tx = from_vector<float>(test_x, {2048, dim}), ty = from_vector<int64_t>(test_y, {2048});
  auto train = [&](bool compress) {
    manual_seed(3);
    nn::Sequential model(nn::Linear(dim, 256), nn::ReLU(), nn::Linear(256, 256), nn::ReLU(), nn::Linear(256, classes));
    optim::SGD opt(model.parameters(), optim::SGDOptions(0.05).momentum(0.9));
    CompressActivationsGuard guard(compress);
    for (int64_t start = 0; start < examples; start += batch) {
      Tensor x = from_vector<float>(std::vector<float>(train_x.begin() + start * dim, train_x.begin() + (start + batch) * dim),
                                    {batch, dim});
      Tensor y = from_vector<int64_t>(std::vector<int64_t>(train_y.begin() + start, train_y.begin() + start + batch), {batch});
      opt.step(nn::cross_entropy(model.forward(x), y));
    }
    NoGradGuard no_grad;
    return eq(argmax(model.forward(tx), 1), ty).cast(DType::Float32).mean().item();
  };
  const double wide = train(false), compressed = train(true);
  INFO("float32 " << wide << ", int8 " << compressed);
  CHECK(wide > 0.5);  // it learned something
  CHECK(std::abs(wide - compressed) <= 0.01);
}

TEST_CASE("compressed activations on a CUDA device: int8 and masks", "[compress][device]") {
  if (!cuda::available()) {
    WARN("SKIPPED: no CUDA device (KILN_CUDA_EMULATOR=1 emulates one)");
    return;
  }
  const Device gpu = Device::cuda(0);
  Tensor x = randn({2, 3, 8, 8}).realize();
  Tensor w = randn({2, 3, 8, 8}).realize();
  auto grads = [&](Device d, bool compress) {
    Tensor wd = w.to(d).realize().requires_grad_();
    CompressActivationsGuard guard(compress);
    Tensor loss;
    {
      Tensor h = max_pool2d(relu(x.to(d) * wd), {2, 2});  // the relu output: a mask only
      loss = (exp(h * 0.5) * h).sum();                    // h and the exp: int8
    }
    Tensor g = grad(loss, {wd})[0];
    sync({loss, g});
    return g.to_doubles();
  };
  std::vector<double> host = grads(Device::cpu(), true), device = grads(gpu, true), exact = grads(gpu, false);
  REQUIRE(host.size() == device.size());
  for (size_t i = 0; i < host.size(); ++i) CHECK(device[i] == Approx(host[i]).margin(1e-5));
  CHECK(device != exact);  // compressed: int8 readings
}
