// Loss functions, built from kiln ops so their gradients come from autograd. See loss.h.
#include "ops/loss.h"

#include "core/shape.h"
#include "ops/autocast.h"
#include "ops/ops.h"

namespace kiln {

namespace {

Tensor reduce(const Tensor& per_element, Reduction reduction) {
  switch (reduction) {
    case Reduction::Mean: return mean(per_element);
    case Reduction::Sum: return sum(per_element);
    case Reduction::None: return per_element;
  }
  return per_element;
}

void check_same_shape(const Tensor& a, const Tensor& b, const char* op) {
  KILN_CHECK(a.shape() == b.shape(), op, "prediction {} and target {} differ in shape", shape_str(a.shape()),
             shape_str(b.shape()));
}

void check_class_inputs(const Tensor& scores, const Tensor& labels, const char* op) {
  KILN_CHECK(scores.dim() == 2 && labels.dim() == 1 && labels.size(0) == scores.size(0), op,
             "needs scores (N, C) and labels (N); got {} and {}", shape_str(scores.shape()),
             shape_str(labels.shape()));
  KILN_CHECK(is_integral(labels.dtype()) && labels.dtype() != DType::Bool, op,
             "labels must be integer class indices, got {}", dtype_name(labels.dtype()));
}

}  // namespace

Tensor cross_entropy(const Tensor& logits_in, const Tensor& labels, const CrossEntropyOptions& options) {
  AutocastScope amp("cross_entropy");
  const Tensor logits = amp(logits_in);
  check_class_inputs(logits, labels, "cross_entropy");
  const double s = options.label_smoothing();
  KILN_CHECK(s >= 0 && s < 1, "cross_entropy", "label_smoothing {} not in [0, 1)", s);
  Tensor log_probs = log_softmax(logits, 1);                                          // (N, C)
  Tensor picked = gather(log_probs, 1, unsqueeze(cast(labels, DType::Int64), 1));     // (N, 1)
  if (options.reduction() == Reduction::Mean) {
    // The mean as one reduction over (N, 1) and, with smoothing, one over (N, C): the graph
    // the training samples and benchmarks have always fused.
    Tensor nll = -mean(picked);
    if (s == 0) return nll;
    Tensor uniform = -mean(log_probs);  // (1/N) sum_n (1/C) sum_c -log p[n, c]
    return (1.0 - s) * nll + s * uniform;
  }
  Tensor per_row = -reshape(picked, {logits.size(0)});                                // (N)
  if (s != 0) per_row = (1.0 - s) * per_row + s * -mean(log_probs, {1});
  return reduce(per_row, options.reduction());
}

Tensor nll_loss(const Tensor& log_probs_in, const Tensor& labels, Reduction reduction) {
  AutocastScope amp("nll_loss");
  const Tensor log_probs = amp(log_probs_in);
  check_class_inputs(log_probs, labels, "nll_loss");
  Tensor picked = sum(one_hot(labels, log_probs.size(1), log_probs.dtype()) * log_probs, {1});  // (N)
  return reduce(-picked, reduction);
}

Tensor mse_loss(const Tensor& prediction_in, const Tensor& target_in, Reduction reduction) {
  AutocastScope amp("mse_loss");
  const Tensor prediction = amp(prediction_in), target = amp(target_in);
  check_same_shape(prediction, target, "mse_loss");
  Tensor diff = prediction - target;
  return reduce(diff * diff, reduction);
}

Tensor l1_loss(const Tensor& prediction_in, const Tensor& target_in, Reduction reduction) {
  AutocastScope amp("l1_loss");
  const Tensor prediction = amp(prediction_in), target = amp(target_in);
  check_same_shape(prediction, target, "l1_loss");
  return reduce(abs(prediction - target), reduction);
}

Tensor bce_with_logits(const Tensor& logits_in, const Tensor& target_in, Reduction reduction) {
  AutocastScope amp("bce_with_logits");
  const Tensor logits = amp(logits_in), target = amp(target_in);
  check_same_shape(logits, target, "bce_with_logits");
  Tensor per_element = relu(logits) - logits * target + log(1.0 + exp(-abs(logits)));
  return reduce(per_element, reduction);
}

}  // namespace kiln
