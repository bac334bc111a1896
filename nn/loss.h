// Loss functions. Each returns the mean over all elements (or examples) unless another
// Reduction is asked for.
//
//   Tensor loss = nn::cross_entropy(logits, labels, {.label_smoothing = 0.1});
//   Tensor l2 = nn::mse_loss(prediction, target);
#pragma once
#include "core/tensor.h"

namespace kiln::nn {

enum class Reduction { Mean, Sum, None };

struct CrossEntropyOptions {
  double label_smoothing = 0.0;  // in [0, 1)
  Reduction reduction = Reduction::Mean;
};

// logits (N, C), labels (N) integer class ids. With smoothing s the target is
// (1 - s) * one_hot + s / C.
Tensor cross_entropy(const Tensor& logits, const Tensor& labels, CrossEntropyOptions options = {});
// log_probs (N, C) (e.g. log_softmax output), labels (N): -log_probs[n, labels[n]].
Tensor nll_loss(const Tensor& log_probs, const Tensor& labels, Reduction reduction = Reduction::Mean);
Tensor mse_loss(const Tensor& prediction, const Tensor& target, Reduction reduction = Reduction::Mean);
Tensor l1_loss(const Tensor& prediction, const Tensor& target, Reduction reduction = Reduction::Mean);
// Binary cross entropy on logits x against targets t in [0, 1], in the stable form
// max(x, 0) - x * t + log(1 + exp(-|x|)).
Tensor bce_with_logits(const Tensor& logits, const Tensor& target, Reduction reduction = Reduction::Mean);

}  // namespace kiln::nn
