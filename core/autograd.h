// Symbolic, lazy reverse-mode autograd (as in Jittor): gradients are new graph nodes, recorded
// like any other op and run together with the forward when a value is needed.
//
//   auto grads = kiln::grad(loss, {w, b});  // lazy tensors shaped like w and b
//   { kiln::NoGradGuard no_grad; ... }      // records no gradient information inside
#pragma once
#include <vector>

#include "core/tensor.h"

namespace kiln {

bool grad_enabled();

class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// Compression of saved activations (memory/compress.h) for what is recorded inside: on (int8) or
// off, whatever KILN_COMPRESS_ACTIVATIONS says. Nests; the innermost guard wins.
//   { kiln::CompressActivationsGuard int8(true); h = block.forward(x); }
class CompressActivationsGuard {
 public:
  explicit CompressActivationsGuard(bool on);
  ~CompressActivationsGuard();
  CompressActivationsGuard(const CompressActivationsGuard&) = delete;
  CompressActivationsGuard& operator=(const CompressActivationsGuard&) = delete;

 private:
  int previous_;
};

// d(output)/d(input) for each input; `output` must have one element unless `grad_output` is
// given. Inputs the output does not depend on get zeros.
// As in PyTorch, the graph behind `output` is consumed: once its nodes are realized they drop
// their history, so a second backward through it is an error; pass retain_graph to keep it.
std::vector<Tensor> grad(const Tensor& output, const std::vector<Tensor>& inputs,
                         const Tensor& grad_output = {}, bool retain_graph = false);

// Transforms the gradients of some parameters before an optimizer applies them: data parallel's
// all-reduce (distributed/data_parallel.h). `along` are tensors the step realizes anyway (the
// loss, outputs, gradients a user holds): a reducer that must realize the gradients realizes them
// in the same plan, so that nothing is computed twice.
class GradientReducer {
 public:
  virtual ~GradientReducer() = default;
  // Replaces grads[i] (the gradient of params[i]; undefined when it has none) in place. Returns
  // false when the reducer kept the gradients for a later step (gradient accumulation): the
  // optimizer then updates nothing this time, and the reducer has realized `along` itself.
  virtual bool reduce(const std::vector<Tensor>& params, std::vector<Tensor>& grads,
                      const std::vector<Tensor>& along) = 0;
  // Tensors the step's plan realizes with the updates, and a check run once it has: a
  // data-parallel reducer compares the ranks' step counts that travelled in its first bucket.
  virtual std::vector<Tensor> realized_with_step() { return {}; }
  virtual void after_step() {}
};
// Registers `reducer` for `param` (null: none); the parameter keeps only a weak reference.
void set_gradient_reducer(const Tensor& param, const std::shared_ptr<GradientReducer>& reducer);
std::shared_ptr<GradientReducer> gradient_reducer(const Tensor& param);

// Gradient rule of one primitive: given the node and the gradient of its output, returns the
// gradient of each input (undefined where an input gets none). Defined in ops/grad_rules.cc.
using GradRule = std::vector<Tensor> (*)(const NodePtr& node, const Tensor& grad_out);
GradRule grad_rule(Op op);

}  // namespace kiln
