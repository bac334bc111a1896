// nn::Conv2d. See conv.h.
#include "nn/conv.h"

#include <cmath>

#include <fmt/format.h>

#include "core/shape.h"
#include "nn/init.h"
#include "ops/ops.h"

namespace kiln::nn {

Conv2d::Conv2d(const Conv2dOptions& o) : Module("Conv2d"), options_(o) {
  const Size2 k = o.kernel_size();
  KILN_CHECK(o.in_channels() > 0 && o.out_channels() > 0 && k[0] > 0 && k[1] > 0 && o.groups() > 0 &&
                 o.in_channels() % o.groups() == 0 && o.out_channels() % o.groups() == 0,
             "Conv2d", "needs positive channels and kernel with both channel counts divisible by groups; got in={} "
             "out={} kernel={}x{} groups={}", o.in_channels(), o.out_channels(), k[0], k[1], o.groups());
  weight = register_parameter("weight", zeros({o.out_channels(), o.in_channels() / o.groups(), k[0], k[1]}, o.dtype()));
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (o.bias()) {
    bias = register_parameter("bias", zeros({o.out_channels()}, o.dtype()));
    double bound = 1.0 / std::sqrt(static_cast<double>(init::fan_in_and_out(weight).first));
    init::uniform_(bias, -bound, bound);
  }
  set_extra_repr(fmt::format("{}, {}, kernel_size=({}, {}), stride=({}, {}), padding=({}, {}){}{}{}", o.in_channels(),
                             o.out_channels(), k[0], k[1], o.stride()[0], o.stride()[1], o.padding()[0], o.padding()[1],
                             o.dilation() != Size2{1, 1} ? fmt::format(", dilation=({}, {})", o.dilation()[0], o.dilation()[1]) : "",
                             o.groups() != 1 ? fmt::format(", groups={}", o.groups()) : "", o.bias() ? "" : ", bias=false"));
}

Tensor Conv2d::forward(const Tensor& x) {
  KILN_CHECK((x.dim() == 3 || x.dim() == 4) && x.size(x.dim() - 3) == options_.in_channels(), "Conv2d",
             "expects (N, {0}, H, W) or ({0}, H, W), got {1}", options_.in_channels(), shape_str(x.shape()));
  return conv2d(x, weight, bias, options_.stride(), options_.padding(), options_.dilation(), options_.groups());
}

}  // namespace kiln::nn
