// Gradient clipping by global norm, as torch.nn.utils.clip_grad_norm_, recorded lazily: nothing
// runs until the step syncs, and the scaling fuses into the update.
//
//   loss.backward();
//   kiln::Tensor norm = kiln::optim::clip_grad_norm(model_params, /*max_norm=*/1.0);
//   opt.step();
//   double before = norm.item();  // the norm before clipping (free once the step has run)
#pragma once
#include <functional>
#include <vector>

#include "core/tensor.h"

namespace kiln::optim {

// total = sqrt(sum over parameters of sum(grad^2)) over every parameter with a p.grad(); each
// such gradient becomes grad * min(1, max_norm / (total + 1e-6)) (set_grad), so gradients are
// only scaled when the norm exceeds max_norm. Returns the total norm before clipping as a lazy
// float32 0-d tensor (zero when no parameter has a gradient).
Tensor clip_grad_norm(const std::vector<Tensor>& params, double max_norm);
// The same on gradients held in a vector (undefined ones skipped), replaced in place.
// `across`: turns this process's sum of squares into the whole model's when other processes hold
// other parameters (a pipeline's stages: an all-reduce over them), so that all clip alike.
using NormCombiner = std::function<Tensor(const Tensor& sum_of_squares)>;
Tensor clip_by_global_norm(std::vector<Tensor>& grads, double max_norm, const NormCombiner& across = {});

}  // namespace kiln::optim
