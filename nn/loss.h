// Loss functions for nn code: the same functions and options as kiln::cross_entropy & co.
// (ops/loss.h), under nn:: as well, so `nn::cross_entropy` and `kiln::cross_entropy` are one
// API with one options class.
//
//   Tensor loss = nn::cross_entropy(logits, labels, nn::CrossEntropyOptions().label_smoothing(0.1));
//   Tensor l2 = nn::mse_loss(prediction, target);
#pragma once
#include "ops/loss.h"

namespace kiln::nn {

using kiln::bce_with_logits;
using kiln::cross_entropy;
using kiln::CrossEntropyOptions;
using kiln::l1_loss;
using kiln::mse_loss;
using kiln::nll_loss;
using kiln::Reduction;

}  // namespace kiln::nn
