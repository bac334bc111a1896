// Loss functions: one API for kiln:: and kiln::nn:: (nn/loss.h re-exports these names). Each
// returns the mean over examples (or elements) unless another Reduction is asked for; options
// are chainable like every options class in kiln.
//
//   Tensor loss = kiln::cross_entropy(logits, labels);                                // (), mean
//   Tensor smooth = kiln::cross_entropy(logits, labels, CrossEntropyOptions().label_smoothing(0.1));
//   Tensor per_row = kiln::cross_entropy(logits, labels, CrossEntropyOptions().reduction(Reduction::None));  // (N)
//   Tensor tokens = kiln::cross_entropy(scores, targets, CrossEntropyOptions().ignore_index(0).weight(w));  // (N, C, T)
//   Tensor l2 = kiln::mse_loss(prediction, target, Reduction::Sum);
#pragma once
#include <optional>

#include "core/options.h"
#include "core/tensor.h"

namespace kiln {

enum class Reduction { Mean, Sum, None };

class CrossEntropyOptions {
  KILN_OPTION(double, label_smoothing, 0.0)  // in [0, 1)
  KILN_OPTION(Reduction, reduction, Reduction::Mean)
  // Positions whose label is this id count for nothing (loss and weight 0). Unset: none is
  // ignored (PyTorch's default is -100).
  KILN_OPTION(std::optional<int64_t>, ignore_index, std::nullopt)
  KILN_OPTION(Tensor, weight, Tensor())  // (C) class weights, floating-point; undefined: all 1
};

// logits (N, C) or (N, C, d1, ...), labels (N) or (N, d1, ...) integer class ids, with
// PyTorch's semantics. The loss of a position with label y, class weights w (all 1 by default)
// and smoothing s: (1 - s) * w[y] * -log p[y] + (s / C) * sum_c w[c] * -log p[c] (0 if
// ignored). Reduction::Mean divides the sum by the sum of w[y] over the positions not ignored
// (their count without weights; all ignored: NaN); None gives each position's loss, shaped like
// the labels.
Tensor cross_entropy(const Tensor& logits, const Tensor& labels, const CrossEntropyOptions& options = {});
// log_probs (N, C) (e.g. log_softmax output), labels (N): -log_probs[n, labels[n]].
Tensor nll_loss(const Tensor& log_probs, const Tensor& labels, Reduction reduction = Reduction::Mean);
Tensor mse_loss(const Tensor& prediction, const Tensor& target, Reduction reduction = Reduction::Mean);
Tensor l1_loss(const Tensor& prediction, const Tensor& target, Reduction reduction = Reduction::Mean);
// Binary cross entropy on logits x against targets t in [0, 1], in the stable form
// max(x, 0) - x * t + log(1 + exp(-|x|)).
Tensor bce_with_logits(const Tensor& logits, const Tensor& target, Reduction reduction = Reduction::Mean);

}  // namespace kiln
