// Movement ops of the user API. All are views: the JIT folds them into index expressions.
#include <algorithm>
#include <numeric>

#include "ops/ops.h"
#include "ops/primitive.h"

namespace kiln {

Tensor reshape(const Tensor& a, Shape shape) {
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      KILN_CHECK(infer < 0, "reshape", "only one -1 allowed in {}", shape_str(shape));
      infer = static_cast<int>(i);
    } else {
      KILN_CHECK(shape[i] >= 0, "reshape", "negative size in {}", shape_str(shape));
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    KILN_CHECK(known > 0 && a.numel() % known == 0, "reshape", "cannot reshape {} ({} elements) to {}",
               shape_str(a.shape()), a.numel(), shape_str(shape));
    shape[infer] = a.numel() / known;
  }
  return prim::reshape(a, shape);
}

Tensor permute(const Tensor& a, std::vector<int64_t> perm) {
  for (auto& p : perm) p = normalize_axis(p, a.dim(), "permute");
  return prim::permute(a, perm);
}

Tensor transpose(const Tensor& a, int64_t axis0, int64_t axis1) {
  std::vector<int64_t> perm(a.dim());
  std::iota(perm.begin(), perm.end(), 0);
  std::swap(perm[normalize_axis(axis0, a.dim(), "transpose")], perm[normalize_axis(axis1, a.dim(), "transpose")]);
  return prim::permute(a, perm);
}

Tensor expand(const Tensor& a, Shape shape) {
  KILN_CHECK(shape.size() >= a.dim(), "expand", "cannot expand {} to fewer dims {}", shape_str(a.shape()),
             shape_str(shape));
  size_t lead = shape.size() - a.dim();
  Shape padded(lead, 1);
  padded.insert(padded.end(), a.shape().begin(), a.shape().end());
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] == -1) shape[i] = padded[i];
  return prim::expand(prim::reshape(a, padded), shape);
}

Tensor broadcast_to(const Tensor& a, Shape shape) {
  if (a.shape() == shape) return a;
  broadcast_shapes(a.shape(), shape, "broadcast_to");
  const NodePtr& n = a.node();
  if (n->op == Op::Full && !n->realized() && !n->requires_grad && numel(a.shape()) == 1)
    return full(std::move(shape), n->scalar, n->dtype);  // a constant of the wanted shape: one node, not three
  return expand(a, std::move(shape));
}

Tensor slice(const Tensor& a, int64_t axis, int64_t start, int64_t stop, int64_t step) {
  int ax = normalize_axis(axis, a.dim(), "slice");
  int64_t n = a.shape()[ax];
  KILN_CHECK(step > 0, "slice", "step must be positive, got {}", step);
  if (start < 0) start += n;
  if (stop < 0) stop += n;
  start = std::clamp<int64_t>(start, 0, n);
  stop = std::clamp<int64_t>(stop, start, n);
  std::vector<int64_t> starts(a.dim(), 0), steps(a.dim(), 1);
  starts[ax] = start;
  steps[ax] = step;
  Shape shape = a.shape();
  shape[ax] = (stop - start + step - 1) / step;
  if (shape == a.shape()) return a;
  return prim::slice(a, starts, steps, shape);
}

namespace {
// For a reflect or replicate pad of one axis of `extent` elements: the source index of each
// output position (a negative pad starts or stops inside the axis).
std::vector<int64_t> edge_sources(int64_t extent, int64_t before, int64_t after, PadMode mode) {
  std::vector<int64_t> sources;
  for (int64_t i = -before; i < extent + after; ++i) {
    int64_t j = i;
    if (mode == PadMode::Reflect) j = j < 0 ? -j : j >= extent ? 2 * (extent - 1) - j : j;
    else j = std::clamp<int64_t>(j, 0, extent - 1);
    sources.push_back(j);
  }
  return sources;
}
}  // namespace

Tensor pad(const Tensor& a, std::vector<std::pair<int64_t, int64_t>> pads, PadMode mode, double value) {
  KILN_CHECK(pads.size() <= a.dim(), "pad", "{} padding pairs for a tensor of rank {}", pads.size(), a.dim());
  KILN_CHECK(mode == PadMode::Constant || value == 0, "pad", "a fill value ({}) applies to PadMode::Constant only",
             value);
  std::vector<int64_t> before(a.dim(), 0), after(a.dim(), 0);
  for (size_t i = 0; i < pads.size(); ++i) std::tie(before[i], after[i]) = pads[i];
  for (size_t i = 0; i < a.dim(); ++i) {
    const int64_t n = a.shape()[i];
    KILN_CHECK(n + before[i] + after[i] >= 0 && n + std::min<int64_t>(before[i], 0) >= 0 &&
                   n + std::min<int64_t>(after[i], 0) >= 0,
               "pad", "padding ({}, {}) on axis {} of {} crops more than the axis's {} elements", before[i], after[i], i,
               shape_str(a.shape()), n);
    if (mode == PadMode::Reflect)
      KILN_CHECK(before[i] < n && after[i] < n, "pad",
                 "reflect padding ({}, {}) on axis {} of {} must be smaller than the axis ({}); use "
                 "PadMode::Replicate or pad in steps",
                 before[i], after[i], i, shape_str(a.shape()), n);
    if (mode == PadMode::Replicate)
      KILN_CHECK(n > 0 || (before[i] <= 0 && after[i] <= 0), "pad",
                 "replicate padding of empty axis {} of {}: there is no edge to repeat", i, shape_str(a.shape()));
  }
  Tensor x = a;
  if (mode != PadMode::Constant) {
    // Each padded axis as a gather of source positions: its gradient sums what the edges lent.
    for (size_t i = 0; i < a.dim(); ++i) {
      if (before[i] == 0 && after[i] == 0) continue;
      const std::vector<int64_t> sources = edge_sources(a.shape()[i], before[i], after[i], mode);
      const int64_t count = static_cast<int64_t>(sources.size());
      x = index_select(x, static_cast<int64_t>(i), from_vector<int64_t>(sources, {count}).to(a.device()));
    }
    return x;
  }
  // Negative pads crop first (a view); the rest pads with zeros, and a mask of where the input
  // landed places a non-zero fill.
  std::vector<int64_t> grow_before(a.dim()), grow_after(a.dim());
  for (size_t i = 0; i < a.dim(); ++i) {
    const int64_t start = std::max<int64_t>(-before[i], 0), stop = a.shape()[i] - std::max<int64_t>(-after[i], 0);
    if (start != 0 || stop != a.shape()[i]) x = slice(x, static_cast<int64_t>(i), start, stop);
    grow_before[i] = std::max<int64_t>(before[i], 0);
    grow_after[i] = std::max<int64_t>(after[i], 0);
  }
  const bool grows = std::any_of(grow_before.begin(), grow_before.end(), [](int64_t p) { return p > 0; }) ||
                     std::any_of(grow_after.begin(), grow_after.end(), [](int64_t p) { return p > 0; });
  if (!grows) return x;
  Tensor padded = prim::pad(x, grow_before, grow_after);
  if (value == 0) return padded;
  Tensor inside = prim::pad(prim::follow(ones(x.shape(), DType::Bool), a.device()), grow_before, grow_after);
  return where(inside, padded, scalar(value, a.dtype()));
}

Tensor pad(const Tensor& a, std::vector<std::pair<int64_t, int64_t>> pads, double value) {
  return pad(a, std::move(pads), PadMode::Constant, value);
}

Tensor concat(const std::vector<Tensor>& tensors, int64_t axis) {
  KILN_CHECK(!tensors.empty(), "concat", "needs at least one tensor");
  const Tensor& first = tensors[0];
  int ax = normalize_axis(axis, first.dim(), "concat");
  int64_t total = 0;
  DType dtype = first.dtype();
  for (const Tensor& t : tensors) {
    KILN_CHECK(t.dim() == first.dim(), "concat", "rank mismatch: {} vs {}", shape_str(first.shape()), shape_str(t.shape()));
    for (size_t d = 0; d < t.dim(); ++d)
      KILN_CHECK(static_cast<int>(d) == ax || t.shape()[d] == first.shape()[d], "concat",
                 "shapes {} and {} differ outside axis {}", shape_str(first.shape()), shape_str(t.shape()), ax);
    total += t.shape()[ax];
    dtype = promote(dtype, t.dtype());
  }
  // A sum of zero-padded pieces: it fuses into one kernel and its gradient is a slice per piece.
  Tensor out;
  int64_t offset = 0;
  for (const Tensor& t : tensors) {
    std::vector<int64_t> before(t.dim(), 0), after(t.dim(), 0);
    before[ax] = offset;
    after[ax] = total - offset - t.shape()[ax];
    offset += t.shape()[ax];
    Tensor piece = prim::pad(cast(t, dtype), before, after);
    out = out.defined() ? prim::binary(Op::Add, out, piece) : piece;
  }
  return out;
}

std::vector<Tensor> split(const Tensor& a, int64_t size, int64_t axis) {
  const int ax = normalize_axis(axis, a.dim(), "split");
  KILN_CHECK(size > 0, "split", "piece size must be positive, got {} (tensor {})", size, a.str());
  std::vector<Tensor> pieces;
  const int64_t extent = a.shape()[ax];
  for (int64_t start = 0; start < extent; start += size) pieces.push_back(slice(a, ax, start, std::min(extent, start + size)));
  if (pieces.empty()) pieces.push_back(a);  // an empty axis: one empty piece, as torch.split
  return pieces;
}

std::vector<Tensor> chunk(const Tensor& a, int64_t chunks, int64_t axis) {
  const int ax = normalize_axis(axis, a.dim(), "chunk");
  KILN_CHECK(chunks > 0, "chunk", "number of chunks must be positive, got {} (tensor {})", chunks, a.str());
  const int64_t extent = a.shape()[ax];
  return split(a, std::max<int64_t>(1, (extent + chunks - 1) / chunks), ax);
}

Tensor unsqueeze(const Tensor& a, int64_t axis) {
  int ax = normalize_axis(axis, a.dim() + 1, "unsqueeze");
  Shape s = a.shape();
  s.insert(s.begin() + ax, 1);
  return prim::reshape(a, s);
}

Tensor squeeze(const Tensor& a, int64_t axis) {
  int ax = normalize_axis(axis, a.dim(), "squeeze");
  if (a.shape()[ax] != 1) return a;
  Shape s = a.shape();
  s.erase(s.begin() + ax);
  return prim::reshape(a, s);
}

Tensor flatten(const Tensor& a, int64_t start, int64_t end) {
  if (a.dim() == 0) return reshape(a, {1});
  int s = normalize_axis(start, a.dim(), "flatten"), e = normalize_axis(end, a.dim(), "flatten");
  KILN_CHECK(s <= e, "flatten", "start axis {} after end axis {}", start, end);
  Shape out(a.shape().begin(), a.shape().begin() + s);
  int64_t merged = 1;
  for (int i = s; i <= e; ++i) merged *= a.shape()[i];
  out.push_back(merged);
  out.insert(out.end(), a.shape().begin() + e + 1, a.shape().end());
  return prim::reshape(a, out);
}

}  // namespace kiln
