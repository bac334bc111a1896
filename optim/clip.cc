// clip_grad_norm: see clip.h.
#include "optim/clip.h"

#include "core/autograd.h"
#include "core/error.h"
#include "ops/ops.h"

namespace kiln::optim {

Tensor clip_by_global_norm(std::vector<Tensor>& grads, double max_norm, const NormCombiner& across) {
  KILN_CHECK(max_norm > 0, "optim::clip_grad_norm", "max_norm must be positive, got {}", max_norm);
  NoGradGuard no_grad;
  Tensor sum_of_squares;
  // Last parameter first: the step's graph is ordered depth first from this sum, so each layer's
  // weight gradients then come right after the backward reaches the layer (their deltas die
  // there) instead of all after the first layer's, which needs the whole backward.
  for (auto it = grads.rbegin(); it != grads.rend(); ++it) {
    const Tensor& g = *it;
    if (!g.defined()) continue;
    Tensor s = (g * g).cast(DType::Float32).sum();
    sum_of_squares = sum_of_squares.defined() ? sum_of_squares + s : s;
  }
  if (across) sum_of_squares = across(sum_of_squares.defined() ? sum_of_squares : scalar(0.0).cast(DType::Float32));
  if (!sum_of_squares.defined()) return scalar(0.0);
  Tensor total = sqrt(sum_of_squares);
  Tensor scale = minimum(max_norm / (total + 1e-6), scalar(1.0));  // 0-d
  for (Tensor& g : grads)
    if (g.defined()) g = g * scale.cast(g.dtype());
  return total;
}

Tensor clip_grad_norm(const std::vector<Tensor>& params, double max_norm) {
  std::vector<Tensor> grads;
  for (const Tensor& p : params) grads.push_back(p.grad());
  Tensor total = clip_by_global_norm(grads, max_norm);
  for (size_t i = 0; i < params.size(); ++i)
    if (grads[i].defined()) Tensor(params[i]).set_grad(grads[i]);
  return total;
}

}  // namespace kiln::optim
