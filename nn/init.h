// Parameter initializers. Each points the tensor's variable at a new value (Tensor::assign, with
// no gradient recorded), so every handle sharing the parameter sees it.
//
//   nn::init::kaiming_uniform_(linear.weight, std::sqrt(5.0));  // PyTorch's Linear default
//   nn::init::zeros_(linear.bias);
//
// Fans follow PyTorch: fan_in = shape[1] * receptive field, fan_out = shape[0] * receptive field
// (receptive field = product of shape[2:]); a 1-d tensor has fan_in = fan_out = shape[0].
#pragma once
#include <utility>

#include "core/tensor.h"

namespace kiln::nn::init {

enum class FanMode { In, Out };

std::pair<int64_t, int64_t> fan_in_and_out(const Tensor& t);

void uniform_(Tensor t, double low = 0.0, double high = 1.0);
void normal_(Tensor t, double mean = 0.0, double std = 1.0);
void constant_(Tensor t, double value);
void zeros_(Tensor t);
void ones_(Tensor t);
// He initialization for a leaky-ReLU slope `a` (0 = ReLU): gain = sqrt(2 / (1 + a^2)).
// Uniform bound = gain * sqrt(3 / fan); normal std = gain / sqrt(fan).
void kaiming_uniform_(Tensor t, double a = 0.0, FanMode mode = FanMode::In);
void kaiming_normal_(Tensor t, double a = 0.0, FanMode mode = FanMode::In);
// Glorot initialization: bound = gain * sqrt(6 / (fan_in + fan_out)), std = gain * sqrt(2 / (fan_in + fan_out)).
void xavier_uniform_(Tensor t, double gain = 1.0);
void xavier_normal_(Tensor t, double gain = 1.0);

}  // namespace kiln::nn::init
