// Reindexing of the user API: gather, scatter_add, index_select, embedding, one_hot.
#include "ops/ops.h"
#include "ops/primitive.h"

namespace kiln {

Tensor gather(const Tensor& a, int64_t axis, const Tensor& index) {
  int ax = normalize_axis(axis, a.dim(), "gather");
  return prim::gather(a, ax, index);
}

Tensor scatter_add(Shape shape, int64_t axis, const Tensor& index, const Tensor& src) {
  int ax = normalize_axis(axis, shape.size(), "scatter_add");
  return prim::scatter_add(shape, ax, index, src);
}

Tensor index_select(const Tensor& a, int64_t axis, const Tensor& index) {
  int ax = normalize_axis(axis, a.dim(), "index_select");
  KILN_CHECK(index.dim() == 1, "index_select", "index must be 1-d, got {}", shape_str(index.shape()));
  // Gather with the index broadcast along every other axis (a view, no copy).
  Shape idx_shape(a.dim(), 1);
  idx_shape[ax] = index.numel();
  Shape out_shape = a.shape();
  out_shape[ax] = index.numel();
  return prim::gather(a, ax, expand(reshape(index, idx_shape), out_shape));
}

Tensor embedding(const Tensor& indices, const Tensor& weight) {
  KILN_CHECK(weight.dim() == 2, "embedding", "weight must be a table (V, D), got {}", shape_str(weight.shape()));
  KILN_CHECK(is_integral(indices.dtype()) && indices.dtype() != DType::Bool, "embedding",
             "indices {} must be integers (int32 or int64), got {}", shape_str(indices.shape()),
             dtype_name(indices.dtype()));
  Shape out_shape = indices.shape();
  out_shape.push_back(weight.size(1));
  return reshape(index_select(weight, 0, reshape(indices, {indices.numel()})), out_shape);  // (..., D)
}

Tensor one_hot(const Tensor& labels, int64_t classes, DType dtype) {
  Shape s = labels.shape();
  s.push_back(classes);
  Tensor l = unsqueeze(cast(labels, DType::Int64), -1);
  return cast(eq(broadcast_to(l, s), iota(s, -1, DType::Int64)), dtype);
}

}  // namespace kiln
