#include "core/tensor.h"

#include "core/autograd.h"
#include "core/flags.h"
#include "ops/ops.h"

namespace kiln {

namespace {
// A copy of `value` that becomes `var`'s node: a fresh id, no holders, and var's gradient role.
NodePtr node_for_variable(const Node& value, const std::shared_ptr<Var>& var) {
  auto node = new_node(value);
  node->id = Node::next_id();
  node->held = 0;
  node->requires_grad = var->requires_grad;
  node->grad_leaf = var->requires_grad;
  node->var = var;
  return node;
}

// How a dtype is written in code, for hints: DType::Float32.
std::string_view dtype_in_code(DType t) {
  static constexpr std::string_view kNames[kNumDTypes] = {"DType::Bool",    "DType::UInt8",    "DType::Int8",
                                                          "DType::Int32",   "DType::Int64",    "DType::Float16",
                                                          "DType::BFloat16", "DType::Float32", "DType::Float64"};
  return kNames[static_cast<int>(t)];
}
}  // namespace

thread_local AssignRecorder* t_assign_recorder = nullptr;

AssignRecorder::AssignRecorder() {
  KILN_CHECK(!t_assign_recorder, "AssignRecorder", "one is already recording on this thread");
  t_assign_recorder = this;
}
AssignRecorder::~AssignRecorder() { t_assign_recorder = nullptr; }

Tensor::Tensor(NodePtr node) : var_(std::allocate_shared<Var>(PooledAllocator<Var>(), std::move(node))) {}

const NodePtr& Tensor::node() const {
  KILN_CHECK(var_ != nullptr, "tensor", "use of an undefined tensor (default-constructed Tensor)");
  return var_->node;
}

int64_t Tensor::size(int64_t axis) const { return shape()[normalize_axis(axis, dim(), "size")]; }

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  return fmt::format("Tensor{} {}{}", shape_str(shape()), dtype_name(dtype()),
                     device().is_cpu() ? "" : " " + device().str());
}

Tensor& Tensor::realize() {
  sync({*this});
  return *this;
}

const void* Tensor::data() const {
  if (!is_realized()) sync({*this});
  return node()->storage->data;
}

namespace {
// A host copy of a device tensor's value. The tensor itself is realized first: reading a value
// realizes the tensor, as on the CPU (a detached copy alone would leave it pending).
Tensor host_copy(const Tensor& t) {
  if (!t.is_realized()) sync({t});
  return t.detach().to(Device::cpu());
}
}  // namespace

std::vector<double> Tensor::to_doubles() const {
  if (!device().is_cpu()) return host_copy(*this).to_doubles();
  const void* p = data();
  std::vector<double> out(numel());
  for (size_t i = 0; i < out.size(); ++i) out[i] = load_as_double(p, dtype(), i);
  return out;
}

template <typename T> std::vector<T> Tensor::to_vector() const {
  constexpr DType want = dtype_of<T>();
  if (!device().is_cpu()) return host_copy(*this).template to_vector<T>();
  if (dtype() != want) return kiln::cast(*this, want).template to_vector<T>();
  const T* p = static_cast<const T*>(data());
  return std::vector<T>(p, p + numel());
}
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<int32_t> Tensor::to_vector<int32_t>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;
template std::vector<uint8_t> Tensor::to_vector<uint8_t>() const;
template std::vector<int8_t> Tensor::to_vector<int8_t>() const;
template std::vector<bool> Tensor::to_vector<bool>() const;

double Tensor::item() const {
  KILN_CHECK(numel() == 1, "item", "tensor {} has {} elements; item() needs exactly one", shape_str(shape()), numel());
  if (!device().is_cpu()) return host_copy(*this).item();
  return load_as_double(data(), dtype(), 0);
}

bool Tensor::requires_grad() const { return node()->requires_grad; }

Tensor& Tensor::requires_grad_(bool on) {
  KILN_CHECK(!on || is_floating(dtype()), "requires_grad_", "only floating-point tensors can require gradients; {} is {}",
             shape_str(shape()), dtype_name(dtype()));
  var_->requires_grad = on;
  const NodePtr& n = node();
  if (on && (!n->grad_leaf || n->var.lock() != var_)) {
    // Gradients flow to this variable from here on: make its current value a leaf of its own.
    auto leaf = new_node(*n);
    leaf->id = Node::next_id();
    leaf->held = 0;
    if (!leaf->realized()) leaf->inputs = n->inputs;
    leaf->grad_leaf = true;
    leaf->requires_grad = true;
    leaf->var = var_;
    if (n->realized() || n->op == Op::Input) leaf->inputs.clear();
    var_->set(leaf);
  }
  if (!on) var_->node->requires_grad = false;
  return *this;
}

Tensor Tensor::grad() const {
  if (!var_ || !var_->grad) return {};
  return TensorAccess::from_var(var_->grad);
}

void Tensor::set_grad(const Tensor& g) {
  // A gradient is written into this tensor's slot, so it follows assign's rule: same shape,
  // device and dtype, no silent conversion.
  if (g.defined()) {
    KILN_CHECK(g.shape() == shape() && g.device() == device(), "set_grad",
               "gradient {} does not match the tensor {}; a gradient has its tensor's shape and device", g.str(), str());
    KILN_CHECK(g.dtype() == dtype(), "set_grad", "gradient {} is {} but the tensor {} is {}; convert it with .to({})",
               shape_str(g.shape()), dtype_name(g.dtype()), shape_str(shape()), dtype_name(dtype()),
               dtype_in_code(dtype()));
  }
  var_->grad = g.defined() ? TensorAccess::var(g) : nullptr;
}
void Tensor::zero_grad() { var_->grad.reset(); }

Tensor Tensor::detach() const {
  const NodePtr& n = node();
  auto copy = new_node(*n);
  copy->id = Node::next_id();
  copy->held = 0;
  copy->requires_grad = false;
  copy->grad_leaf = false;
  copy->var.reset();
  return Tensor(copy);
}

void Tensor::assign(const Tensor& value) {
  KILN_CHECK(value.shape() == shape() && value.device() == device(), "assign",
             "value {} does not match the variable {}", value.str(), str());
  // No silent conversion, narrowing or widening: a float64 update into a float32 parameter is
  // more often a mistake (a float64 constant, a wrong buffer) than a wish.
  KILN_CHECK(value.dtype() == dtype(), "assign",
             "value {} is {} but the variable {} is {}; assign keeps the variable's dtype and does not convert: "
             "assign value.to({}) if the conversion is meant",
             shape_str(value.shape()), dtype_name(value.dtype()), shape_str(shape()), dtype_name(dtype()),
             dtype_in_code(dtype()));
  NodePtr node = node_for_variable(*value.node(), var_);
  node->replaces = var_->node;
  var_->set(node);
  if (t_assign_recorder) t_assign_recorder->assigned_.push_back(var_);
  if (!flags().lazy) realize();
}

Tensor Tensor::reshape(Shape s) const { return kiln::reshape(*this, std::move(s)); }
Tensor Tensor::flatten(int64_t start, int64_t end) const { return kiln::flatten(*this, start, end); }
Tensor Tensor::permute(std::vector<int64_t> perm) const { return kiln::permute(*this, std::move(perm)); }
Tensor Tensor::transpose(int64_t a, int64_t b) const { return kiln::transpose(*this, a, b); }
Tensor Tensor::expand(Shape s) const { return kiln::expand(*this, std::move(s)); }
Tensor Tensor::unsqueeze(int64_t axis) const { return kiln::unsqueeze(*this, axis); }
Tensor Tensor::squeeze(int64_t axis) const { return kiln::squeeze(*this, axis); }
Tensor Tensor::slice(int64_t axis, int64_t start, int64_t stop, int64_t step) const {
  return kiln::slice(*this, axis, start, stop, step);
}
Tensor Tensor::cast(DType t) const { return kiln::cast(*this, t); }
Tensor Tensor::to(Device device) const { return kiln::to_device(*this, device); }
Tensor Tensor::to(DType dtype) const { return kiln::cast(*this, dtype); }

Tensor& Tensor::to_(Device device) {
  if (device == this->device()) return *this;
  Tensor moved = kiln::to_device(*this, device);
  Tensor g = grad();
  var_->set(node_for_variable(*moved.node(), var_));  // another device: nothing to update in place
  var_->low_copy.reset();                              // autocast's copy stays behind otherwise
  if (g.defined()) set_grad(kiln::to_device(g, device));
  return *this;
}
Tensor Tensor::sum(std::vector<int64_t> axes, bool keepdim) const { return kiln::sum(*this, std::move(axes), keepdim); }
Tensor Tensor::mean(std::vector<int64_t> axes, bool keepdim) const { return kiln::mean(*this, std::move(axes), keepdim); }
Tensor Tensor::max(std::vector<int64_t> axes, bool keepdim) const { return kiln::max(*this, std::move(axes), keepdim); }
Tensor Tensor::exp() const { return kiln::exp(*this); }
Tensor Tensor::log() const { return kiln::log(*this); }
Tensor Tensor::sqrt() const { return kiln::sqrt(*this); }
Tensor Tensor::abs() const { return kiln::abs(*this); }
Tensor Tensor::relu() const { return kiln::relu(*this); }
Tensor Tensor::sigmoid() const { return kiln::sigmoid(*this); }
Tensor Tensor::tanh() const { return kiln::tanh(*this); }
Tensor Tensor::pow(double e) const { return kiln::pow(*this, e); }
Tensor Tensor::matmul(const Tensor& other) const { return kiln::matmul(*this, other); }

}  // namespace kiln
