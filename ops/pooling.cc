// Pooling over the two trailing dims of (N, C, H, W) or (C, H, W) inputs, as composites of
// primitives, so the JIT fuses them and autograd derives the backward.
//
//   Tensor y = kiln::max_pool2d(x, {2, 2});                  // (N, C, H / 2, W / 2)
//   Tensor z = kiln::avg_pool2d(x, {3, 3}, {2, 2}, {1, 1});  // PyTorch's sizes and divisors
//
// Both poolings are separable: a window is a segment along H times a segment along W, so each is
// a 1-d pooling along H followed by one along W. How the graph is built decides how fast the JIT's
// kernels are, the backward's above all; slices with a step > 1 and reshapes that split the
// innermost axis have slow gradients, while gather's gradient (a scatter) is a cheap loop:
//   max   a running comparison over strided slices (no gradient flows through it) finds the
//         position of each window's first maximum; y gathers x there, so the backward is two
//         scatters of dy. The backward of a max reduction, or of the running maximum itself, is
//         several times slower.
//   avg   windows that tile the input (stride == kernel, no padding, H and W multiples of the
//         kernel) are a reshape to (N, C, OH, kh, OW, kw) and a mean over axes 3 and 5; other
//         windows sum kh (then kw) gathers at fixed positions and divide by PyTorch's divisors.
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "ops/autocast.h"
#include "ops/library.h"
#include "ops/ops.h"
#include "ops/primitive.h"

namespace kiln {
namespace {

using Pair = std::array<int64_t, 2>;

int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// One spatial axis of a pooling: input size L, output size O, and the window settings.
struct AxisGeometry {
  int axis = 2;  // 2 (H) or 3 (W) of the 4-d input
  int64_t L = 0, O = 0, kernel = 1, stride = 1, padding = 0, dilation = 1;

  int64_t start(int64_t o) const { return o * stride - padding; }  // first window element of output o
  // Window element i lies inside the input for every output.
  bool always_inside(int64_t i) const { return start(0) + i * dilation >= 0 && start(O - 1) + i * dilation < L; }
};

struct PoolGeometry {
  AxisGeometry h, w;
  // The windows tile the input: stride == kernel, no padding, dilation 1, no remainder.
  bool tiles() const {
    for (const AxisGeometry* a : {&h, &w})
      if (a->stride != a->kernel || a->padding != 0 || a->dilation != 1 || a->L != a->O * a->kernel) return false;
    return true;
  }
};

// PyTorch's pooling_output_shape: in ceil mode the last window must start inside the input or
// the left padding, never in the right padding alone.
int64_t pooled_size(int64_t L, int64_t kernel, int64_t stride, int64_t padding, int64_t dilation, bool ceil_mode) {
  int64_t out = floor_div(L + 2 * padding - dilation * (kernel - 1) - 1 + (ceil_mode ? stride - 1 : 0), stride) + 1;
  if (ceil_mode && (out - 1) * stride >= L + padding) --out;
  return out;
}

PoolGeometry pool_geometry(const char* op, const Tensor& x, Pair kernel, Pair stride, Pair padding, Pair dilation,
                           bool ceil_mode) {
  KILN_CHECK((x.dim() == 3 || x.dim() == 4) && x.size(-1) > 0 && x.size(-2) > 0 && x.size(-3) > 0, op,
             "expects (N, C, H, W) or (C, H, W) with non-zero C, H, W; got {}", shape_str(x.shape()));
  KILN_CHECK(kernel[0] > 0 && kernel[1] > 0, op, "kernel must be positive, got ({}, {})", kernel[0], kernel[1]);
  if (stride == Pair{0, 0}) stride = kernel;
  KILN_CHECK(stride[0] > 0 && stride[1] > 0, op,
             "stride must be positive (or {{0, 0}} for the kernel size), got ({}, {})", stride[0], stride[1]);
  KILN_CHECK(dilation[0] > 0 && dilation[1] > 0, op, "dilation must be positive, got ({}, {})", dilation[0],
             dilation[1]);
  KILN_CHECK(padding[0] >= 0 && padding[1] >= 0 && padding[0] <= kernel[0] / 2 && padding[1] <= kernel[1] / 2, op,
             "padding ({}, {}) must be between 0 and half the kernel ({}, {})", padding[0], padding[1], kernel[0],
             kernel[1]);
  PoolGeometry g;
  for (int a = 0; a < 2; ++a) {
    AxisGeometry& ag = a == 0 ? g.h : g.w;
    ag.axis = 2 + a;
    ag.L = x.size(x.dim() == 4 ? 2 + a : 1 + a);
    ag.kernel = kernel[a];
    ag.stride = stride[a];
    ag.padding = padding[a];
    ag.dilation = dilation[a];
    ag.O = pooled_size(ag.L, kernel[a], stride[a], padding[a], dilation[a], ceil_mode);
  }
  KILN_CHECK(g.h.O >= 1 && g.w.O >= 1, op,
             "input {} is too small for kernel ({}, {}) with padding ({}, {}) and dilation ({}, {}): the output "
             "would be {} x {}; use a smaller kernel or dilation, or more padding",
             shape_str(x.shape()), kernel[0], kernel[1], padding[0], padding[1], dilation[0], dilation[1], g.h.O,
             g.w.O);
  // With dilation a window can straddle a small input without touching it (PyTorch gives -inf).
  for (const AxisGeometry* a : {&g.h, &g.w})
    for (int64_t o = 0; o < a->O; ++o) {
      bool touches = false;
      for (int64_t i = 0; i < a->kernel && !touches; ++i)
        touches = a->start(o) + i * a->dilation >= 0 && a->start(o) + i * a->dilation < a->L;
      KILN_CHECK(touches, op, "a window of input {} with kernel ({}, {}), padding ({}, {}) and dilation ({}, {}) "
                 "holds only padding; use less dilation or padding", shape_str(x.shape()), kernel[0], kernel[1],
                 padding[0], padding[1], dilation[0], dilation[1]);
    }
  return g;
}

// t padded along a.axis (zeros) so that the windows' element i of every output is
// t.slice(axis, i * dilation, ..., stride): `padding` before, and after whatever the last window
// reads beyond the input (in ceil mode it may overhang the right padding).
Tensor pad_for_windows(const Tensor& t, const AxisGeometry& a) {
  int64_t read = a.start(a.O - 1) + (a.kernel - 1) * a.dilation + 1;  // one past the last element read
  int64_t after = std::max<int64_t>(0, read - a.L);
  if (a.padding == 0 && after == 0) return t;
  std::vector<std::pair<int64_t, int64_t>> pads(t.dim(), {0, 0});
  pads[a.axis] = {a.padding, after};
  return pad(t, pads);
}

double lowest_value(DType t) {
  switch (t) {
    case DType::UInt8: return 0;
    case DType::Int8: return std::numeric_limits<int8_t>::lowest();
    case DType::Int32: return std::numeric_limits<int32_t>::lowest();
    case DType::Int64: return static_cast<double>(std::numeric_limits<int64_t>::lowest());
    default: return -INFINITY;
  }
}

// Max pooling along one axis: for every output, the first maximum of its window and its
// position along the axis (NaN wins; padding never does). Among equal values the one with the
// smaller `tie_rank` (shaped like `values`, optional) comes first.
struct WindowMax {
  Tensor value;     // (..., O, ...) like values
  Tensor position;  // (..., O, ...) integers of the index dtype
};

WindowMax window_max(const Tensor& values, const Tensor& tie_rank, const AxisGeometry& a, DType index_dtype) {
  Tensor padded = pad_for_windows(values, a);
  Tensor padded_rank = tie_rank.defined() ? pad_for_windows(tie_rank, a) : Tensor();
  auto element = [&](const Tensor& t, int64_t i) {  // (..., O, ...): window element i of every output
    return t.slice(a.axis, i * a.dilation, i * a.dilation + (a.O - 1) * a.stride + 1, a.stride);
  };
  Shape out_shape = values.shape(), line(values.dim(), 1);
  out_shape[a.axis] = a.O;
  line[a.axis] = a.O;
  Tensor start = iota(line, a.axis, index_dtype) * static_cast<double>(a.stride) - static_cast<double>(a.padding);
  bool floating = is_floating(values.dtype());
  Tensor best, best_at, best_rank;  // (..., O, ...): the running maximum, its position and rank
  bool nothing_taken_yet = false;   // best_at starts at -1: the first in-input element must win
  for (int64_t i = 0; i < a.kernel; ++i) {
    Tensor v = element(padded, i);
    Tensor rank = tie_rank.defined() ? element(padded_rank, i) : Tensor();
    Tensor at = start + static_cast<double>(i * a.dilation);  // (.., O, ..) position of v
    bool inside = a.always_inside(i);
    if (!best.defined()) {
      if (inside) {
        best = v;
        best_at = broadcast_to(at, out_shape);
        best_rank = rank;
        continue;
      }
      best = full(out_shape, lowest_value(values.dtype()), values.dtype());
      best_at = full(out_shape, -1, index_dtype);
      if (rank.defined()) best_rank = full(out_shape, 0, rank.dtype());
      nothing_taken_yet = true;
    }
    Tensor wins = gt(v, best);
    if (rank.defined()) wins = logical_or(wins, logical_and(eq(v, best), lt(rank, best_rank)));
    if (floating) wins = logical_or(wins, ne(v, v));
    if (nothing_taken_yet) wins = logical_or(wins, lt(best_at, scalar_like(0.0, best_at)));
    if (!inside)
      wins = logical_and(wins, logical_and(ge(at, scalar_like(0.0, at)), lt(at, scalar_like(double(a.L), at))));
    best = where(wins, v, best);
    best_at = where(wins, at, best_at);
    if (rank.defined()) best_rank = where(wins, rank, best_rank);
  }
  return {best, best_at};
}

// Along H, then along W over the column maxima. At equal values the column whose maximum sits
// in the highest row wins, then the leftmost: the first maximum in row-major order, PyTorch's
// choice, which also decides where the gradient goes.
Tensor max_pool_4d(const Tensor& x, const PoolGeometry& g) {
  DType index_dtype = std::max(g.h.L, g.w.L) < (int64_t{1} << 31) ? DType::Int32 : DType::Int64;
  Tensor row = window_max(x, Tensor(), g.h, index_dtype).position;          // (N, C, OH, W)
  Tensor column_max = gather(x, 2, row);                                     // (N, C, OH, W)
  Tensor column = window_max(column_max, row, g.w, index_dtype).position;  // (N, C, OH, OW)
  return gather(column_max, 3, column);                                      // (N, C, OH, OW)
}

// Windows that tile the input (the common 2 x 2), in one pass: over the view (N, C, OH, kh * W),
// where output row oh owns the kh input rows it pools, window element (a, b) of output (oh, ow)
// sits at ow * kw + a * W + b. A comparison over the window's elements finds the first maximum
// (NaN counts as one) and keeps its offset a * W + b, an int8 where it fits; the output gathers
// at ow * kw + offset, and the backward scatters there. The scheduler stores the narrow offset,
// not the int32 position computed from it (jit/schedule.cc), so the backward keeps a byte per
// output where the general path below keeps int32 positions at two sizes, and runs one scatter
// instead of two.
Tensor max_pool_tiled(const Tensor& x, const PoolGeometry& g) {
  const int64_t N = x.size(0), C = x.size(1), OH = g.h.O, OW = g.w.O, W = g.w.L, kh = g.h.kernel, kw = g.w.kernel;
  const int64_t last = (kh - 1) * W + kw - 1;
  const DType offset_t = last <= 127 ? DType::Int8 : DType::Int32;
  if (library_pool(x.device(), x.dtype())) {
    // The same choice and gather from host kernels: the JIT's loops below compile to scalar code
    // with branches (GCC 12 does not vectorize their short rows of stride-2 loads), several
    // times the time of their reads.
    return prim::max_pool_gather(x, prim::max_pool_offsets(x, kh, kw, offset_t), kh, kw);
  }
  Tensor rows = x.reshape({N, C, OH, kh * W});
  std::vector<Tensor> element;  // window element (a, b) of every output, row-major: (N, C, OH, OW)
  std::vector<int64_t> offset;
  for (int64_t a = 0; a < kh; ++a)
    for (int64_t b = 0; b < kw; ++b) {
      element.push_back(rows.slice(3, a * W + b, a * W + b + (OW - 1) * kw + 1, kw));
      offset.push_back(a * W + b);
    }
  Tensor m = element[0];
  for (size_t j = 1; j < element.size(); ++j) m = maximum(m, element[j]);  // NaN wins
  // The first element equal to the maximum (a NaN equals the NaN maximum it made), as a select
  // chain from the last element back.
  Tensor chosen = broadcast_to(scalar(static_cast<double>(offset.back()), offset_t), m.shape());
  for (size_t j = element.size() - 1; j-- > 0;) {
    const Tensor& e = element[j];
    chosen = where(logical_or(eq(e, m), ne(e, e)), scalar(static_cast<double>(offset[j]), offset_t), chosen);
  }
  Tensor index = iota(chosen.shape(), 3, DType::Int32) * static_cast<double>(kw) + chosen.cast(DType::Int32);
  return gather(rows, 3, index);
}

// Sum pooling along one axis: (..., L, ...) -> (..., O, ...), a sum of kernel gathers from t
// (whose backward is a scatter each); window elements in the padding add zero.
Tensor window_sum(const Tensor& t, const AxisGeometry& a, DType index_dtype) {
  Shape line(t.dim(), 1), out_shape = t.shape();
  line[a.axis] = a.O;
  out_shape[a.axis] = a.O;
  Tensor start = iota(line, a.axis, index_dtype) * static_cast<double>(a.stride) - static_cast<double>(a.padding);
  Tensor total;
  for (int64_t i = 0; i < a.kernel; ++i) {
    Tensor at = start + static_cast<double>(i * a.dilation);  // (.., O, ..)
    bool inside = a.always_inside(i);
    Tensor v = gather(t, a.axis, broadcast_to(inside ? at : clamp(at, 0, double(a.L - 1)), out_shape));
    if (!inside) {
      Tensor in_input = logical_and(ge(at, scalar_like(0.0, at)), lt(at, scalar_like(double(a.L), at)));
      v = where(in_input, v, zeros_like(v));
    }
    total = total.defined() ? total + v : v;
  }
  return total;
}

// PyTorch's divisor along one axis, for each output: the window clipped to the padded input
// (count_include_pad) or to the input itself. The 2-d divisor is the product of both axes'.
std::vector<double> window_counts(const AxisGeometry& a, bool count_include_pad) {
  std::vector<double> counts(static_cast<size_t>(a.O));
  for (int64_t o = 0; o < a.O; ++o) {
    int64_t begin = a.start(o), end = std::min(begin + a.kernel, a.L + a.padding);
    if (!count_include_pad) begin = std::max<int64_t>(begin, 0), end = std::min(end, a.L);
    counts[static_cast<size_t>(o)] = static_cast<double>(end - begin);
  }
  return counts;
}

Tensor avg_pool_4d(const Tensor& x, const PoolGeometry& g, bool count_include_pad) {
  int64_t N = x.size(0), C = x.size(1);
  if (g.tiles()) return mean(x.reshape({N, C, g.h.O, g.h.kernel, g.w.O, g.w.kernel}), {3, 5});  // (N, C, OH, OW)
  // Half types sum in float32, as PyTorch's accumulate type does.
  bool half = x.dtype() == DType::Float16 || x.dtype() == DType::BFloat16;
  DType index_dtype = std::max(g.h.L, g.w.L) < (int64_t{1} << 31) ? DType::Int32 : DType::Int64;
  Tensor total = window_sum(window_sum(half ? cast(x, DType::Float32) : x, g.h, index_dtype), g.w, index_dtype);
  std::vector<double> rows = window_counts(g.h, count_include_pad), columns = window_counts(g.w, count_include_pad);
  auto uniform = [](const std::vector<double>& v) {
    return std::all_of(v.begin(), v.end(), [&](double c) { return c == v[0]; });
  };
  Tensor out = total;
  if (uniform(rows) && uniform(columns)) {
    out = total / (rows[0] * columns[0]);
  } else {
    Tensor divisor = from_doubles(rows, {g.h.O, 1}, total.dtype()) * from_doubles(columns, {1, g.w.O}, total.dtype());
    out = total / divisor;  // (OH, OW) broadcast
  }
  return half ? cast(out, x.dtype()) : out;
}

// z where x is a pending relu(z) = max(z, +0) that gradients flow through as recorded, else an
// undefined tensor. Not through a gradient boundary: a detached or no-grad copy, a leaf made by
// requires_grad_ or assign (its gradient goes to the leaf), a checkpoint segment's output (the
// pooling would read inside the segment and keep what it should recompute).
Tensor relu_input(const Tensor& x) {
  const Node& n = *x.node();
  if (n.realized() || n.op != Op::Max || n.inputs.size() != 2 || !is_floating(x.dtype()) || n.grad_leaf ||
      n.segment || n.requires_grad != n.inputs[0]->requires_grad)
    return {};
  const Node* zero = prim::constant_source(*n.inputs[1]);
  // (max(z, -0.0) gives -0.0 where z <= 0: not relu's bits)
  if (zero->realized() || zero->op != Op::Full || zero->scalar != 0.0 || std::signbit(zero->scalar) ||
      zero->requires_grad)
    return {};
  return Tensor(n.inputs[0]);
}

}  // namespace

Tensor max_pool2d(const Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                  std::array<int64_t, 2> padding, std::array<int64_t, 2> dilation, bool ceil_mode) {
  // max_pool2d(relu(z)) is relu(max_pool2d(z)), exactly: relu is monotone, so each window's
  // first maximum is the same element wherever it is positive (NaN included), and where it is
  // not both give 0 and no gradient. Pooled first, the relu and its backward run on a quarter
  // of the elements (for 2 x 2 windows), and the backward keeps no full-size relu output.
  if (Tensor z = relu_input(x); z.defined()) return relu(max_pool2d(z, kernel, stride, padding, dilation, ceil_mode));
  AutocastScope amp("max_pool2d");
  PoolGeometry g = pool_geometry("max_pool2d", x, kernel, stride, padding, dilation, ceil_mode);
  KILN_CHECK(x.dtype() != DType::Bool, "max_pool2d", "input {} is bool; cast it to a number type first",
             shape_str(x.shape()));
  auto pool = [&](const Tensor& x4) {
    return g.tiles() && is_floating(x4.dtype()) ? max_pool_tiled(x4, g) : max_pool_4d(x4, g);
  };
  if (x.dim() == 3) return pool(unsqueeze(x, 0)).squeeze(0);
  return pool(x);
}

Tensor avg_pool2d(const Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                  std::array<int64_t, 2> padding, bool ceil_mode, bool count_include_pad) {
  AutocastScope amp("avg_pool2d");
  PoolGeometry g = pool_geometry("avg_pool2d", x, kernel, stride, padding, {1, 1}, ceil_mode);
  KILN_CHECK(is_floating(x.dtype()), "avg_pool2d", "input {} has dtype {}; averages need a float type (cast first)",
             shape_str(x.shape()), dtype_name(x.dtype()));
  if (x.dim() == 3) return avg_pool_4d(unsqueeze(x, 0), g, count_include_pad).squeeze(0);
  return avg_pool_4d(x, g, count_include_pad);
}

}  // namespace kiln
