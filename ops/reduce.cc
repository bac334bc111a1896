// Reductions of the user API: axis normalization, keepdim, and the composites mean/var/min/argmax.
#include <algorithm>
#include <limits>

#include "ops/autocast.h"
#include "ops/ops.h"
#include "ops/primitive.h"

namespace kiln {

namespace {
std::vector<int64_t> normalize_axes(const Tensor& a, std::vector<int64_t> axes, const char* op) {
  if (a.dim() == 0) {
    // A 0-d tensor reduces over nothing; axis 0 (or -1) is accepted for it, as in PyTorch.
    for (int64_t ax : axes) normalize_axis(ax, 1, op);
    return {};
  }
  if (axes.empty()) {
    for (size_t i = 0; i < a.dim(); ++i) axes.push_back(static_cast<int64_t>(i));
    return axes;
  }
  for (auto& ax : axes) ax = normalize_axis(ax, a.dim(), op);
  std::sort(axes.begin(), axes.end());
  KILN_CHECK(std::adjacent_find(axes.begin(), axes.end()) == axes.end(), op, "repeated axis in [{}] for {}",
             fmt::join(axes, ", "), shape_str(a.shape()));
  return axes;
}

Shape drop_axes(const Shape& shape, const std::vector<int64_t>& axes) {
  Shape out;
  for (size_t i = 0; i < shape.size(); ++i)
    if (!std::binary_search(axes.begin(), axes.end(), static_cast<int64_t>(i))) out.push_back(shape[i]);
  return out;
}

Tensor reduce(Op op, const Tensor& a, std::vector<int64_t> axes, bool keepdim, const char* name) {
  axes = normalize_axes(a, std::move(axes), name);
  for (int64_t ax : axes)
    KILN_CHECK(op != Op::ReduceMax || a.shape()[ax] > 0, name, "cannot take the max over empty axis {} of {}", ax,
               shape_str(a.shape()));
  Tensor x = a;
  // Sums of small ints and bools accumulate in int64, as in PyTorch.
  if (op == Op::ReduceSum && is_integral(a.dtype())) x = cast(a, DType::Int64);
  Tensor r = prim::reduce(op, x, axes);
  return keepdim ? r : prim::reshape(r, drop_axes(a.shape(), axes));
}
}  // namespace

Tensor sum(const Tensor& a, std::vector<int64_t> axes, bool keepdim) {
  AutocastScope amp("sum");
  return reduce(Op::ReduceSum, amp(a), std::move(axes), keepdim, "sum");
}
Tensor max(const Tensor& a, std::vector<int64_t> axes, bool keepdim) {
  return reduce(Op::ReduceMax, a, std::move(axes), keepdim, "max");
}
Tensor min(const Tensor& a, std::vector<int64_t> axes, bool keepdim) {
  if (is_floating(a.dtype())) return neg(max(neg(a), std::move(axes), keepdim));
  // Negation reverses the order of bool and unsigned values only modulo 2^bits (-0 == 0 is the
  // largest uint8 then) and overflows at INT8_MIN: negate integers in int64 and cast back.
  return cast(neg(max(neg(cast(a, DType::Int64)), std::move(axes), keepdim)), a.dtype());
}

Tensor mean(const Tensor& a_in, std::vector<int64_t> axes, bool keepdim) {
  AutocastScope amp("mean");
  const Tensor a = amp(a_in);
  auto norm = normalize_axes(a, axes, "mean");
  int64_t count = 1;
  for (int64_t ax : norm) count *= a.shape()[ax];
  // Integers average in float32; half types sum in float32 too, so a sum past 65504 does not
  // overflow before it is divided.
  DType t = a.dtype();
  bool half = t == DType::Float16 || t == DType::BFloat16;
  Tensor x = is_floating(t) && !half ? a : cast(a, DType::Float32);
  Tensor m = sum(x, norm, keepdim) * (1.0 / static_cast<double>(std::max<int64_t>(count, 1)));
  return half ? cast(m, t) : m;
}

Tensor amax(const Tensor& a, std::vector<int64_t> axes, bool keepdim) { return max(a, std::move(axes), keepdim); }
Tensor amin(const Tensor& a, std::vector<int64_t> axes, bool keepdim) { return min(a, std::move(axes), keepdim); }

namespace {
// clamp_divisor: the bool forms' old rule, n - correction clamped to 1 (one value: variance 0).
Tensor variance(const Tensor& a_in, std::vector<int64_t> axes, int64_t correction, bool keepdim, const char* name,
                bool clamp_divisor = false) {
  AutocastScope amp(name);
  const Tensor a = amp(a_in);
  KILN_CHECK(correction >= 0, name, "correction {} is negative; use 0 (biased), 1 (unbiased) or more", correction);
  auto norm = normalize_axes(a, axes, name);
  int64_t count = 1;
  for (int64_t ax : norm) count *= a.shape()[ax];
  Tensor centered = a - mean(a, norm, true);
  Tensor ss = sum(centered * centered, norm, keepdim);
  // n - correction <= 0: PyTorch's inf (or NaN for a zero sum), not a clamped divisor.
  const int64_t divisor = clamp_divisor ? std::max<int64_t>(count - correction, 1) : count - correction;
  if (divisor <= 0) return ss * std::numeric_limits<double>::infinity();
  return ss * (1.0 / static_cast<double>(divisor));
}
}  // namespace

Tensor var(const Tensor& a, std::vector<int64_t> axes, const VarianceOptions& options) {
  return variance(a, std::move(axes), options.correction(), options.keepdim(), "var");
}
Tensor var(const Tensor& a, std::vector<int64_t> axes, bool keepdim, bool unbiased) {
  return variance(a, std::move(axes), unbiased ? 1 : 0, keepdim, "var", true);
}
Tensor std(const Tensor& a, std::vector<int64_t> axes, const VarianceOptions& options) {
  return sqrt(variance(a, std::move(axes), options.correction(), options.keepdim(), "std"));
}
Tensor std(const Tensor& a, std::vector<int64_t> axes, bool keepdim, bool unbiased) {
  return sqrt(variance(a, std::move(axes), unbiased ? 1 : 0, keepdim, "std", true));
}

Tensor argmax(const Tensor& a, int64_t axis, bool keepdim) {
  int ax = normalize_axis(axis, a.dim(), "argmax");
  int64_t n = a.shape()[ax];
  // A NaN is the maximum (max propagates it), and NaN != NaN: match it with ne(a, a).
  Tensor is_max = logical_or(eq(a, max(a, {ax}, true)), ne(a, a));
  // The first maximum: smallest index among positions equal to the max.
  Tensor idx = iota(a.shape(), ax, DType::Int64);
  Tensor candidates = where(is_max, idx, full(a.shape(), static_cast<double>(n), DType::Int64));
  return min(candidates, {ax}, keepdim);
}

}  // namespace kiln
