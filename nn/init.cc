// Parameter initializers. See init.h.
#include "nn/init.h"

#include <cmath>

#include "core/autograd.h"
#include "ops/ops.h"

namespace kiln::nn::init {

namespace {

void set(Tensor& t, const Tensor& value) {
  NoGradGuard no_grad;
  t.assign(value.cast(t.dtype()));
  t.realize();
}

int64_t fan(const Tensor& t, FanMode mode) {
  auto [in, out] = fan_in_and_out(t);
  return mode == FanMode::In ? in : out;
}

}  // namespace

std::pair<int64_t, int64_t> fan_in_and_out(const Tensor& t) {
  KILN_CHECK(t.dim() >= 1, "init", "cannot compute fans of a 0-d tensor");
  if (t.dim() == 1) return {t.size(0), t.size(0)};
  int64_t receptive = 1;
  for (size_t i = 2; i < t.dim(); ++i) receptive *= t.shape()[i];
  return {t.size(1) * receptive, t.size(0) * receptive};
}

void uniform_(Tensor t, double low, double high) {
  KILN_CHECK(is_floating(t.dtype()), "uniform_", "tensor has dtype {}; needs floating point", dtype_name(t.dtype()));
  set(t, rand(t.shape()) * (high - low) + low);
}

void normal_(Tensor t, double mean, double std) {
  KILN_CHECK(is_floating(t.dtype()), "normal_", "tensor has dtype {}; needs floating point", dtype_name(t.dtype()));
  set(t, randn(t.shape()) * std + mean);
}

void constant_(Tensor t, double value) { set(t, full(t.shape(), value, t.dtype())); }
void zeros_(Tensor t) { constant_(std::move(t), 0.0); }
void ones_(Tensor t) { constant_(std::move(t), 1.0); }

void kaiming_uniform_(Tensor t, double a, FanMode mode) {
  double gain = std::sqrt(2.0 / (1.0 + a * a));
  double bound = gain * std::sqrt(3.0 / static_cast<double>(fan(t, mode)));
  uniform_(std::move(t), -bound, bound);
}

void kaiming_normal_(Tensor t, double a, FanMode mode) {
  double gain = std::sqrt(2.0 / (1.0 + a * a));
  normal_(t, 0.0, gain / std::sqrt(static_cast<double>(fan(t, mode))));
}

void xavier_uniform_(Tensor t, double gain) {
  auto [in, out] = fan_in_and_out(t);
  double bound = gain * std::sqrt(6.0 / static_cast<double>(in + out));
  uniform_(std::move(t), -bound, bound);
}

void xavier_normal_(Tensor t, double gain) {
  auto [in, out] = fan_in_and_out(t);
  normal_(std::move(t), 0.0, gain * std::sqrt(2.0 / static_cast<double>(in + out)));
}

}  // namespace kiln::nn::init
