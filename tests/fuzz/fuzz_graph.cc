// libFuzzer target: differential testing of kiln's execution paths. The input bytes describe a
// small program of kiln ops on one or two leaf tensors: elementwise unary and binary ops with
// broadcasting, views (permute, transpose, slice, expand, pad, reshape, squeeze/unsqueeze),
// reductions, softmax, matmul and dtype casts. The program runs three ways:
//   lazy   (the default: recorded, fused and compiled by the JIT) in the program's dtype,
//   eager  (flags().lazy = false: op by op) in the same dtype,
//   eager  in float64, every cast kept at float64: the reference;
// and each run also takes the gradient of a weighted sum of the result with respect to the leaves
// (backward). Lazy and eager must agree bit for bit (docs/guide.md, "What kiln guarantees"); both,
// and a fourth run, lazy on the emulated CUDA device (cuda:0 on the host; other math functions,
// so not the CPU's bits), must agree with the reference within tolerances that follow the lowest
// precision the program uses. A mismatch aborts with the program printed. A kiln::Error (e.g. a
// shape an op rejects) must be thrown alike in all the runs.
//
// Shapes use extents 1 to 3 and rank up to 3, and programs hold at most 6 ops, so the kernels the
// JIT compiles (by the host compiler, cached on disk) recur across inputs.
#include <fuzzer/FuzzedDataProvider.h>
#include <kiln/kiln.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_input.h"

namespace {

using namespace kiln;

enum class Kind {
  Neg, Tanh, Sin, Sigmoid, Square, SqrtSquarePlusOne, Abs, Relu,      // unary
  Add, Sub, Mul, DivBySquarePlusOne, Maximum,                         // binary, broadcasting
  Permute, Transpose, Slice, Expand, Pad, Reshape, Squeeze, Unsqueeze,  // views
  Sum, Mean, Max, Softmax,                                            // reductions
  MatmulTransposed, Cast,
  Count
};
const char* const kKindNames[] = {"neg",     "tanh",      "sin",     "sigmoid", "square",  "sqrt(x*x+1)",
                                  "abs",     "relu",      "add",     "sub",     "mul",     "div(a, b*b+1)",
                                  "maximum", "permute",   "transpose", "slice", "expand",  "pad",
                                  "reshape", "squeeze",   "unsqueeze", "sum",   "mean",    "max",
                                  "softmax", "x @ x^T",   "cast"};
static_assert(std::size(kKindNames) == static_cast<size_t>(Kind::Count));

// Ops whose gradient jumps (at 0 or at ties): a rounding difference between dtypes can move an
// input across the jump, so programs with them compare values, not gradients.
bool non_smooth(Kind k) { return k == Kind::Abs || k == Kind::Relu || k == Kind::Maximum || k == Kind::Max; }

struct Step {
  Kind kind;
  uint8_t a, b, c;  // raw parameters, resolved against the operand's shape when applied
  uint8_t other;    // a binary op's second operand: an earlier value
};

struct Program {
  std::vector<Shape> leaf_shapes;
  std::vector<std::vector<double>> leaf_values;
  DType dtype = DType::Float32;
  std::vector<Step> ops;
};

const DType kDTypes[] = {DType::Float32, DType::BFloat16, DType::Float16};

Program decode(FuzzedDataProvider& in) {
  Program p;
  p.dtype = kDTypes[in.ConsumeIntegralInRange<int>(0, 2)];
  const int leaves = in.ConsumeIntegralInRange<int>(1, 2);
  for (int l = 0; l < leaves; ++l) {
    Shape shape(in.ConsumeIntegralInRange<int>(0, 3));
    for (auto& d : shape) d = in.ConsumeIntegralInRange<int>(1, 3);
    std::vector<double> values(static_cast<size_t>(numel(shape)));
    // Quarters in [-2, 2]: exact in every dtype, so every run starts from the same numbers.
    for (auto& v : values) v = (in.ConsumeIntegralInRange<int>(0, 16) - 8) / 4.0;
    p.leaf_shapes.push_back(shape);
    p.leaf_values.push_back(values);
  }
  const int ops = in.ConsumeIntegralInRange<int>(1, 6);
  for (int i = 0; i < ops && in.remaining_bytes() > 0; ++i) {
    Step op;
    op.kind = static_cast<Kind>(in.ConsumeIntegralInRange<int>(0, static_cast<int>(Kind::Count) - 1));
    op.a = in.ConsumeIntegral<uint8_t>();
    op.b = in.ConsumeIntegral<uint8_t>();
    op.c = in.ConsumeIntegral<uint8_t>();
    op.other = in.ConsumeIntegral<uint8_t>();
    p.ops.push_back(op);
  }
  return p;
}

bool broadcastable(const Shape& a, const Shape& b) {
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    int64_t x = a[a.size() - 1 - i], y = b[b.size() - 1 - i];
    if (x != y && x != 1 && y != 1) return false;
  }
  return true;
}

// One run's result: the program's output and each leaf's gradient, as doubles; or the message of
// the kiln::Error it threw.
struct Outcome {
  std::vector<double> value;
  std::vector<std::vector<double>> grads;
  std::optional<std::string> error;
  double largest = 0;  // the largest magnitude of any value or gradient (NaN: one is not finite)
};

// Raises `largest` to the magnitudes of `values` (NaN when one is NaN or infinite).
void track(double& largest, const std::vector<double>& values) {
  for (double v : values) largest = std::isfinite(v) ? std::max(largest, std::abs(v)) : NAN;
}

// Applies `op` to the last value (and an earlier one); `log` (when given) gets the resolved op.
Tensor apply(const Step& op, const std::vector<Tensor>& values, bool reference, std::string* log) {
  const Tensor& x = values.back();
  const Shape& s = x.shape();
  const int64_t rank = static_cast<int64_t>(s.size());
  std::string detail;
  auto note = [&](std::string text) { detail = std::move(text); };
  Tensor y;
  switch (op.kind) {
    case Kind::Neg: y = neg(x); break;
    case Kind::Tanh: y = tanh(x); break;
    case Kind::Sin: y = sin(x); break;
    case Kind::Sigmoid: y = sigmoid(x); break;
    case Kind::Square: y = mul(x, x); break;
    case Kind::SqrtSquarePlusOne: y = sqrt(add(mul(x, x), scalar_like(1.0, x))); break;
    case Kind::Abs: y = abs(x); break;
    case Kind::Relu: y = relu(x); break;
    case Kind::Add: case Kind::Sub: case Kind::Mul: case Kind::DivBySquarePlusOne: case Kind::Maximum: {
      const size_t index = op.other % values.size();
      Tensor other = values[index];
      // An operand whose shape does not broadcast is summed to a scalar, which always does.
      const bool summed = !broadcastable(s, other.shape());
      if (summed) other = sum(other);
      note(fmt::format("with value {}{}", index, summed ? " summed to a scalar" : ""));
      switch (op.kind) {
        case Kind::Add: y = add(x, other); break;
        case Kind::Sub: y = sub(x, other); break;
        case Kind::Mul: y = mul(x, other); break;
        case Kind::DivBySquarePlusOne: y = div(x, add(mul(other, other), scalar_like(1.0, other))); break;
        default: y = maximum(x, other); break;
      }
      break;
    }
    case Kind::Permute: {
      std::vector<int64_t> perm(static_cast<size_t>(rank));
      std::iota(perm.begin(), perm.end(), 0);
      for (int i = 0; i < op.a % 7; ++i) std::next_permutation(perm.begin(), perm.end());
      note(fmt::format("{}", fmt::join(perm, ",")));
      y = permute(x, perm);
      break;
    }
    case Kind::Transpose: {
      if (rank < 2) { y = x; note("(rank < 2: identity)"); break; }
      int64_t a0 = op.a % rank, a1 = op.b % rank;
      note(fmt::format("{}, {}", a0, a1));
      y = transpose(x, a0, a1);
      break;
    }
    case Kind::Slice: {
      if (rank == 0) { y = x; note("(scalar: identity)"); break; }
      int64_t axis = op.a % rank, extent = s[static_cast<size_t>(axis)];
      int64_t start = op.b % extent, step = 1 + op.c % 2;
      int64_t stop = start + 1 + (op.c / 2) % (extent - start);
      note(fmt::format("axis {} [{}:{}:{}]", axis, start, stop, step));
      y = slice(x, axis, start, stop, step);
      break;
    }
    case Kind::Expand: {
      if (rank >= 3) { y = x; note("(rank 3: identity)"); break; }
      int64_t axis = op.a % (rank + 1), extent = 2 + op.b % 2;
      Tensor u = unsqueeze(x, axis);
      Shape to = u.shape();
      to[static_cast<size_t>(axis)] = extent;
      note(fmt::format("new axis {} of extent {}", axis, extent));
      y = expand(u, to);
      break;
    }
    case Kind::Pad: {
      if (rank == 0) { y = x; note("(scalar: identity)"); break; }
      std::vector<std::pair<int64_t, int64_t>> pads(static_cast<size_t>(rank), {0, 0});
      int64_t axis = op.a % rank;
      pads[static_cast<size_t>(axis)] = {op.b % 2, op.c % 2};
      double fill = (op.c / 2 % 5 - 2) / 2.0;
      note(fmt::format("axis {} by ({}, {}) with {}", axis, op.b % 2, op.c % 2, fill));
      y = pad(x, pads, fill);
      break;
    }
    case Kind::Reshape: {
      // To the extents reversed (same count), or flat.
      Shape to(s.rbegin(), s.rend());
      if (op.a % 2) to = {numel(s)};
      note(shape_str(to));
      y = reshape(x, to);
      break;
    }
    case Kind::Squeeze: {
      auto it = std::find(s.begin(), s.end(), 1);
      if (it == s.end()) { y = x; note("(no extent 1: identity)"); break; }
      note(fmt::format("axis {}", it - s.begin()));
      y = squeeze(x, it - s.begin());
      break;
    }
    case Kind::Unsqueeze: {
      if (rank >= 3) { y = x; note("(rank 3: identity)"); break; }
      int64_t axis = op.a % (rank + 1);
      note(fmt::format("axis {}", axis));
      y = unsqueeze(x, axis);
      break;
    }
    case Kind::Sum: case Kind::Mean: case Kind::Max: {
      std::vector<int64_t> axes;
      if (rank > 0 && op.a % 3 != 0) axes = {op.b % rank};
      bool keepdim = op.c % 2;
      note(fmt::format("axes [{}] keepdim {}", fmt::join(axes, ","), keepdim));
      y = op.kind == Kind::Sum ? sum(x, axes, keepdim) : op.kind == Kind::Mean ? mean(x, axes, keepdim) : max(x, axes, keepdim);
      break;
    }
    case Kind::Softmax: {
      if (rank == 0) { y = x; note("(scalar: identity)"); break; }
      int64_t axis = op.a % rank;
      note(fmt::format("axis {}", axis));
      y = softmax(x, axis);
      break;
    }
    case Kind::MatmulTransposed: {
      if (rank != 2) { y = x; note("(rank != 2: identity)"); break; }
      y = matmul(x, transpose(x, 0, 1));
      break;
    }
    case Kind::Cast: {
      DType to = kDTypes[op.a % 3];
      note(fmt::format("to {}{}", dtype_name(to), reference ? " (float64 in the reference)" : ""));
      y = reference ? x : x.to(to);
      break;
    }
    case Kind::Count: break;
  }
  if (log) *log += fmt::format("  v{} = {}({}) {} -> {}\n", values.size(), kKindNames[static_cast<int>(op.kind)],
                               values.size() - 1, detail, shape_str(y.shape()));
  return y;
}

// Runs `p` lazily or eagerly, in its dtype or (reference) in float64, on the CPU or on cuda:0.
Outcome run(const Program& p, bool lazy, bool reference, std::string* log, bool on_device = false) {
  FlagsGuard guard;
  flags().lazy = lazy;
  flags().use_cuda = on_device;  // every tensor the run makes, on cuda:0
  Outcome out;
  try {
    const DType dtype = reference ? DType::Float64 : p.dtype;
    std::vector<Tensor> leaves;
    for (size_t i = 0; i < p.leaf_shapes.size(); ++i)
      leaves.push_back(from_doubles(p.leaf_values[i], p.leaf_shapes[i], dtype).requires_grad_());
    std::vector<Tensor> values = leaves;
    for (const Step& op : p.ops) {
      values.push_back(apply(op, values, reference, log));
      // The reference runs eagerly: every value is there already, and its size tells how far a
      // rounding error in the program's dtype can have grown.
      if (reference) track(out.largest, values.back().to_vector<double>());
    }
    const Tensor& result = values.back();
    // A weighted sum, so that every element's gradient differs: weights 1, -1/2, 3/4, ... (exact).
    std::vector<double> weights(static_cast<size_t>(result.numel()));
    for (size_t i = 0; i < weights.size(); ++i) weights[i] = (static_cast<double>(i % 5) - 2) / 4 + (i % 2 ? 0 : 1);
    Tensor loss = sum(mul(result, from_doubles(weights, result.shape(), result.dtype())));
    loss.backward();
    // The value and every gradient in one realization: one plan (one compile) for the lazy run.
    std::vector<Tensor> wanted = {result};
    for (const Tensor& leaf : leaves)
      if (leaf.grad().defined()) wanted.push_back(leaf.grad());
    sync(wanted);
    out.value = result.to_vector<double>();
    for (const Tensor& leaf : leaves)
      out.grads.push_back(leaf.grad().defined() ? leaf.grad().to_vector<double>() : std::vector<double>());
    for (const auto& grad : out.grads) track(out.largest, grad);
  } catch (const Error& e) {
    out.error = e.what();
  }
  return out;
}

double unit_roundoff(DType t) {
  switch (t) {
    case DType::BFloat16: return 1.0 / 256;
    case DType::Float16: return 1.0 / 2048;
    default: return 1.0 / 8388608;
  }
}

// The CUDA emulator stands in for a GPU; asked once, from LLVMFuzzerInitialize, before anything
// else asks about CUDA devices (the answer is kept for the process).
bool emulated_device() {
  static const bool available = [] {
    flags().cuda_emulator = true;
    const bool yes = cuda::available();
    if (!yes) std::fprintf(stderr, "fuzz_graph: no emulated CUDA device (%s): CPU runs only\n",
                           cuda::unavailable_reason().c_str());
    return yes;
  }();
  return available;
}

[[noreturn]] void mismatch(const Program& p, const std::string& program_text, const std::string& what) {
  std::string leaves;
  for (size_t i = 0; i < p.leaf_shapes.size(); ++i)
    leaves += fmt::format("  v{} = leaf {} [{}]\n", i, shape_str(p.leaf_shapes[i]), fmt::join(p.leaf_values[i], ", "));
  std::fprintf(stderr, "fuzz_graph: %s\nprogram (%s):\n%s%s", what.c_str(), std::string(dtype_name(p.dtype)).c_str(),
               leaves.c_str(), program_text.c_str());
  std::abort();
}

// Errors are measured against the largest magnitude the reference met (at least 1): a rounding
// of an intermediate value u moves it by about u times the unit roundoff, and sin, tanh, sigmoid
// and softmax pass such an absolute error on undiminished.
void compare(const Program& p, const std::string& text, const char* what, const std::vector<double>& got,
             const std::vector<double>& want, double tolerance, double largest) {
  if (got.size() != want.size())
    mismatch(p, text, fmt::format("{}: {} elements, the reference has {}", what, got.size(), want.size()));
  double scale = std::max(1.0, largest);
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    const bool both_nan = std::isnan(got[i]) && std::isnan(want[i]);
    if (!both_nan && !(std::abs(got[i] - want[i]) <= tolerance * scale))
      mismatch(p, text,
               fmt::format("{}: element {} is {}, the reference {} (tolerance {} x {})\n  got  [{}]\n  want [{}]", what,
                           i, got[i], want[i], tolerance, scale, fmt::join(got, ", "), fmt::join(want, ", ")));
  }
}

// Bit for bit (NaN matches NaN): lazy against eager.
void compare_bits(const Program& p, const std::string& text, const char* what, const std::vector<double>& got,
                  const std::vector<double>& want) {
  if (got.size() != want.size())
    mismatch(p, text, fmt::format("{}: {} elements against {}", what, got.size(), want.size()));
  for (size_t i = 0; i < got.size(); ++i)
    if (!(got[i] == want[i] || (std::isnan(got[i]) && std::isnan(want[i]))))
      mismatch(p, text, fmt::format("{}: element {} is {} against {} (not the same bits)\n  got  [{}]\n  want [{}]",
                                    what, i, got[i], want[i], fmt::join(got, ", "), fmt::join(want, ", ")));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  emulated_device();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const Program p = decode(in);
  std::string text;
  const Outcome lazy = run(p, /*lazy=*/true, /*reference=*/false, &text);
  const Outcome eager = run(p, /*lazy=*/false, /*reference=*/false, nullptr);
  // The reference runs eagerly: op by op, its kernels recur across programs (a few shapes and
  // ops), so only the lazy run compiles anything new.
  const Outcome reference = run(p, /*lazy=*/false, /*reference=*/true, nullptr);
  const bool on_device = emulated_device();
  const Outcome device = on_device ? run(p, /*lazy=*/true, /*reference=*/false, nullptr, /*on_device=*/true) : lazy;
  if (lazy.error.has_value() != eager.error.has_value() || lazy.error.has_value() != reference.error.has_value() ||
      lazy.error.has_value() != device.error.has_value())
    mismatch(p, text, fmt::format("the runs disagree on an Error: lazy {}, eager {}, float64 {}, cuda:0 {}",
                                  lazy.error.value_or("none"), eager.error.value_or("none"),
                                  reference.error.value_or("none"), device.error.value_or("none")));
  if (lazy.error) return 0;

  // The lowest precision the program touches sets the tolerance; every op may add a rounding.
  DType lowest = p.dtype;
  bool smooth = true, float16 = p.dtype == DType::Float16;
  for (const Step& op : p.ops) {
    if (op.kind == Kind::Cast && unit_roundoff(kDTypes[op.a % 3]) > unit_roundoff(lowest)) lowest = kDTypes[op.a % 3];
    float16 = float16 || (op.kind == Kind::Cast && kDTypes[op.a % 3] == DType::Float16);
    smooth = smooth && !non_smooth(op.kind);
  }
  // Values past the range of the program's dtypes (x^64 in float16) overflow there and not in the
  // reference: nothing to compare.
  const double range = float16 ? 65504.0 : 3.0e38;
  if (!(reference.largest <= range / 16)) return 0;
  const double tolerance = 8 * unit_roundoff(lowest) * static_cast<double>(p.ops.size() + 2);
  compare(p, text, "lazy vs float64: value", lazy.value, reference.value, tolerance, reference.largest);
  compare(p, text, "eager vs float64: value", eager.value, reference.value, tolerance, reference.largest);
  compare(p, text, "cuda:0 vs float64: value", device.value, reference.value, tolerance, reference.largest);
  compare_bits(p, text, "lazy vs eager: value", lazy.value, eager.value);
  for (size_t i = 0; i < p.leaf_shapes.size(); ++i)
    compare_bits(p, text, fmt::format("lazy vs eager: gradient of v{}", i).c_str(), lazy.grads[i], eager.grads[i]);
  if (smooth) {
    for (size_t i = 0; i < p.leaf_shapes.size(); ++i) {
      compare(p, text, fmt::format("lazy vs float64: gradient of v{}", i).c_str(), lazy.grads[i], reference.grads[i],
              tolerance, reference.largest);
      compare(p, text, fmt::format("eager vs float64: gradient of v{}", i).c_str(), eager.grads[i], reference.grads[i],
              tolerance, reference.largest);
      compare(p, text, fmt::format("cuda:0 vs float64: gradient of v{}", i).c_str(), device.grads[i],
              reference.grads[i], tolerance, reference.largest);
    }
  }
  return 0;
}
