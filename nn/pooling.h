// Pooling layers over (N, C, H, W) or (C, H, W) inputs: max_pool2d / avg_pool2d (ops/ops.h)
// as modules, with PyTorch's options and output sizes. They have no parameters.
//
//   nn::MaxPool2d pool(2);                                              // 2x2 windows, stride 2
//   nn::MaxPool2d overlapping(nn::MaxPool2dOptions(3).stride(2).padding(1));
//   nn::AvgPool2d average(nn::AvgPool2dOptions(2).count_include_pad(false));
//   Tensor y = pool.forward(x);                                         // (N, C, H / 2, W / 2)
#pragma once
#include <array>
#include <cstdint>

#include "core/options.h"
#include "core/tensor.h"
#include "nn/module.h"

namespace kiln::nn {

class MaxPool2dOptions {
 public:
  MaxPool2dOptions(int64_t kernel_size) : MaxPool2dOptions(Size2{kernel_size, kernel_size}) {}
  MaxPool2dOptions(Size2 kernel_size) : kernel_size_(kernel_size) {}
  KILN_OPTION(Size2, kernel_size, (Size2{1, 1}))
  KILN_OPTION(Size2, stride, (Size2{0, 0}))  // {0, 0}: the kernel size, as PyTorch's default
  KILN_OPTION(Size2, padding, (Size2{0, 0}))  // at most half the kernel; padding never wins
  KILN_OPTION(Size2, dilation, (Size2{1, 1}))
  KILN_OPTION(bool, ceil_mode, false)
  // Square settings in one number, as in PyTorch: .stride(2) == .stride({2, 2}).
  MaxPool2dOptions& stride(int64_t s) { return stride(Size2{s, s}); }
  MaxPool2dOptions& padding(int64_t p) { return padding(Size2{p, p}); }
  MaxPool2dOptions& dilation(int64_t d) { return dilation(Size2{d, d}); }
};

// The maximum of each window. At equal maxima the gradient goes to the first in row-major order.
class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(int64_t kernel_size) : MaxPool2d(MaxPool2dOptions(kernel_size)) {}
  explicit MaxPool2d(const MaxPool2dOptions& options);
  Tensor forward(const Tensor& x) override;
  const MaxPool2dOptions& options() const { return options_; }

 private:
  MaxPool2dOptions options_;
};

class AvgPool2dOptions {
 public:
  AvgPool2dOptions(int64_t kernel_size) : AvgPool2dOptions(Size2{kernel_size, kernel_size}) {}
  AvgPool2dOptions(Size2 kernel_size) : kernel_size_(kernel_size) {}
  KILN_OPTION(Size2, kernel_size, (Size2{1, 1}))
  KILN_OPTION(Size2, stride, (Size2{0, 0}))  // {0, 0}: the kernel size, as PyTorch's default
  KILN_OPTION(Size2, padding, (Size2{0, 0}))  // zeros, at most half the kernel
  KILN_OPTION(bool, ceil_mode, false)
  KILN_OPTION(bool, count_include_pad, true)  // false: divide by the in-input part of the window
  AvgPool2dOptions& stride(int64_t s) { return stride(Size2{s, s}); }
  AvgPool2dOptions& padding(int64_t p) { return padding(Size2{p, p}); }
};

// The mean of each window (float inputs).
class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(int64_t kernel_size) : AvgPool2d(AvgPool2dOptions(kernel_size)) {}
  explicit AvgPool2d(const AvgPool2dOptions& options);
  Tensor forward(const Tensor& x) override;
  const AvgPool2dOptions& options() const { return options_; }

 private:
  AvgPool2dOptions options_;
};

}  // namespace kiln::nn
