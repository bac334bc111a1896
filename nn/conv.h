// nn::Conv2d: a 2-D convolution layer over (N, C, H, W) inputs, with PyTorch's parameter layout
// and initialization, so checkpoints open there unchanged.
//
//   nn::Conv2d conv(1, 32, 3);                                          // 3x3, stride 1, no padding
//   nn::Conv2d down(nn::Conv2dOptions(32, 64, 3).stride(2).padding(1));
//   Tensor y = down.forward(conv.forward(x));                           // (N, 64, H', W')
#pragma once
#include <array>
#include <cstdint>

#include "core/options.h"
#include "core/tensor.h"
#include "nn/module.h"

namespace kiln::nn {

class Conv2dOptions {
 public:
  Conv2dOptions(int64_t in_channels, int64_t out_channels, int64_t kernel_size)
      : Conv2dOptions(in_channels, out_channels, Size2{kernel_size, kernel_size}) {}
  Conv2dOptions(int64_t in_channels, int64_t out_channels, Size2 kernel_size)
      : in_channels_(in_channels), out_channels_(out_channels), kernel_size_(kernel_size) {}
  KILN_OPTION(int64_t, in_channels, 0)
  KILN_OPTION(int64_t, out_channels, 0)
  KILN_OPTION(Size2, kernel_size, (Size2{1, 1}))
  KILN_OPTION(Size2, stride, (Size2{1, 1}))
  KILN_OPTION(Size2, padding, (Size2{0, 0}))
  KILN_OPTION(Size2, dilation, (Size2{1, 1}))
  KILN_OPTION(int64_t, groups, 1)
  KILN_OPTION(bool, bias, true)
  KILN_OPTION(DType, dtype, DType::Float32)
  // Square settings in one number, as in PyTorch: .stride(2) == .stride({2, 2}).
  Conv2dOptions& stride(int64_t s) { return stride(Size2{s, s}); }
  Conv2dOptions& padding(int64_t p) { return padding(Size2{p, p}); }
  Conv2dOptions& dilation(int64_t d) { return dilation(Size2{d, d}); }
};

// y = conv2d(x, weight) + bias. weight (out, in / groups, kh, kw), bias (out); initialized like
// PyTorch (kaiming uniform with a = sqrt(5); bias uniform in +-1/sqrt(fan_in)).
class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel_size)
      : Conv2d(Conv2dOptions(in_channels, out_channels, kernel_size)) {}
  explicit Conv2d(const Conv2dOptions& options);
  Tensor forward(const Tensor& x) override;
  const Conv2dOptions& options() const { return options_; }
  Tensor weight;  // (out, in / groups, kh, kw)
  Tensor bias;    // (out), undefined without bias

 private:
  Conv2dOptions options_;
};

}  // namespace kiln::nn
