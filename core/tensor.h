// Tensor: a cheap handle to a lazily computed value. Ops record graph nodes and compute nothing;
// item(), to_vector() or kiln::sync() run the pending graph through the JIT.
//
//   kiln::Tensor x = kiln::randn({64, 784});
//   kiln::Tensor w = kiln::randn({784, 10}).requires_grad_();
//   kiln::Tensor loss = kiln::matmul(x, w).relu().mean();
//   loss.backward();                  // records the backward graph (still lazy)
//   fmt::print("{}\n", loss.item());  // runs forward and backward as one fused plan
#pragma once
#include <initializer_list>
#include <memory>
#include <vector>

#include "core/error.h"
#include "core/node.h"

namespace kiln {

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(NodePtr node);

  bool defined() const { return var_ != nullptr; }
  const NodePtr& node() const;
  const Shape& shape() const { return node()->shape; }
  int64_t size(int64_t axis) const;
  size_t dim() const { return shape().size(); }
  int64_t numel() const { return node()->numel(); }
  DType dtype() const { return node()->dtype; }
  Device device() const { return node()->device; }
  bool is_realized() const { return node()->realized(); }
  std::string str() const;  // "Tensor[2, 3] float32" (does not realize)

  // Running the graph.
  Tensor& realize();
  double item() const;  // the single element, realized, as double
  template <typename T> std::vector<T> to_vector() const;
  std::vector<double> to_doubles() const;
  // Realizes; pointer valid while this tensor lives and is not assigned. A device pointer for a
  // CUDA tensor (item, to_vector and to_doubles copy through the host instead).
  const void* data() const;
  // A copy on `device` (this tensor when it is there already). Throws kiln::Error when the
  // device is not available. Gradients do not cross devices yet: a leaf that requires grad gives
  // a new leaf that requires grad; a tensor with gradient history must be detached first.
  Tensor to(Device device) const;
  Tensor to(DType dtype) const;  // cast(dtype): the same value converted (this tensor when it has the dtype)
  // Moves this variable (every handle sharing it, and its grad) to `device`: Module::to.
  Tensor& to_(Device device);

  // Autograd.
  bool requires_grad() const;
  Tensor& requires_grad_(bool on = true);  // marks a leaf whose gradient backward() accumulates
  Tensor grad() const;                     // undefined until backward() reaches this leaf
  void set_grad(const Tensor& g);          // g: this tensor's shape, device and dtype (or undefined)
  void zero_grad();
  // Accumulates d(this)/d(leaf) into every leaf's grad(); consumes the graph unless retained.
  void backward(bool retain_graph = false) const;
  Tensor detach() const;                   // same value, no gradient history

  // Points this variable (and every handle sharing it) at a new value, recorded lazily. Used by
  // optimizers: gradients stop here, so the next step sees a leaf again. The value must have
  // this variable's shape, device and dtype: a different dtype is a kiln::Error, never a silent
  // conversion (assign(value.to(dtype())) converts on purpose).
  void assign(const Tensor& value);

  // Movement (views; no copy until needed).
  Tensor reshape(Shape shape) const;
  Tensor view(Shape shape) const { return reshape(std::move(shape)); }
  Tensor flatten(int64_t start = 0, int64_t end = -1) const;
  Tensor permute(std::vector<int64_t> perm) const;
  Tensor transpose(int64_t a = -2, int64_t b = -1) const;
  Tensor t() const { return transpose(0, 1); }
  Tensor expand(Shape shape) const;
  Tensor unsqueeze(int64_t axis) const;
  Tensor squeeze(int64_t axis) const;
  Tensor slice(int64_t axis, int64_t start, int64_t stop, int64_t step = 1) const;

  // Common ops as methods (free functions in ops/ops.h have the full set).
  Tensor cast(DType t) const;
  Tensor sum(std::vector<int64_t> axes = {}, bool keepdim = false) const;
  Tensor mean(std::vector<int64_t> axes = {}, bool keepdim = false) const;
  Tensor max(std::vector<int64_t> axes = {}, bool keepdim = false) const;
  Tensor exp() const;
  Tensor log() const;
  Tensor sqrt() const;
  Tensor abs() const;
  Tensor relu() const;
  Tensor sigmoid() const;
  Tensor tanh() const;
  Tensor pow(double exponent) const;
  Tensor matmul(const Tensor& other) const;

 private:
  std::shared_ptr<Var> var_;
  friend struct TensorAccess;
};

// Runs all pending work needed by `tensors` as one plan.
void sync(const std::vector<Tensor>& tensors);

// While one lives on a thread, every Tensor::assign on that thread adds its variable to
// assigned(): a step's side effects, for optim::TrainStep to check it knows them all. Does not nest.
class AssignRecorder {
 public:
  AssignRecorder();
  ~AssignRecorder();
  AssignRecorder(const AssignRecorder&) = delete;
  AssignRecorder& operator=(const AssignRecorder&) = delete;
  const std::vector<std::weak_ptr<Var>>& assigned() const { return assigned_; }

 private:
  friend class Tensor;
  std::vector<std::weak_ptr<Var>> assigned_;
};

// Internal access for ops/, jit/ and nn/: the variable behind a handle.
struct TensorAccess {
  static const std::shared_ptr<Var>& var(const Tensor& t) { return t.var_; }
  static Tensor from_var(std::shared_ptr<Var> v) {
    Tensor t;
    t.var_ = std::move(v);
    return t;
  }
};

}  // namespace kiln
