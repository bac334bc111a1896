// conv2d of the user API: argument checks, then oneDNN's primitive where it has the dtype and an
// unfold + matmul composite elsewhere.
#include "ops/autocast.h"
#include "ops/library.h"
#include "ops/ops.h"
#include "ops/primitive.h"

namespace kiln {

namespace {

// y[n, o, i, j] = sum over c, a, b of w[o, c, a, b] * xp[n, c, i * s + a * d, j * s + b * d], with
// the window taps gathered by strided slices of the padded input (one view per tap) and summed
// by a matmul per group. Every step has an exact gradient, so float64 checks test the math
// that the oneDNN passes must reproduce.
Tensor conv2d_unfolded(const Tensor& x, const Tensor& w, const std::vector<int64_t>& conv, const Shape& y_shape) {
  const int64_t N = x.size(0), C = x.size(1), OC = w.size(0), KH = w.size(2), KW = w.size(3);
  const int64_t OH = y_shape[2], OW = y_shape[3], groups = conv[6];
  Tensor xp = pad(x, {{0, 0}, {0, 0}, {conv[2], conv[2]}, {conv[3], conv[3]}});
  std::vector<Tensor> taps;
  taps.reserve(static_cast<size_t>(KH * KW));
  for (int64_t a = 0; a < KH; ++a)
    for (int64_t b = 0; b < KW; ++b)
      taps.push_back(prim::slice(xp, {0, 0, a * conv[4], b * conv[5]}, {1, 1, conv[0], conv[1]}, {N, C, OH, OW})
                         .reshape({N, C, 1, OH * OW}));
  const int64_t K = C / groups * KH * KW;
  Tensor columns = concat(taps, 2).reshape({N, groups, K, OH * OW});
  return matmul(w.reshape({groups, OC / groups, K}), columns).reshape(y_shape);
}

}  // namespace

Tensor conv2d(const Tensor& x_raw, const Tensor& weight_raw, const Tensor& bias_raw, std::array<int64_t, 2> stride,
              std::array<int64_t, 2> padding, std::array<int64_t, 2> dilation, int64_t groups) {
  AutocastScope amp("conv2d");
  const Tensor x_in = amp(x_raw), weight = amp(weight_raw), bias = amp(bias_raw);
  KILN_CHECK(x_in.dim() == 3 || x_in.dim() == 4, "conv2d", "x must be (N, C, H, W) or (C, H, W), got {}",
             shape_str(x_in.shape()));
  KILN_CHECK(is_floating(x_in.dtype()) && x_in.dtype() == weight.dtype(), "conv2d",
             "x and weight must share one float dtype; got {} and {}", dtype_name(x_in.dtype()),
             dtype_name(weight.dtype()));
  const DType t = x_in.dtype();
  if (t == DType::Float16 && !library_conv(x_in.device(), t) && library_conv(x_in.device(), DType::Float32)) {
    // As matmul: no float16 library convolution here, so the float32 one of widened operands.
    auto wide = [](const Tensor& v) { return v.defined() ? cast(v, DType::Float32) : v; };
    return cast(conv2d(wide(x_in), wide(weight), wide(bias), stride, padding, dilation, groups), t);
  }
  Tensor x = x_in.dim() == 3 ? unsqueeze(x_in, 0) : x_in;
  std::vector<int64_t> conv{stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1], groups};
  Tensor y = library_conv(x.device(), x.dtype())
                 ? prim::conv2d(x, weight, conv)
                 : conv2d_unfolded(x, weight, conv, prim::conv2d_output_shape(x.shape(), weight.shape(), conv));
  if (bias.defined()) {
    KILN_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0) && bias.dtype() == weight.dtype(), "conv2d",
               "bias must be ({}) {}, got {} {}", weight.size(0), dtype_name(weight.dtype()),
               shape_str(bias.shape()), dtype_name(bias.dtype()));
    y = y + bias.reshape({weight.size(0), 1, 1});
  }
  return x_in.dim() == 3 ? squeeze(y, 0) : y;
}

}  // namespace kiln
