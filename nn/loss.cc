// Loss functions, built from kiln ops so their gradients come from autograd. See loss.h.
#include "nn/loss.h"

#include "core/shape.h"
#include "ops/ops.h"

namespace kiln::nn {

namespace {

Tensor reduce(const Tensor& per_element, Reduction reduction) {
  switch (reduction) {
    case Reduction::Mean: return kiln::mean(per_element);
    case Reduction::Sum: return kiln::sum(per_element);
    case Reduction::None: return per_element;
  }
  return per_element;
}

void check_same_shape(const Tensor& a, const Tensor& b, const char* op) {
  KILN_CHECK(a.shape() == b.shape(), op, "prediction {} and target {} differ in shape", shape_str(a.shape()),
             shape_str(b.shape()));
}

void check_class_inputs(const Tensor& scores, const Tensor& labels, const char* op) {
  KILN_CHECK(scores.dim() == 2, op, "expects scores (N, C), got {}", shape_str(scores.shape()));
  KILN_CHECK(labels.dim() == 1 && labels.size(0) == scores.size(0), op, "labels {} do not match scores {}",
             shape_str(labels.shape()), shape_str(scores.shape()));
  KILN_CHECK(is_integral(labels.dtype()), op, "labels have dtype {}; need integer class ids",
             dtype_name(labels.dtype()));
}

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& labels, CrossEntropyOptions options) {
  if (options.reduction == Reduction::Mean) return kiln::cross_entropy(logits, labels, options.label_smoothing);
  check_class_inputs(logits, labels, "cross_entropy");
  KILN_CHECK(options.label_smoothing >= 0.0 && options.label_smoothing < 1.0, "cross_entropy",
             "label_smoothing {} is outside [0, 1)", options.label_smoothing);
  int64_t classes = logits.size(1);
  Tensor log_probs = log_softmax(logits, 1);  // (N, C)
  Tensor target = one_hot(labels, classes, logits.dtype()) * (1.0 - options.label_smoothing) +
                  options.label_smoothing / static_cast<double>(classes);
  return reduce(-kiln::sum(target * log_probs, {1}), options.reduction);  // (N) before reduction
}

Tensor nll_loss(const Tensor& log_probs, const Tensor& labels, Reduction reduction) {
  check_class_inputs(log_probs, labels, "nll_loss");
  Tensor picked = kiln::sum(one_hot(labels, log_probs.size(1), log_probs.dtype()) * log_probs, {1});  // (N)
  return reduce(-picked, reduction);
}

Tensor mse_loss(const Tensor& prediction, const Tensor& target, Reduction reduction) {
  check_same_shape(prediction, target, "mse_loss");
  Tensor diff = prediction - target;
  return reduce(diff * diff, reduction);
}

Tensor l1_loss(const Tensor& prediction, const Tensor& target, Reduction reduction) {
  check_same_shape(prediction, target, "l1_loss");
  return reduce(kiln::abs(prediction - target), reduction);
}

Tensor bce_with_logits(const Tensor& logits, const Tensor& target, Reduction reduction) {
  check_same_shape(logits, target, "bce_with_logits");
  Tensor x = logits;
  Tensor per_element = kiln::relu(x) - x * target + kiln::log(1.0 + kiln::exp(-kiln::abs(x)));
  return reduce(per_element, reduction);
}

}  // namespace kiln::nn
