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

// cross_entropy with class weights, an ignored id or extra dims: the classes moved last and
// every position made a row, each row's loss and weight, then the weighted mean.
Tensor weighted_cross_entropy(const Tensor& logits, const Tensor& labels, const CrossEntropyOptions& options) {
  const int64_t C = logits.size(1), rows = labels.numel();
  const double s = options.label_smoothing();
  std::vector<int64_t> classes_last;  // (N, d1, ..., C)
  for (size_t d = 0; d < logits.dim(); ++d)
    if (d != 1) classes_last.push_back(static_cast<int64_t>(d));
  classes_last.push_back(1);
  Tensor log_probs = log_softmax(reshape(permute(logits, classes_last), {rows, C}), 1);  // (M, C)
  Tensor label = reshape(cast(labels, DType::Int64), {rows});                            // (M)
  Tensor kept;  // (M) bool: not ignored
  if (options.ignore_index()) {
    kept = ne(label, scalar(static_cast<double>(*options.ignore_index()), DType::Int64));
    label = where(kept, label, zeros_like(label));  // any valid id: its loss is masked out
  }
  Tensor picked = reshape(gather(log_probs, 1, unsqueeze(label, 1)), {rows});  // (M)
  // (C) in the loss's dtype: float64 weights must not turn a float32 loss into float64.
  const Tensor w = options.weight().defined() ? options.weight().to(log_probs.dtype()) : Tensor();
  Tensor row_weight;  // (M) w[y], 0 where ignored; undefined: all 1
  if (w.defined()) row_weight = index_select(w, 0, label);
  if (kept.defined()) row_weight = row_weight.defined() ? where(kept, row_weight, zeros_like(row_weight))
                                                        : cast(kept, log_probs.dtype());
  Tensor loss = row_weight.defined() ? -picked * row_weight : -picked;  // (M)
  if (s != 0) {
    Tensor smooth = -sum(w.defined() ? log_probs * reshape(w, {1, C}) : log_probs, {1});  // (M)
    if (kept.defined()) smooth = where(kept, smooth, zeros_like(smooth));
    loss = (1.0 - s) * loss + (s / static_cast<double>(C)) * smooth;
  }
  switch (options.reduction()) {
    case Reduction::Mean:
      return row_weight.defined() ? sum(loss) / sum(row_weight) : mean(loss);
    case Reduction::Sum: return sum(loss);
    case Reduction::None: return reshape(loss, labels.shape());
  }
  return loss;
}
}  // namespace

Tensor cross_entropy(const Tensor& logits_in, const Tensor& labels, const CrossEntropyOptions& options) {
  AutocastScope amp("cross_entropy");
  const Tensor logits = amp(logits_in);
  const double s = options.label_smoothing();
  KILN_CHECK(s >= 0 && s < 1, "cross_entropy", "label_smoothing {} not in [0, 1)", s);
  const Tensor& w = options.weight();
  if (w.defined())
    KILN_CHECK(w.dim() == 1 && w.size(0) == (logits.dim() >= 2 ? logits.size(1) : -1) && is_floating(w.dtype()),
               "cross_entropy", "class weights must be floating-point (C) for logits {} (C at axis 1); got {}",
               shape_str(logits.shape()), w.str());
  if (logits.dim() != 2 || w.defined() || options.ignore_index()) {
    Shape expected = logits.shape();
    if (logits.dim() >= 2) expected.erase(expected.begin() + 1);
    KILN_CHECK(logits.dim() >= 2 && labels.shape() == expected, "cross_entropy",
               "needs logits (N, C, d1, ...) and labels (N, d1, ...); got {} and {}", shape_str(logits.shape()),
               shape_str(labels.shape()));
    KILN_CHECK(is_integral(labels.dtype()) && labels.dtype() != DType::Bool, "cross_entropy",
               "labels must be integer class indices, got {}", dtype_name(labels.dtype()));
    return weighted_cross_entropy(logits, labels, options);
  }
  check_class_inputs(logits, labels, "cross_entropy");
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
