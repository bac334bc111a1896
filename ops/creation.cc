// Tensors made from values: constants, index ramps, random numbers and host data.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "core/autograd.h"
#include "core/flags.h"
#include "memory/allocator.h"
#include "backends/cuda/cuda_runtime.h"
#include "ops/ops.h"
#include "ops/primitive.h"

namespace kiln {

namespace {
std::atomic<uint64_t> g_seed{0};
std::atomic<uint64_t> g_offset{0};
std::atomic<bool> g_seeded{false};

uint64_t current_seed() {
  if (!g_seeded.exchange(true)) g_seed = static_cast<uint64_t>(flags().seed);
  return g_seed;
}

void check_shape(const Shape& shape, const char* op) {
  for (int64_t d : shape)
    KILN_CHECK(d >= 0, op, "negative dimension in shape {}", shape_str(shape));
}
}  // namespace

namespace prim {
Tensor rand(Op op, Shape shape, DType dtype) {
  KILN_CHECK(is_floating(dtype), op_name(op), "random values need a floating dtype, got {}", dtype_name(dtype));
  check_shape(shape, "rand");
  auto [seed, offset] = random_key(numel(shape));
  Tensor t = record(op, dtype, std::move(shape), {});
  t.node()->seed = seed;
  t.node()->offset = offset;
  return finish(t);
}
}  // namespace prim

std::pair<uint64_t, uint64_t> random_key(int64_t count) {
  uint64_t seed = current_seed();
  // Each draw consumes a fresh range of Philox counters so values never repeat within a seed.
  uint64_t offset = g_offset.fetch_add(static_cast<uint64_t>(count + 3) / 4 * 4);
  return {seed, offset};
}

void manual_seed(uint64_t seed) {
  g_seeded = true;
  g_seed = seed;
  g_offset = 0;
}

Tensor full(Shape shape, double value, DType dtype) {
  check_shape(shape, "full");
  return prim::full(std::move(shape), value, dtype);
}
Tensor zeros(Shape shape, DType dtype) { return full(std::move(shape), 0.0, dtype); }
Tensor ones(Shape shape, DType dtype) { return full(std::move(shape), 1.0, dtype); }
Tensor zeros_like(const Tensor& t) { return prim::follow(zeros(t.shape(), t.dtype()), t.device()); }
Tensor ones_like(const Tensor& t) { return prim::follow(ones(t.shape(), t.dtype()), t.device()); }
Tensor scalar(double value, DType dtype) { return full({}, value, dtype); }

Tensor iota(Shape shape, int64_t axis, DType dtype) {
  check_shape(shape, "iota");
  return prim::iota(std::move(shape), axis, dtype);
}
Tensor arange(int64_t n, DType dtype) { return iota({n}, 0, dtype); }
Tensor rand(Shape shape, DType dtype) { return prim::rand(Op::RandUniform, std::move(shape), dtype); }
Tensor randn(Shape shape, DType dtype) { return prim::rand(Op::RandNormal, std::move(shape), dtype); }

Tensor multinomial(const Tensor& probs, int64_t samples) {
  KILN_CHECK((probs.dim() == 1 || probs.dim() == 2) && is_floating(probs.dtype()) && probs.size(-1) > 0, "multinomial",
             "needs floating-point weights (V) or (R, V) with V >= 1, got {}", probs.str());
  KILN_CHECK(samples >= 1, "multinomial", "samples must be at least 1, got {}", samples);
  const int64_t v = probs.size(-1), rows = probs.numel() / v;
  const std::vector<double> p = probs.to_doubles();
  const std::vector<double> u = rand({rows, samples}, DType::Float64).to_doubles();
  std::vector<int64_t> picked(static_cast<size_t>(rows * samples));
  std::vector<double> cumulative(static_cast<size_t>(v));
  for (int64_t r = 0; r < rows; ++r) {
    double total = 0;
    for (int64_t j = 0; j < v; ++j) {
      const double w = p[static_cast<size_t>(r * v + j)];
      KILN_CHECK(std::isfinite(w) && w >= 0, "multinomial", "row {} of {} has weight {} at index {}; weights must be "
                 "finite and non-negative", r, probs.str(), w, j);
      cumulative[static_cast<size_t>(j)] = total += w;
    }
    KILN_CHECK(total > 0, "multinomial", "row {} of {} sums to 0: nothing to draw", r, probs.str());
    for (int64_t s = 0; s < samples; ++s) {
      const double target = u[static_cast<size_t>(r * samples + s)] * total;
      // The first index whose cumulative weight passes the draw (never one of weight 0).
      auto it = std::upper_bound(cumulative.begin(), cumulative.end(), target);
      int64_t j = std::min<int64_t>(it - cumulative.begin(), v - 1);
      while (j > 0 && p[static_cast<size_t>(r * v + j)] == 0) --j;
      picked[static_cast<size_t>(r * samples + s)] = j;
    }
  }
  Shape shape = probs.dim() == 1 ? Shape{samples} : Shape{rows, samples};
  return from_vector<int64_t>(picked, shape).to(probs.device());
}

Tensor written_on_host(DType dtype, Shape shape, const std::function<void(void* bytes)>& write) {
  check_shape(shape, "written_on_host");
  auto node = new_node();
  node->op = Op::Input;
  node->dtype = dtype;
  node->shape = std::move(shape);
  node->device = Device::cpu();
  node->storage = memory::allocate_storage(node->nbytes(), node->device);
  write(node->storage->data);  // also for no bytes: a caller may fill other buffers in it
  Tensor t(std::move(node));
  return flags().use_cuda ? to_device(t, Device::cuda(0)) : t;
}

namespace {
Tensor realized_from_bytes(const void* bytes, DType dtype, Shape shape) {
  const size_t size = static_cast<size_t>(numel(shape)) * dtype_size(dtype);
  return written_on_host(dtype, std::move(shape), [&](void* out) {
    if (size > 0) std::memcpy(out, bytes, size);
  });
}
}  // namespace

template <typename T> Tensor from_vector(const std::vector<T>& values, Shape shape) {
  check_shape(shape, "from_vector");
  KILN_CHECK(static_cast<int64_t>(values.size()) == numel(shape), "from_vector",
             "{} values do not fill shape {} ({} elements)", values.size(), shape_str(shape), numel(shape));
  if constexpr (std::is_same_v<T, bool>) {
    std::vector<uint8_t> bytes(values.begin(), values.end());
    return realized_from_bytes(bytes.data(), DType::Bool, std::move(shape));
  } else {
    return realized_from_bytes(values.data(), dtype_of<T>(), std::move(shape));
  }
}
template Tensor from_vector<float>(const std::vector<float>&, Shape);
template Tensor from_vector<double>(const std::vector<double>&, Shape);
template Tensor from_vector<int32_t>(const std::vector<int32_t>&, Shape);
template Tensor from_vector<int64_t>(const std::vector<int64_t>&, Shape);
template Tensor from_vector<uint8_t>(const std::vector<uint8_t>&, Shape);
template Tensor from_vector<int8_t>(const std::vector<int8_t>&, Shape);
template Tensor from_vector<bool>(const std::vector<bool>&, Shape);

Tensor to_device(const Tensor& t, Device device) {
  if (t.device() == device) return t;
  cuda::check_device(device, "to");
  KILN_CHECK(!t.requires_grad() || t.node()->grad_leaf, "to",
             "{} has gradient history, which cannot cross devices yet; detach() it, or move the leaves "
             "(parameters) before building the graph", t.str());
  const Tensor src = Tensor(t).realize();
  auto node = new_node();
  node->op = Op::Input;
  node->dtype = src.dtype();
  node->shape = src.shape();
  node->device = device;
  node->storage = memory::allocate_storage(node->nbytes(), device);
  const size_t bytes = node->nbytes();
  if (bytes > 0) {
    if (src.device().is_cpu()) {
      memory::device_allocator(device).copy_from_host(node->storage->data, src.data(), bytes);
    } else if (device.is_cpu()) {
      memory::device_allocator(src.device()).copy_to_host(node->storage->data, src.data(), bytes);
    } else {  // between two GPUs, through the host
      return to_device(to_device(src, Device::cpu()), device);
    }
  }
  Tensor out(std::move(node));
  if (t.requires_grad()) out.requires_grad_(true);
  return out;
}

Tensor from_doubles(const std::vector<double>& values, Shape shape, DType dtype) {
  check_shape(shape, "from_doubles");
  KILN_CHECK(static_cast<int64_t>(values.size()) == numel(shape), "from_doubles",
             "{} values do not fill shape {} ({} elements)", values.size(), shape_str(shape), numel(shape));
  std::vector<unsigned char> bytes(values.size() * dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) store_from_double(bytes.data(), dtype, i, values[i]);
  return realized_from_bytes(bytes.data(), dtype, std::move(shape));
}

}  // namespace kiln
