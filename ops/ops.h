// The op API users call. Each function records a node (or a small composite of nodes) and
// returns immediately; shapes and dtypes are checked here, so mistakes throw kiln::Error at the
// line that made them, not later inside the JIT.
//
//   Tensor x = kiln::randn({32, 10});
//   Tensor y = kiln::softmax(x * 2.0 + 1.0, -1).sum({1});
#pragma once
#include <array>
#include <functional>
#include <utility>
#include <vector>

#include "core/options.h"
#include "core/tensor.h"
#include "ops/loss.h"  // cross_entropy, mse_loss, ... and their options

namespace kiln {

// ---- creation ----
Tensor full(Shape shape, double value, DType dtype = DType::Float32);
Tensor zeros(Shape shape, DType dtype = DType::Float32);
Tensor ones(Shape shape, DType dtype = DType::Float32);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor scalar(double value, DType dtype = DType::Float32);  // a 0-d tensor
// Index along `axis` at every position of `shape`: iota({2,3}, 1) = [[0,1,2],[0,1,2]].
Tensor iota(Shape shape, int64_t axis = 0, DType dtype = DType::Int64);
Tensor arange(int64_t n, DType dtype = DType::Int64);
// Counter-based (Philox) random numbers: the global seed (flags().seed, kiln::manual_seed) and a
// running offset make every call distinct and every run with the same seed identical.
Tensor rand(Shape shape, DType dtype = DType::Float32);   // uniform [0, 1)
Tensor randn(Shape shape, DType dtype = DType::Float32);  // standard normal
// `samples` indices drawn with replacement from each row of probs (V) or (R, V), each index with
// probability proportional to its weight (non-negative, finite, a positive sum per row):
// int64 (samples) or (R, samples). Uses the seeded generator (manual_seed), drawn on the host.
Tensor multinomial(const Tensor& probs, int64_t samples = 1);
void manual_seed(uint64_t seed);
// The Philox key {seed, counter base} of a draw of `count` values made now, as rand() records it;
// advances the generator. For code that draws again without recording (a replayed step).
std::pair<uint64_t, uint64_t> random_key(int64_t count);
// Copies host data into a new realized tensor.
template <typename T> Tensor from_vector(const std::vector<T>& values, Shape shape);
// A new realized tensor whose numel(shape) * dtype_size(dtype) bytes `write` fills in host memory,
// called once, also when there are none: data gathered straight into the
// tensor, with no copy in between (the DataLoader's batches). With KILN_USE_CUDA the tensor is
// then copied to cuda:0, as from_vector's is.
Tensor written_on_host(DType dtype, Shape shape, const std::function<void(void* bytes)>& write);
// A realized copy of t on `device` (t itself when it is there); see Tensor::to.
Tensor to_device(const Tensor& t, Device device);
Tensor from_doubles(const std::vector<double>& values, Shape shape, DType dtype);

// ---- elementwise ----
Tensor neg(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
Tensor sqrt(const Tensor& a);
Tensor rsqrt(const Tensor& a);
Tensor sin(const Tensor& a);
Tensor cos(const Tensor& a);
Tensor tanh(const Tensor& a);
Tensor erf(const Tensor& a);
Tensor abs(const Tensor& a);
Tensor reciprocal(const Tensor& a);
Tensor sign(const Tensor& a);
Tensor floor(const Tensor& a);
Tensor logical_not(const Tensor& a);
Tensor cast(const Tensor& a, DType dtype);

Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, double exponent);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor logical_and(const Tensor& a, const Tensor& b);
Tensor logical_or(const Tensor& a, const Tensor& b);
// a where cond is true, b elsewhere (all three broadcast together). A non-bool cond counts as
// true where it is nonzero (NaN is nonzero), as in NumPy (torch.where asks for a bool cond).
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
// `value` where the bool mask (broadcast to a's shape) is true, a elsewhere.
Tensor masked_fill(const Tensor& a, const Tensor& mask, double value);
// The lower (tril) or upper (triu) triangle of the last two dims, the rest zero: element (i, j)
// is kept when j - i <= diagonal (tril) or j - i >= diagonal (triu), as in PyTorch.
Tensor tril(const Tensor& a, int64_t diagonal = 0);
Tensor triu(const Tensor& a, int64_t diagonal = 0);
Tensor clamp(const Tensor& a, double lo, double hi);

// A plain number as an operand takes the tensor's dtype (float32 if the tensor is integral and
// the number is not).
Tensor scalar_like(double value, const Tensor& like);
Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator+(double a, const Tensor& b);
Tensor operator-(double a, const Tensor& b);
Tensor operator*(double a, const Tensor& b);
Tensor operator/(double a, const Tensor& b);
// Comparisons give Bool tensors, as lt/le/gt/ge/eq/ne; no gradient flows back through them.
Tensor operator<(const Tensor& a, const Tensor& b);
Tensor operator>(const Tensor& a, const Tensor& b);
Tensor operator<=(const Tensor& a, const Tensor& b);
Tensor operator>=(const Tensor& a, const Tensor& b);
Tensor operator==(const Tensor& a, const Tensor& b);
Tensor operator!=(const Tensor& a, const Tensor& b);

// ---- movement (views) ----
Tensor reshape(const Tensor& a, Shape shape);  // one -1 allowed
Tensor permute(const Tensor& a, std::vector<int64_t> perm);
Tensor transpose(const Tensor& a, int64_t axis0, int64_t axis1);
Tensor expand(const Tensor& a, Shape shape);  // NumPy broadcasting of a to shape
Tensor broadcast_to(const Tensor& a, Shape shape);
Tensor slice(const Tensor& a, int64_t axis, int64_t start, int64_t stop, int64_t step = 1);
// pads[i] = {before, after} for axis i (missing trailing axes: no padding), as in PyTorch's
// modes: Constant fills with `value`; Reflect mirrors without repeating the edge (pad < extent);
// Replicate repeats the edge (extent > 0). A negative pad removes that many elements (a crop).
//   pad(x, {{0, 0}, {2, 2}}, PadMode::Reflect);   // (N, L) -> (N, L + 4)
//   pad(x, {{1, -1}}, 0.5);                       // shifted down one row, 0.5 in the new first
enum class PadMode { Constant, Reflect, Replicate };
Tensor pad(const Tensor& a, std::vector<std::pair<int64_t, int64_t>> pads, PadMode mode = PadMode::Constant,
           double value = 0.0);
Tensor pad(const Tensor& a, std::vector<std::pair<int64_t, int64_t>> pads, double value);
Tensor concat(const std::vector<Tensor>& tensors, int64_t axis = 0);
// Pieces of `size` along axis (the last one shorter when size does not divide it), as
// torch.split; chunk: `chunks` pieces of ceil(extent / chunks) (fewer when that covers it).
// Views: no data moves.
std::vector<Tensor> split(const Tensor& a, int64_t size, int64_t axis = 0);
std::vector<Tensor> chunk(const Tensor& a, int64_t chunks, int64_t axis = 0);
Tensor unsqueeze(const Tensor& a, int64_t axis);
Tensor squeeze(const Tensor& a, int64_t axis);
Tensor flatten(const Tensor& a, int64_t start = 0, int64_t end = -1);

// ---- reductions (empty axes = all) ----
Tensor sum(const Tensor& a, std::vector<int64_t> axes = {}, bool keepdim = false);
// max/min of the values (no indices); amax/amin are the same ops under PyTorch's other names.
// A gradient is shared evenly between tied extremes.
Tensor max(const Tensor& a, std::vector<int64_t> axes = {}, bool keepdim = false);
Tensor min(const Tensor& a, std::vector<int64_t> axes = {}, bool keepdim = false);
Tensor amax(const Tensor& a, std::vector<int64_t> axes = {}, bool keepdim = false);
Tensor amin(const Tensor& a, std::vector<int64_t> axes = {}, bool keepdim = false);
Tensor mean(const Tensor& a, std::vector<int64_t> axes = {}, bool keepdim = false);
// Variance and standard deviation: the sum of squared deviations over n - correction (n: the
// number of elements reduced; PyTorch's correction, 1 by default there and here). The bool form
// is the older spelling: unbiased = correction 1, biased (its default) = correction 0.
//   var(x, {1}, VarianceOptions().correction(0).keepdim(true));
class VarianceOptions {
  KILN_OPTION(int64_t, correction, 1)  // >= 0; n - correction <= 0 gives inf or NaN, as in PyTorch
  KILN_OPTION(bool, keepdim, false)
};
Tensor var(const Tensor& a, std::vector<int64_t> axes, const VarianceOptions& options);
Tensor var(const Tensor& a, std::vector<int64_t> axes = {}, bool keepdim = false, bool unbiased = false);
Tensor std(const Tensor& a, std::vector<int64_t> axes, const VarianceOptions& options);
Tensor std(const Tensor& a, std::vector<int64_t> axes = {}, bool keepdim = false, bool unbiased = false);
Tensor argmax(const Tensor& a, int64_t axis, bool keepdim = false);  // int64, first maximum

// ---- indexing ----
// out[..i..] = a[.. index[..i..] ..] along axis (torch.gather): index has a's rank.
Tensor gather(const Tensor& a, int64_t axis, const Tensor& index);
// out = zeros(shape); out[.. index[..i..] ..] += src[..i..] along axis (adjoint of gather).
Tensor scatter_add(Shape shape, int64_t axis, const Tensor& index, const Tensor& src);
// Rows of a along axis picked by a 1-d index (embedding lookup).
Tensor index_select(const Tensor& a, int64_t axis, const Tensor& index);
// Rows of weight (V, D) picked by integer indices of any shape (...) -> (..., D): nn::Embedding's
// forward (torch.nn.functional.embedding without max_norm or padding_idx).
Tensor embedding(const Tensor& indices, const Tensor& weight);
Tensor one_hot(const Tensor& labels, int64_t classes, DType dtype = DType::Float32);

// ---- linear algebra ----
// Batched, broadcasting matmul as in NumPy: (..., M, K) @ (..., K, N); 1-d operands allowed.
Tensor matmul(const Tensor& a, const Tensor& b);
// x @ weight^T + bias, weight (out_features, in_features), bias (out_features) or undefined.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = {});

// ---- convolution ----
// 2-D convolution (cross-correlation, as in PyTorch) of x (N, C, H, W) or (C, H, W) with weight
// (OC, C / groups, KH, KW), plus bias (OC) when defined: (N, OC, OH, OW) with
// OH = (H + 2 * padding - dilation * (KH - 1) - 1) / stride + 1. float32 and bfloat16 run on
// oneDNN; other float dtypes as unfold + matmul (what the float64 gradient checks exercise).
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = {}, std::array<int64_t, 2> stride = {1, 1},
              std::array<int64_t, 2> padding = {0, 0}, std::array<int64_t, 2> dilation = {1, 1}, int64_t groups = 1);

// softmax(scale q kᵀ [causal]) v in one kernel (flash attention: tiles of keys, online softmax;
// the backward recomputes the scores), so no (Tq, Tk) matrix is kept for the backward: q
// (B, H, Tq, D), k (B, H, Tk, D), v (B, H, Tk, Dv) -> (B, H, Tq, Dv), views of any strides.
// float32, float64 or bfloat16 (read as is, computed in float32; the output is float32), other
// mixes are cast to float32 first. `causal`: query i sees keys j <= i + (Tk - Tq).
// nn::scaled_dot_product_attention calls it where it applies.
Tensor fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale);

// ---- composites (built from the primitives above; gradients come for free) ----
Tensor relu(const Tensor& x);
Tensor gelu(const Tensor& x, bool tanh_approximation = false);
Tensor sigmoid(const Tensor& x);
Tensor silu(const Tensor& x);
Tensor softmax(const Tensor& x, int64_t axis = -1);
Tensor log_softmax(const Tensor& x, int64_t axis = -1);
Tensor logsumexp(const Tensor& x, std::vector<int64_t> axes, bool keepdim = false);
// Normalizes over the trailing dims of `normalized_shape`; weight/bias optional (undefined).
Tensor layer_norm(const Tensor& x, Shape normalized_shape, const Tensor& weight = {},
                  const Tensor& bias = {}, double eps = 1e-5);
// Batch normalization of x (N, C, ...) over every axis but the channels (1), as
// torch.nn.functional.batch_norm. training: the batch's mean and biased variance normalize, and
// running_mean / running_var (C), when defined, are updated lazily through assign:
// running = (1 - momentum) * running + momentum * batch statistic (the variance unbiased), kept
// in their own dtype. Not training: the running statistics normalize (they must be defined).
// weight and bias (C) are optional (undefined).
Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight = {},
                  const Tensor& bias = {}, bool training = false, double momentum = 0.1, double eps = 1e-5);
// Zeroes elements with probability p and scales the rest by 1/(1-p) when `training`.
Tensor dropout(const Tensor& x, double p, bool training = true);

// ---- Pooling (NCHW) ----
// Over the two trailing dims of x (N, C, H, W) or (C, H, W), with PyTorch's semantics: stride
// {0, 0} means the kernel; padding at most half the kernel; output size
// floor((H + 2 * padding - dilation * (kernel - 1) - 1) / stride) + 1, rounded up in ceil_mode
// as long as the last window starts inside the input or its left padding.
//   max_pool2d(x, {2, 2});  // (N, C, H, W) -> (N, C, H / 2, W / 2)
// Max pooling: padding never wins (as if it were -inf); a window's gradient goes to its first
// maximum in row-major order, as in PyTorch (NaN counts as the maximum).
Tensor max_pool2d(const Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride = {0, 0},
                  std::array<int64_t, 2> padding = {0, 0}, std::array<int64_t, 2> dilation = {1, 1},
                  bool ceil_mode = false);
// Average pooling of float inputs: divides by the window size clipped to the padded input
// (count_include_pad) or to the input alone.
Tensor avg_pool2d(const Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride = {0, 0},
                  std::array<int64_t, 2> padding = {0, 0}, bool ceil_mode = false, bool count_include_pad = true);

}  // namespace kiln
