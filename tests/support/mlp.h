// A small MLP and one SGD training step (forward, backward and update realized as one plan),
// shared by the planner, report and executor tests.
#pragma once
#include <vector>

#include <kiln/kiln.h>

namespace kiln::testing {

// Weights (randn * 0.05) and zero biases for layers widths[0] -> widths[1] -> ...
inline std::vector<Tensor> make_mlp(const std::vector<int64_t>& widths) {
  std::vector<Tensor> params;
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    params.push_back((randn({widths[i], widths[i + 1]}) * 0.05).realize().requires_grad_());
    params.push_back(zeros({widths[i + 1]}).realize().requires_grad_());
  }
  return params;
}

// Plain SGD on `loss`: gradients, lazy updates, and one sync of the parameters and the loss.
inline void sgd_step(std::vector<Tensor>& params, const Tensor& loss, double lr) {
  auto grads = grad(loss, params);
  NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) params[i].assign(params[i] - lr * grads[i]);
  std::vector<Tensor> outputs = params;
  outputs.push_back(loss);
  sync(outputs);
}

// relu between layers, cross entropy against integer labels y; returns the loss.
inline Tensor mlp_step(std::vector<Tensor>& params, const Tensor& x, const Tensor& y, double lr) {
  Tensor h = x;  // (B, widths[0])
  for (size_t i = 0; i + 1 < params.size(); i += 2) {
    h = matmul(h, params[i]) + params[i + 1];
    if (i + 2 < params.size()) h = relu(h);
  }
  Tensor loss = cross_entropy(h, y);
  sgd_step(params, loss, lr);
  return loss;
}

// Row-major offset into a 3-d shape, for reference loops.
struct Index3 {
  int64_t d0, d1, d2;
  int64_t operator()(int64_t i, int64_t j, int64_t k) const { return (i * d1 + j) * d2 + k; }
};

}  // namespace kiln::testing
