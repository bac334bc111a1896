// Pooling layers. See pooling.h; the ops check the settings against each input's shape.
#include "nn/pooling.h"

#include <fmt/format.h>

#include "ops/ops.h"

namespace kiln::nn {

namespace {
std::string pair_str(const Size2& v) { return fmt::format("({}, {})", v[0], v[1]); }
Size2 effective_stride(const Size2& stride, const Size2& kernel) { return stride == Size2{0, 0} ? kernel : stride; }
}  // namespace

MaxPool2d::MaxPool2d(const MaxPool2dOptions& o) : Module("MaxPool2d"), options_(o) {
  set_extra_repr(fmt::format("kernel_size={}, stride={}, padding={}, dilation={}, ceil_mode={}",
                             pair_str(o.kernel_size()), pair_str(effective_stride(o.stride(), o.kernel_size())),
                             pair_str(o.padding()), pair_str(o.dilation()), o.ceil_mode()));
}

Tensor MaxPool2d::forward(const Tensor& x) {
  return max_pool2d(x, options_.kernel_size(), options_.stride(), options_.padding(), options_.dilation(),
                    options_.ceil_mode());
}

AvgPool2d::AvgPool2d(const AvgPool2dOptions& o) : Module("AvgPool2d"), options_(o) {
  set_extra_repr(fmt::format("kernel_size={}, stride={}, padding={}, ceil_mode={}, count_include_pad={}",
                             pair_str(o.kernel_size()), pair_str(effective_stride(o.stride(), o.kernel_size())),
                             pair_str(o.padding()), o.ceil_mode(), o.count_include_pad()));
}

Tensor AvgPool2d::forward(const Tensor& x) {
  return avg_pool2d(x, options_.kernel_size(), options_.stride(), options_.padding(), options_.ceil_mode(),
                    options_.count_include_pad());
}

}  // namespace kiln::nn
