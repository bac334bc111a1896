// Loss functions: one API for kiln:: and kiln::nn:: (nn/loss.h re-exports these names). Each
// returns the mean over examples (or elements) unless another Reduction is asked for; options
// are chainable like every options class in kiln.
//
//   Tensor loss = kiln::cross_entropy(logits, labels);                                // (), mean
//   Tensor smooth = kiln::cross_entropy(logits, labels, CrossEntropyOptions().label_smoothing(0.1));
//   Tensor per_row = kiln::cross_entropy(logits, labels, CrossEntropyOptions().reduction(Reduction::None));  // (N)
//   Tensor l2 = kiln::mse_loss(prediction, target, Reduction::Sum);
#pragma once
#include "core/options.h"
#include "core/tensor.h"

namespace kiln {

enum class Reduction { Mean, Sum, None };

class CrossEntropyOptions {
  KILN_OPTION(double, label_smoothing, 0.0)  // in [0, 1)
  KILN_OPTION(Reduction, reduction, Reduction::Mean)
};

// logits (N, C), labels (N) integer class ids. With smoothing s the target is
// (1 - s) * one_hot + s / C. Reduction::None gives the loss of each row (N).
Tensor cross_entropy(const Tensor& logits, const Tensor& labels, const CrossEntropyOptions& options = {});
// log_probs (N, C) (e.g. log_softmax output), labels (N): -log_probs[n, labels[n]].
Tensor nll_loss(const Tensor& log_probs, const Tensor& labels, Reduction reduction = Reduction::Mean);
Tensor mse_loss(const Tensor& prediction, const Tensor& target, Reduction reduction = Reduction::Mean);
Tensor l1_loss(const Tensor& prediction, const Tensor& target, Reduction reduction = Reduction::Mean);
// Binary cross entropy on logits x against targets t in [0, 1], in the stable form
// max(x, 0) - x * t + log(1 + exp(-|x|)).
Tensor bce_with_logits(const Tensor& logits, const Tensor& target, Reduction reduction = Reduction::Mean);

}  // namespace kiln
