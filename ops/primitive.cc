#include "ops/primitive.h"

#include <algorithm>

#include "core/autograd.h"
#include "core/flags.h"
#include "backends/cuda/cuda_runtime.h"

namespace kiln::prim {

Tensor make(Op op, DType dtype, Shape shape, TensorInputs inputs, std::vector<int64_t> ints) {
  return finish(record(op, dtype, std::move(shape), std::move(inputs), std::move(ints)));
}

// Eager mode runs every op that computes at once. A view (reshape, permute, slice, ...) stays a
// view of its input until the op reading it runs, as in lazy mode: a copy would hand a matmul
// another operand layout, which oneDNN sums in another order (eager and lazy must agree bit for
// bit; the transpose in a weight gradient did not, on AVX2).
Tensor finish(Tensor t) {
  if (!flags().lazy && op_kind(t.node()->op) != OpKind::Movement) t.realize();
  return t;
}

namespace {

// A pending node computed from generators alone (full, iota, rand, and ops on them) holds no
// data: recorded again on another device it gives the same values there (Philox counters
// included). Such inputs follow the device of the tensors they meet, as a PyTorch composite
// passes device=x.device to its factory calls; anything else on the wrong device is an error.
bool generated_only(const Node& n, int depth = 0) {
  if (n.realized() || n.requires_grad || n.segment || depth > 16) return false;
  if (n.inputs.empty()) return n.op == Op::Full || n.op == Op::Iota || n.op == Op::RandUniform || n.op == Op::RandNormal;
  return std::all_of(n.inputs.begin(), n.inputs.end(), [&](const NodePtr& in) { return generated_only(*in, depth + 1); });
}

NodePtr regenerate_on(const NodePtr& n, Device device) {
  auto copy = new_node(*n);
  copy->id = Node::next_id();
  copy->held = 0;
  copy->var.reset();
  copy->replaces.reset();
  copy->device = device;
  for (NodePtr& in : copy->inputs) in = regenerate_on(in, device);
  return copy;
}

}  // namespace

Tensor follow(const Tensor& t, Device device) {
  if (t.device() == device) return t;
  return generated_only(*t.node()) ? Tensor(regenerate_on(t.node(), device)) : t.to(device);
}

Tensor record(Op op, DType dtype, Shape shape, TensorInputs inputs, std::vector<int64_t> ints) {
  if (inputs.size() > 1) {
    Device device = inputs[0].device();
    bool mixed = false;
    for (const Tensor& in : inputs) mixed |= in.device() != device;
    if (mixed) {
      for (const Tensor& in : inputs)
        if (!generated_only(*in.node())) device = in.device();
      for (Tensor& in : inputs)
        if (generated_only(*in.node())) in = follow(in, device);
    }
  }
  auto node = new_node();
  node->op = op;
  node->dtype = dtype;
  node->shape = std::move(shape);
  node->ints = std::move(ints);
  if (inputs.empty() && flags().use_cuda) {  // KILN_USE_CUDA: new tensors start on the first GPU
    cuda::check_device(Device::cuda(0), op_name(op));
    node->device = Device::cuda(0);
  }
  bool needs_grad = false;
  node->inputs.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const NodePtr& in = inputs[i].node();
    if (i > 0)
      KILN_CHECK(in->device == inputs[0].device(), op_name(op), "inputs on different devices: {} {} on {} and {} {} "
                 "on {}; move them with .to() first", shape_str(inputs[0].shape()), op_name(inputs[0].node()->op),
                 inputs[0].device().str(), shape_str(in->shape), op_name(in->op), in->device.str());
    node->device = in->device;
    needs_grad |= in->requires_grad;
    node->inputs.push_back(in);
  }
  node->requires_grad = needs_grad && grad_enabled();
  return Tensor(std::move(node));
}

Tensor full(Shape shape, double value, DType dtype) {
  Tensor t = record(Op::Full, dtype, std::move(shape), {});
  t.node()->scalar = value;
  return finish(t);
}

Tensor iota(Shape shape, int64_t axis, DType dtype) {
  int ax = normalize_axis(axis, shape.size(), "iota");
  return make(Op::Iota, dtype, std::move(shape), {}, {ax});
}

Tensor unary(Op op, const Tensor& a) {
  DType out = a.dtype();
  if (op == Op::Not) out = DType::Bool;
  bool float_only = op != Op::Neg && op != Op::Abs && op != Op::Sign && op != Op::Not;
  KILN_CHECK(!float_only || is_floating(a.dtype()), op_name(op),
             "needs a floating-point tensor, got {} {}; cast it first (e.g. .cast(kiln::DType::Float32))",
             dtype_name(a.dtype()), shape_str(a.shape()));
  return make(op, out, a.shape(), {a});
}

Tensor cast(const Tensor& a, DType dtype) {
  if (a.dtype() == dtype) return a;
  return make(Op::Cast, dtype, a.shape(), {a});
}

Tensor binary(Op op, const Tensor& a, const Tensor& b) {
  KILN_CHECK(a.shape() == b.shape() && a.dtype() == b.dtype(), op_name(op),
             "operands must match after broadcasting: {} {} vs {} {}", shape_str(a.shape()),
             dtype_name(a.dtype()), shape_str(b.shape()), dtype_name(b.dtype()));
  bool compare = op == Op::Lt || op == Op::Le || op == Op::Gt || op == Op::Ge || op == Op::Eq ||
                 op == Op::Ne || op == Op::And || op == Op::Or;
  if (op == Op::Pow)
    KILN_CHECK(is_floating(a.dtype()), "Pow", "needs floating-point operands, got {}", dtype_name(a.dtype()));
  return make(op, compare ? DType::Bool : a.dtype(), a.shape(), {a, b});
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  KILN_CHECK(cond.dtype() == DType::Bool && cond.shape() == a.shape() && a.shape() == b.shape() &&
                 a.dtype() == b.dtype(),
             "where", "needs a bool condition and two values of one shape and dtype; got {} {}, {} {}, {} {}",
             shape_str(cond.shape()), dtype_name(cond.dtype()), shape_str(a.shape()), dtype_name(a.dtype()),
             shape_str(b.shape()), dtype_name(b.dtype()));
  return make(Op::Where, a.dtype(), a.shape(), {cond, a, b});
}

Tensor reshape(const Tensor& a, const Shape& shape) {
  KILN_CHECK(numel(shape) == a.numel(), "reshape", "cannot reshape {} ({} elements) to {} ({} elements)",
             shape_str(a.shape()), a.numel(), shape_str(shape), numel(shape));
  if (shape == a.shape()) return a;
  return make(Op::Reshape, a.dtype(), shape, {a});
}

Tensor permute(const Tensor& a, const std::vector<int64_t>& perm) {
  std::vector<int64_t> sorted = perm;
  std::sort(sorted.begin(), sorted.end());
  bool ok = sorted.size() == a.dim();
  for (size_t i = 0; ok && i < sorted.size(); ++i) ok = sorted[i] == static_cast<int64_t>(i);
  KILN_CHECK(ok, "permute", "[{}] is not a permutation of the {} axes of {}", fmt::join(perm, ", "), a.dim(),
             shape_str(a.shape()));
  bool identity = true;
  for (size_t i = 0; i < perm.size(); ++i) identity &= perm[i] == static_cast<int64_t>(i);
  if (identity) return a;
  const NodePtr& n = a.node();
  if (n->op == Op::Permute && !n->realized() && !n->requires_grad) {
    // A permute of a permute is one permute (often none: the gradient of a transposed operand
    // transposed back). Only where no gradient can be asked for the skipped node.
    std::vector<int64_t> composed(perm.size());
    for (size_t i = 0; i < perm.size(); ++i) composed[i] = n->ints[perm[i]];
    return permute(Tensor(n->inputs[0]), composed);
  }
  Shape out(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) out[i] = a.shape()[perm[i]];
  return make(Op::Permute, a.dtype(), out, {a}, perm);
}

Tensor expand(const Tensor& a, const Shape& shape) {
  bool ok = shape.size() == a.dim();
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = a.shape()[i] == shape[i] || a.shape()[i] == 1;
  KILN_CHECK(ok, "expand", "cannot expand {} to {}: only size-1 dims can grow", shape_str(a.shape()),
             shape_str(shape));
  if (shape == a.shape()) return a;
  return make(Op::Expand, a.dtype(), shape, {a});
}

Tensor slice(const Tensor& a, const std::vector<int64_t>& starts, const std::vector<int64_t>& steps,
             const Shape& shape) {
  // Taking back exactly what a pad surrounded (a slice's gradient sliced again, as the fused
  // attention's backward does) is the padded value itself: no kernel has to fill the zeros.
  const Node& n = *a.node();
  if (n.op == Op::Pad && !n.realized() && n.inputs[0]->shape == shape &&
      std::equal(starts.begin(), starts.end(), n.ints.begin()) &&
      std::all_of(steps.begin(), steps.end(), [](int64_t s) { return s == 1; }))
    return Tensor(n.inputs[0]);
  std::vector<int64_t> ints = starts;
  ints.insert(ints.end(), steps.begin(), steps.end());
  return make(Op::Slice, a.dtype(), shape, {a}, ints);
}

Tensor pad(const Tensor& a, const std::vector<int64_t>& before, const std::vector<int64_t>& after) {
  Shape shape = a.shape();
  for (size_t i = 0; i < shape.size(); ++i) {
    KILN_CHECK(before[i] >= 0 && after[i] >= 0, "pad", "negative padding {} / {} on axis {}", before[i], after[i], i);
    shape[i] += before[i] + after[i];
  }
  std::vector<int64_t> ints = before;
  ints.insert(ints.end(), after.begin(), after.end());
  return make(Op::Pad, a.dtype(), shape, {a}, ints);
}

Tensor reduce(Op op, const Tensor& a, std::vector<int64_t> axes) {
  Shape shape = a.shape();
  for (int64_t ax : axes) shape[ax] = 1;
  if (axes.empty()) return a;
  return make(op, a.dtype(), shape, {a}, std::move(axes));
}

Tensor gather(const Tensor& a, int64_t axis, const Tensor& index) {
  KILN_CHECK(is_integral(index.dtype()) && index.dtype() != DType::Bool && index.dim() == a.dim(), "gather",
             "index must be an integer tensor of the input's rank; got input {} and index {} {}",
             shape_str(a.shape()), shape_str(index.shape()), dtype_name(index.dtype()));
  for (size_t d = 0; d < a.dim(); ++d)
    KILN_CHECK(d == static_cast<size_t>(axis) || index.shape()[d] <= a.shape()[d], "gather",
               "index {} is larger than input {} in dimension {}", shape_str(index.shape()),
               shape_str(a.shape()), d);
  return make(Op::Gather, a.dtype(), index.shape(), {a, index}, {axis});
}

Tensor scatter_add(const Shape& shape, int64_t axis, const Tensor& index, const Tensor& src) {
  KILN_CHECK(is_integral(index.dtype()) && index.dtype() != DType::Bool && index.shape() == src.shape() &&
                 index.dim() == shape.size(),
             "scatter_add", "index and src must have one shape and the output's rank; got output {}, index {} {}, src {}",
             shape_str(shape), shape_str(index.shape()), dtype_name(index.dtype()), shape_str(src.shape()));
  for (size_t d = 0; d < shape.size(); ++d)
    KILN_CHECK(d == static_cast<size_t>(axis) || index.shape()[d] <= shape[d], "scatter_add",
               "index {} is larger than output {} in dimension {}", shape_str(index.shape()), shape_str(shape), d);
  return make(Op::ScatterAdd, src.dtype(), shape, {index, src}, {axis});
}

Tensor matmul(const Tensor& a, const Tensor& b) {
  KILN_CHECK(a.dim() == 3 && b.dim() == 3 && a.shape()[0] == b.shape()[0] && a.shape()[2] == b.shape()[1] &&
                 a.dtype() == b.dtype(),
             "matmul", "needs (B, M, K) @ (B, K, N) of one dtype; got {} {} @ {} {}", shape_str(a.shape()),
             dtype_name(a.dtype()), shape_str(b.shape()), dtype_name(b.dtype()));
  return make(Op::Matmul, a.dtype(), {a.shape()[0], a.shape()[1], b.shape()[2]}, {a, b});
}

Tensor all_reduce(const Tensor& x, int64_t op, int64_t world, bool replicated, int64_t group) {
  KILN_CHECK((op == 0 || op == 2) && world > 1 && group >= 0, "all_reduce",
             "op must be 0 (sum) or 2 (max) in a world of 2 or more, got {} in {} (group {})", op, world, group);
  return make(Op::AllReduce, x.dtype(), x.shape(), {x}, {op, world, replicated ? 1 : 0, group});
}

Tensor all_reduce_gradient(const Tensor& x, int64_t world, int64_t group) {
  KILN_CHECK(world > 1 && group >= 0, "all_reduce_gradient", "needs a world of 2 or more, got {} (group {})", world, group);
  // A reshape to the same shape is a free view; the attributes only change its gradient rule.
  return make(Op::Reshape, x.dtype(), x.shape(), {x}, {world, group});
}

Tensor send(const Tensor& x, int64_t to, int64_t tag) {
  KILN_CHECK(to >= 0 && tag >= 0, "send", "sends to a rank >= 0 with a tag >= 0; got {} to rank {} with tag {}", x.str(),
             to, tag);
  return make(Op::Send, x.dtype(), {1}, {x}, {to, tag});
}

Tensor recv(const Shape& shape, DType dtype, int64_t from, int64_t tag, Device device) {
  KILN_CHECK(from >= 0 && tag >= 0, "recv", "receives from a rank >= 0 with a tag >= 0; got rank {} with tag {}", from, tag);
  Tensor t = record(Op::Recv, dtype, shape, {}, {from, tag});
  t.node()->device = device;
  return finish(t);
}

Tensor all_reduce(const std::vector<Tensor>& parts, int64_t op, int64_t world, int64_t group) {
  KILN_CHECK(!parts.empty(), "all_reduce", "needs at least one tensor");
  if (parts.size() == 1) return all_reduce(parts[0].reshape({parts[0].numel()}), op, world, false, group);
  KILN_CHECK((op == 0 || op == 2) && world > 1, "all_reduce", "op must be 0 (sum) or 2 (max) in a world of 2 or more, got {} in {}",
             op, world);
  int64_t total = 0;
  for (const Tensor& p : parts) {
    KILN_CHECK(p.dtype() == parts[0].dtype() && p.device() == parts[0].device(), "all_reduce",
               "the tensors of one all-reduce share a dtype and a device; got {} and {}", parts[0].str(), p.str());
    total += p.numel();
  }
  return make(Op::AllReduce, parts[0].dtype(), {total}, TensorInputs(parts.begin(), parts.end()), {op, world, 0, group});
}

Tensor quantized_matmul(const Tensor& a, const Tensor& b) {
  KILN_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) && a.dtype() == DType::Int8 &&
                 b.dtype() == DType::Int8,
             "quantized_matmul", "needs int8 (M, K) @ int8 (K, N); got {} @ {}", a.str(), b.str());
  KILN_CHECK(a.device().is_cpu(), "quantized_matmul", "the int8 matmul runs on the host; got {}", a.str());
  return make(Op::QuantizedMatmul, DType::Float32, {a.size(0), b.size(1)}, {a, b});
}

namespace {

// Output extent of a convolution along one axis, as in PyTorch; < 1 when the window does not fit.
int64_t conv_extent(int64_t in, int64_t kernel, int64_t stride, int64_t padding, int64_t dilation) {
  return (in + 2 * padding - dilation * (kernel - 1) - 1) / stride + 1;
}

ConvGeometry geometry(const Shape& x, const Shape& w, const Shape& y, const std::vector<int64_t>& conv) {
  ConvGeometry g;
  g.N = x[0], g.C = x[1], g.H = x[2], g.W = x[3];
  g.OC = w[0], g.KH = w[2], g.KW = w[3];
  g.OH = y[2], g.OW = y[3];
  g.stride[0] = conv[0], g.stride[1] = conv[1];
  g.padding[0] = conv[2], g.padding[1] = conv[3];
  g.dilation[0] = conv[4], g.dilation[1] = conv[5];
  g.groups = conv[6];
  return g;
}

// The output shape of conv2d(x, w), after checking that the three shapes and attributes agree.
Shape check_conv(std::string_view op, const Shape& x, const Shape& w, const std::vector<int64_t>& conv) {
  KILN_CHECK(x.size() == 4 && w.size() == 4 && conv.size() == 7, op,
             "needs x (N, C, H, W) and weight (OC, C / groups, KH, KW); got {} and {}", shape_str(x), shape_str(w));
  const int64_t groups = conv[6];
  KILN_CHECK(groups >= 1 && x[1] % groups == 0 && w[0] % groups == 0 && w[1] * groups == x[1], op,
             "x {} and weight {} do not match with groups = {}: weight must be (OC, C / groups, KH, KW)",
             shape_str(x), shape_str(w), groups);
  Shape y{x[0], w[0], 0, 0};
  for (int d = 0; d < 2; ++d) {
    KILN_CHECK(conv[d] >= 1 && conv[2 + d] >= 0 && conv[4 + d] >= 1, op,
               "stride and dilation must be >= 1 and padding >= 0; got stride {}, padding {}, dilation {}",
               conv[d], conv[2 + d], conv[4 + d]);
    y[2 + d] = conv_extent(x[2 + d], w[2 + d], conv[d], conv[2 + d], conv[4 + d]);
  }
  KILN_CHECK(y[2] >= 1 && y[3] >= 1, op, "kernel {}x{} (dilation {}, {}) does not fit input {} padded by ({}, {})",
             w[2], w[3], conv[4], conv[5], shape_str(x), conv[2], conv[3]);
  return y;
}

}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& weight, const std::vector<int64_t>& conv) {
  KILN_CHECK(x.dtype() == weight.dtype(), "conv2d", "x is {} but weight is {}", dtype_name(x.dtype()),
             dtype_name(weight.dtype()));
  return make(Op::Conv2d, x.dtype(), check_conv("conv2d", x.shape(), weight.shape(), conv), {x, weight}, conv);
}

Tensor conv2d_backward_data(const Tensor& grad_y, const Tensor& weight, const Shape& x_shape,
                            const std::vector<int64_t>& conv) {
  KILN_CHECK(check_conv("conv2d_backward_data", x_shape, weight.shape(), conv) == grad_y.shape() &&
                 grad_y.dtype() == weight.dtype(),
             "conv2d_backward_data", "gradient {} {} does not match weight {} {} and input {}",
             shape_str(grad_y.shape()), dtype_name(grad_y.dtype()), shape_str(weight.shape()),
             dtype_name(weight.dtype()), shape_str(x_shape));
  return make(Op::Conv2dBackwardData, grad_y.dtype(), x_shape, {grad_y, weight}, conv);
}

Tensor conv2d_backward_weight(const Tensor& x, const Tensor& grad_y, const Shape& weight_shape,
                              const std::vector<int64_t>& conv) {
  KILN_CHECK(check_conv("conv2d_backward_weight", x.shape(), weight_shape, conv) == grad_y.shape() &&
                 grad_y.dtype() == x.dtype(),
             "conv2d_backward_weight", "gradient {} {} does not match input {} {} and weight {}",
             shape_str(grad_y.shape()), dtype_name(grad_y.dtype()), shape_str(x.shape()), dtype_name(x.dtype()),
             shape_str(weight_shape));
  return make(Op::Conv2dBackwardWeight, x.dtype(), weight_shape, {x, grad_y}, conv);
}

const Node* constant_source(const Node& n) {
  const Node* source = &n;
  while ((source->op == Op::Expand || source->op == Op::Reshape) && source->inputs.size() == 1)
    source = source->inputs[0].get();
  return source;
}

// The (N, C, H / kh, W / kw) windows of max_pool_offsets and max_pool_gather, after checking that
// they tile x.
static Shape pool_windows(const char* op, const Tensor& x, int64_t kh, int64_t kw) {
  KILN_CHECK(x.dim() == 4 && kh > 0 && kw > 0 && x.size(2) % kh == 0 && x.size(3) % kw == 0, op,
             "needs (N, C, H, W) tiled by ({}, {}) windows; got {}", kh, kw, shape_str(x.shape()));
  return {x.size(0), x.size(1), x.size(2) / kh, x.size(3) / kw};
}

Tensor max_pool_offsets(const Tensor& x, int64_t kh, int64_t kw, DType offset_t) {
  Shape windows = pool_windows("max_pool_offsets", x, kh, kw);
  const int64_t last = (kh - 1) * x.size(3) + kw - 1;
  KILN_CHECK((offset_t == DType::Int8 && last <= 127) || offset_t == DType::Int32, "max_pool_offsets",
             "offsets up to {} do not fit {}; use int32", last, dtype_name(offset_t));
  return make(Op::MaxPoolOffsets, offset_t, std::move(windows), {x}, {kh, kw});
}

// Offsets of max_pool_offsets for the (N, C, OH, OW) `windows` of `op`'s input `of`.
static void check_pool_offsets(const char* op, const Tensor& offsets, const Shape& windows, const Tensor& of) {
  KILN_CHECK(offsets.shape() == windows && (offsets.dtype() == DType::Int8 || offsets.dtype() == DType::Int32), op,
             "needs int8 or int32 offsets, one per window of {}: {}; got {} {}", shape_str(of.shape()),
             shape_str(windows), dtype_name(offsets.dtype()), shape_str(offsets.shape()));
}

Tensor max_pool_gather(const Tensor& x, const Tensor& offsets, int64_t kh, int64_t kw) {
  const Shape windows = pool_windows("max_pool_gather", x, kh, kw);
  check_pool_offsets("max_pool_gather", offsets, windows, x);
  return make(Op::MaxPoolGather, x.dtype(), offsets.shape(), {x, offsets}, {kh, kw});
}

Tensor max_pool_scatter(const Tensor& g, const Tensor& offsets, int64_t kh, int64_t kw) {
  KILN_CHECK(g.dim() == 4 && kh > 0 && kw > 0, "max_pool_scatter",
             "needs (N, C, OH, OW) pooled values and ({}, {}) windows; got {}", kh, kw, shape_str(g.shape()));
  check_pool_offsets("max_pool_scatter", offsets, g.shape(), g);
  return make(Op::MaxPoolScatter, g.dtype(), {g.size(0), g.size(1), g.size(2) * kh, g.size(3) * kw}, {g, offsets},
              {kh, kw});
}

Shape conv2d_output_shape(const Shape& x, const Shape& weight, const std::vector<int64_t>& conv) {
  return check_conv("conv2d", x, weight, conv);
}

ConvGeometry conv_geometry(const Node& n) {
  const Shape& a = n.inputs[0]->shape;
  const Shape& b = n.inputs[1]->shape;
  switch (n.op) {
    case Op::Conv2d: return geometry(a, b, n.shape, n.ints);
    case Op::Conv2dBackwardData: return geometry(n.shape, b, a, n.ints);
    case Op::Conv2dBackwardWeight: return geometry(a, n.shape, b, n.ints);
    default: KILN_FAIL("conv2d", "{} is not a convolution", op_name(n.op));
  }
}

}  // namespace kiln::prim
