// Tensor parallel: split/gather/reduce as lazy graph nodes with their gradients, and the column-
// and row-parallel Linear layers built on them. See tensor_parallel.h.
#include "distributed/tensor_parallel.h"

#include "core/error.h"
#include "distributed/communicator.h"
#include "ops/ops.h"
#include "ops/primitive.h"

namespace kiln::distributed {

namespace {

int64_t axis_of(const Tensor& t, int64_t dim, const char* name) {
  const int64_t rank = static_cast<int64_t>(t.dim());
  KILN_CHECK(dim >= -rank && dim < rank, name, "dim {} is out of range for {}", dim, t.str());
  return dim < 0 ? dim + rank : dim;
}

void require_member(const Group& group, const char* name) {
  init();
  group.require_me(name);
}

// The size of the group a tensor-parallel op runs in, after checking that its tensor can take part.
int64_t parallel_world(const Tensor& t, const char* name, const Group& group) {
  require_member(group, name);
  const int64_t world = group.size();
  KILN_CHECK(is_floating(t.dtype()), name, "tensor parallel needs a floating-point tensor; got {}", t.str());
  return world;
}

bool is_half(DType d) { return d == DType::Float16 || d == DType::BFloat16; }

// Rows or columns [r * n / world, (r + 1) * n / world) of a dense parameter, as a fresh
// parameter of this rank's own.
Tensor block_of(const Tensor& dense, int64_t axis, const Group& group) {
  const int64_t n = dense.size(axis) / group.size(), r = group.rank();
  return dense.detach().slice(axis, r * n, (r + 1) * n).realize();
}

void check_divides(int64_t features, int64_t world, const char* layer, const char* which) {
  KILN_CHECK(features % world == 0, layer,
             "{} = {} does not divide by the world of {} ranks; choose a width that is a multiple of {}", which,
             features, world, world);
}

}  // namespace

Tensor reduce_from_ranks(const Tensor& t, const Group& group) {
  const int64_t world = parallel_world(t, "distributed::reduce_from_ranks", group);
  if (world == 1) return t;
  if (is_half(t.dtype()))
    return cast(prim::all_reduce(cast(t, DType::Float32), 0, world, true, group.id()), t.dtype());
  return prim::all_reduce(t, 0, world, true, group.id());
}

Tensor copy_to_ranks(const Tensor& t, const Group& group) {
  const int64_t world = parallel_world(t, "distributed::copy_to_ranks", group);
  return world == 1 ? t : prim::all_reduce_gradient(t, world, group.id());
}

Tensor split(const Tensor& t, int64_t dim, const Group& group) {
  const char* name = "distributed::split";
  const int64_t world = parallel_world(t, name, group), axis = axis_of(t, dim, name);
  KILN_CHECK(t.size(axis) % world == 0, name, "{} has {} elements along dim {}, which do not divide by the world of {} ranks",
             t.str(), t.size(axis), axis, world);
  if (world == 1) return t;
  const int64_t n = t.size(axis) / world, r = group.rank();
  // The slice's gradient is zero outside this rank's block, so summing it over the ranks (the
  // copy's gradient) lays the blocks' gradients end to end: a gather.
  return copy_to_ranks(t, group).slice(axis, r * n, (r + 1) * n);
}

Tensor gather(const Tensor& t, int64_t dim, const Group& group) {
  const char* name = "distributed::gather";
  const int64_t world = parallel_world(t, name, group), axis = axis_of(t, dim, name);
  if (world == 1) return t;
  const int64_t n = t.size(axis), r = group.rank();
  std::vector<std::pair<int64_t, int64_t>> pads(t.dim(), {0, 0});
  pads[axis] = {r * n, (world - 1 - r) * n};
  // Every rank's block sits at its own offset and zeros elsewhere, so the sum is the
  // concatenation; the pad's gradient (a slice) hands each rank its block back.
  return reduce_from_ranks(pad(t, pads), group);
}

ColumnParallelLinear::ColumnParallelLinear(const nn::LinearOptions& o, bool gather_output, Group group)
    : Module("ColumnParallelLinear"), options_(o), gather_output_(gather_output), group_(std::move(group)) {
  require_member(group_, "ColumnParallelLinear");
  const int64_t world = group_.size();
  check_divides(o.out_features(), world, "ColumnParallelLinear", "out_features");
  nn::Linear dense(o);  // draws what the dense layer would, so the same seed gives its weight
  weight = register_parameter("weight", block_of(dense.weight, 0, group_));
  if (o.bias()) bias = register_parameter("bias", block_of(dense.bias, 0, group_));
  set_extra_repr(fmt::format("in={}, out={} (this rank: {}), bias={}, gather_output={}", o.in_features(),
                             o.out_features(), o.out_features() / world, o.bias(), gather_output));
}

Tensor ColumnParallelLinear::forward(const Tensor& x) {
  KILN_CHECK(x.dim() >= 1 && x.shape().back() == options_.in_features(), "ColumnParallelLinear",
             "input {} does not end in in_features={}", shape_str(x.shape()), options_.in_features());
  Tensor y = linear(copy_to_ranks(x, group_), weight, bias);
  return gather_output_ ? gather(y, -1, group_) : y;
}

RowParallelLinear::RowParallelLinear(const nn::LinearOptions& o, bool input_is_parallel, Group group)
    : Module("RowParallelLinear"), options_(o), input_is_parallel_(input_is_parallel), group_(std::move(group)) {
  require_member(group_, "RowParallelLinear");
  const int64_t world = group_.size();
  check_divides(o.in_features(), world, "RowParallelLinear", "in_features");
  nn::Linear dense(o);
  weight = register_parameter("weight", block_of(dense.weight, 1, group_));
  if (o.bias()) bias = register_parameter("bias", dense.bias.detach());
  set_extra_repr(fmt::format("in={} (this rank: {}), out={}, bias={}, input_is_parallel={}", o.in_features(),
                             o.in_features() / world, o.out_features(), o.bias(), input_is_parallel));
}

Tensor RowParallelLinear::forward(const Tensor& x) {
  const int64_t world = group_.size(), in = options_.in_features();
  const int64_t expected = input_is_parallel_ ? in / world : in;
  KILN_CHECK(x.dim() >= 1 && x.shape().back() == expected, "RowParallelLinear",
             "input {} does not end in {} ({}in_features={} over {} ranks)", shape_str(x.shape()), expected,
             input_is_parallel_ ? "this rank's block of " : "", in, world);
  const Tensor local = input_is_parallel_ ? x : split(x, -1, group_);
  // The bias is added once, after the sum, so that it is not counted once per rank.
  Tensor y = reduce_from_ranks(linear(local, weight), group_);
  return bias.defined() ? y + bias : y;
}

}  // namespace kiln::distributed
