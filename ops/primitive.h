// Constructors of primitive nodes, with the shape/dtype rules of each primitive. The user-facing
// API (ops/ops.h) broadcasts and promotes first, then calls these; grad rules call them too.
#pragma once
#include "core/tensor.h"
#include "ops/conv_geometry.h"

namespace kiln::prim {

// The operands of one recorded op, held in a recycled block (core/block_cache.h): no malloc per op.
using TensorInputs = std::vector<Tensor, ShortArrayAllocator<Tensor>>;

// Records `op` over `inputs`; marks requires_grad and realizes at once in eager mode.
Tensor make(Op op, DType dtype, Shape shape, TensorInputs inputs, std::vector<int64_t> ints = {});
// As make, without the eager realize, for nodes whose attributes are set after recording;
// finish() then realizes in eager mode.
Tensor record(Op op, DType dtype, Shape shape, TensorInputs inputs, std::vector<int64_t> ints = {});
Tensor finish(Tensor t);

Tensor full(Shape shape, double value, DType dtype);
Tensor iota(Shape shape, int64_t axis, DType dtype);
// `t` on `device`: recorded again there when it is computed from generators alone (full, iota,
// rand: no data to copy), else copied with to(). Composites and record() use it so that the
// constants they make follow the device of the tensors they meet.
Tensor follow(const Tensor& t, Device device);
Tensor rand(Op op, Shape shape, DType dtype);  // RandUniform or RandNormal

Tensor unary(Op op, const Tensor& a);
Tensor cast(const Tensor& a, DType dtype);
Tensor binary(Op op, const Tensor& a, const Tensor& b);  // same shape and dtype
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);

Tensor reshape(const Tensor& a, const Shape& shape);                // same numel
Tensor permute(const Tensor& a, const std::vector<int64_t>& perm);  // a permutation of 0..rank-1
Tensor expand(const Tensor& a, const Shape& shape);                 // same rank; 1 -> n only
// Per axis: start and step; the result's extents are `shape`.
Tensor slice(const Tensor& a, const std::vector<int64_t>& starts, const std::vector<int64_t>& steps,
             const Shape& shape);
Tensor pad(const Tensor& a, const std::vector<int64_t>& before, const std::vector<int64_t>& after);

// Reduces `axes` (sorted, unique) keeping them as size-1 dims.
Tensor reduce(Op op, const Tensor& a, std::vector<int64_t> axes);

Tensor gather(const Tensor& a, int64_t axis, const Tensor& index);
Tensor scatter_add(const Shape& shape, int64_t axis, const Tensor& index, const Tensor& src);

// (B, M, K) @ (B, K, N) -> (B, M, N)
Tensor matmul(const Tensor& a, const Tensor& b);
// The element-wise sum (op 0) or maximum (op 2) of `x` over the `world` processes of the
// communicator, recorded as a node the executor runs as a collective (jit/collective.h).
// Its gradient: by default each rank's loss is its own (data parallel), so the gradient is the
// all-reduced output gradient; `replicated` says every rank computes the same loss from the
// result (tensor parallel), so the output gradient passes through unchanged. `group`: the ranks
// it runs among (distributed::Group::id(); 0: the world), `world` of them.
Tensor all_reduce(const Tensor& x, int64_t op, int64_t world, bool replicated = false, int64_t group = 0);
// The identity whose gradient is summed over the `world` ranks: a value every rank holds alike,
// read by per-rank computations (the input of a column-parallel layer). A view: no kernel runs.
Tensor all_reduce_gradient(const Tensor& x, int64_t world, int64_t group = 0);
// One all-reduce of several tensors of one dtype (a data-parallel bucket): the result is their
// values flattened and laid end to end, reduced. The executor packs the parts into the result's
// buffer itself, so no concatenation kernel runs.
Tensor all_reduce(const std::vector<Tensor>& parts, int64_t op, int64_t world, int64_t group = 0);
// Point to point inside a plan (on a device, through host memory): send starts a non-blocking send of x's values to
// rank `to` where the plan computes it and returns a one-element token to realize (the executor
// keeps a copy of the values until the message is received); recv is a node with no input whose
// value arrives from rank `from`, waited for before its first reader. `tag` pairs the two.
Tensor send(const Tensor& x, int64_t to, int64_t tag);
Tensor recv(const Shape& shape, DType dtype, int64_t from, int64_t tag, Device device = Device::cpu());

// a @ b summed in int32, as float32: a (M, K) int8, b (K, N) int8 -> (M, N). Host only; no
// gradient (an Error).
Tensor quantized_matmul(const Tensor& a, const Tensor& b);
// b (K, N) int8 on the host, laid out once in the blocked layout this CPU's int8 matmul reads
// (oneDNN's choice): a uint8 byte array for quantized_matmul_packed, which then skips repacking b
// on every call (3-5x faster at small batches). Undefined when that layout is the plain one. Not
// portable between CPUs: save b, pack after loading.
Tensor pack_quantized_weight(const Tensor& b);
Tensor quantized_matmul_packed(const Tensor& a, const Tensor& packed, int64_t N);

// Fused attention: softmax(scale q kᵀ [causal]) v over q (B, H, Tq, D), k (B, H, Tk, D),
// v (B, H, Tk, Dv), float32 or float64, in one kernel that keeps no (Tq, Tk) matrix. `causal`:
// key j is hidden from query i when j > i + (Tk - Tq). The node's value is one flat buffer: the
// output laid out (B, Tq, H, Dv), then the log-sum-exp of each row of scores (B, H, Tq) that its
// backward reads; attention_output views the first region as (B, H, Tq, Dv).
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale);
Tensor attention_output(const Tensor& packed, const Shape& q_shape, int64_t dv);
// dq, dk and dv of an attention node `packed` from its output gradient `dout` (B, H, Tq, Dv): one
// flat buffer of dq (B, Tq, H, D), dk (B, Tk, H, D) and dv (B, Tk, H, Dv) laid end to end. Its
// inputs are q, k, v, packed and dout.
Tensor attention_backward(const Tensor& packed, const Tensor& dout);
// The sizes of an Attention or AttentionBackward node, and where its regions start.
struct AttentionShape {
  int64_t B, H, Tq, Tk, D, Dv;
  bool causal;
  double scale;
  int64_t out_elements() const { return B * Tq * H * Dv; }           // Attention: o, then lse
  int64_t lse_elements() const { return B * H * Tq; }
  int64_t dq_elements() const { return B * Tq * H * D; }             // AttentionBackward: dq, dk, dv
  int64_t dk_elements() const { return B * Tk * H * D; }
  int64_t dv_elements() const { return B * Tk * H * Dv; }
};
AttentionShape attention_shape(const Node& node);

// 2-D convolution and its two adjoints over contiguous NCHW data, weight (OC, C / groups, KH, KW).
// conv = {stride h, w, padding h, w, dilation h, w, groups}; shapes are checked by the caller
// (kiln::conv2d) and again here.
Tensor conv2d(const Tensor& x, const Tensor& weight, const std::vector<int64_t>& conv);
Tensor conv2d_backward_data(const Tensor& grad_y, const Tensor& weight, const Shape& x_shape,
                            const std::vector<int64_t>& conv);
Tensor conv2d_backward_weight(const Tensor& x, const Tensor& grad_y, const Shape& weight_shape,
                              const std::vector<int64_t>& conv);
// The shape of conv2d(x, weight) after checking that shapes and attributes agree.
Shape conv2d_output_shape(const Shape& x, const Shape& weight, const std::vector<int64_t>& conv);
// The node under any reshapes and expands of n: a Full there is a constant broadcast to n's shape
// (lazily recorded constants are Fulls of the result's shape; eager mode realizes the Full first and
// broadcasts it through a reshape and an expand).
const Node* constant_source(const Node& n);
// The geometry of a Conv2d / Conv2dBackwardData / Conv2dBackwardWeight node.
ConvGeometry conv_geometry(const Node& node);

// For max pooling of (N, C, H, W) x over (kh, kw) windows that tile it (stride = kernel, no
// padding): the offset a * W + b of each window's first maximum in row-major order (a NaN counts
// as one), as `offset_t` (Int8 or Int32, wide enough for (kh - 1) * W + kw - 1). (N, C, H / kh,
// W / kw); no gradient. A library kernel on the host (backends/cpu/pool_cpu.h).
Tensor max_pool_offsets(const Tensor& x, int64_t kh, int64_t kw, DType offset_t);
// The window element of x at each of those offsets: max pooling's output, computed on the host
// with the same windows. Its gradient scatters to the offsets.
Tensor max_pool_gather(const Tensor& x, const Tensor& offsets, int64_t kh, int64_t kw);
// max_pool_gather's gradient: each window of the (N, C, OH * kh, OW * kw) result holds g's value at
// its offset and zeros elsewhere.
Tensor max_pool_scatter(const Tensor& g, const Tensor& offsets, int64_t kh, int64_t kw);

}  // namespace kiln::prim
