// The autocast policy table and where ops apply it. See ops/autocast.h.
#include "ops/autocast.h"

#include <mutex>

#include <fmt/format.h>

#include "core/autograd.h"
#include "core/flags.h"
#include "ops/primitive.h"

namespace kiln {

namespace {

// Products go low (that is where the time and the saved activations are); anything that sums
// many terms or reaches far into the exponent range stays float32, as in PyTorch's lists.
constexpr AutocastRule kRules[] = {
    {"matmul", CastPolicy::LowPrecision},   // also batched matmul and attention's two products
    {"linear", CastPolicy::LowPrecision},   // input, weight and bias
    {"conv2d", CastPolicy::LowPrecision},   // its backward passes follow the forward's type
    {"softmax", CastPolicy::Float32},
    {"log_softmax", CastPolicy::Float32},
    {"logsumexp", CastPolicy::Float32},
    {"layer_norm", CastPolicy::Float32},
    {"batch_norm", CastPolicy::Float32},    // statistics, running averages and the normalization
    {"cross_entropy", CastPolicy::Float32},
    {"nll_loss", CastPolicy::Float32},
    {"mse_loss", CastPolicy::Float32},
    {"l1_loss", CastPolicy::Float32},
    {"bce_with_logits", CastPolicy::Float32},
    {"exp", CastPolicy::Float32},
    {"log", CastPolicy::Float32},
    {"pow", CastPolicy::Float32},
    {"sum", CastPolicy::Float32},
    {"mean", CastPolicy::Float32},
    {"var", CastPolicy::Float32},
    {"add", CastPolicy::Promote},            // and every other binary elementwise op, and where
    {"gelu", CastPolicy::Inputs},            // composites that keep their inputs' type
    {"sigmoid", CastPolicy::Inputs},
    {"silu", CastPolicy::Inputs},
    {"avg_pool2d", CastPolicy::Inputs},
    {"max_pool2d", CastPolicy::Inputs},
};

const AutocastRule* find_rule(std::string_view op) {
  for (const AutocastRule& r : kRules)
    if (r.op == op) return &r;
  return nullptr;
}

void log_table_once() {
  static std::once_flag printed;
  std::call_once(printed, [] {
    fmt::print(stderr, "[kiln] autocast to {} (KILN_AMP / AutocastGuard); policy:\n{}", dtype_name(autocast_dtype()),
               autocast_table());
  });
}

// The copy of `t` in type `low`: for a parameter, made once per value of the parameter and kept
// on its variable, so every use in a step (and every step while the value stands) shares it.
Tensor low_copy(const Tensor& t, DType low) {
  const std::shared_ptr<Var>& v = TensorAccess::var(t);
  if (!v->requires_grad) return prim::cast(t, low);
  const NodePtr& value = v->node;
  const NodePtr& c = v->low_copy;
  const bool wants_grad = grad_enabled() && value->requires_grad;
  if (c && c->dtype == low && v->low_copy_of.lock() == value) {
    v->low_copy_used = true;
    // A pending copy made without gradients cannot serve a forward that needs them: made again.
    if (!wants_grad || (!c->realized() && c->requires_grad)) return Tensor(c);
    if (c->realized()) {
      // A copy an optimizer's update wrote: a Cast of the parameter whose value is already
      // there, so that autograd still reaches the parameter through it.
      auto node = new_node();
      node->op = Op::Cast;
      node->dtype = low;
      node->device = value->device;
      node->shape = value->shape;
      node->inputs = {value};
      node->storage = c->storage;
      node->requires_grad = true;
      return Tensor(node);
    }
  }
  Tensor copy = prim::cast(t, low);
  v->low_copy = copy.node();
  v->low_copy_of = value;
  v->low_copy_used = true;
  return copy;
}

}  // namespace

std::span<const AutocastRule> autocast_rules() { return kRules; }

CastPolicy autocast_policy(std::string_view op) {
  const AutocastRule* rule = find_rule(op);
  return rule ? rule->policy : CastPolicy::Inputs;
}

std::string_view policy_name(CastPolicy p) {
  switch (p) {
    case CastPolicy::LowPrecision: return "low precision";
    case CastPolicy::Float32: return "float32";
    case CastPolicy::Promote: return "widest input";
    case CastPolicy::Inputs: return "inputs' type";
  }
  return "?";
}

std::string autocast_table() {
  std::string out;
  for (const AutocastRule& r : kRules) out += fmt::format("  {:<16} {}\n", r.op, policy_name(r.policy));
  out += "  (other ops)      inputs' type\n";
  return out;
}

AutocastScope::AutocastScope(std::string_view op) {
  const DType mode = autocast_dtype();
  if (mode == DType::Float32) return;
  const AutocastRule* rule = find_rule(op);
  KILN_CHECK(rule != nullptr, "autocast", "internal: op `{}` opens an AutocastScope but has no rule in ops/autocast.cc",
             op);
  policy_ = rule->policy;
  active_ = true;
  low_ = policy_ == CastPolicy::LowPrecision ? mode : DType::Float32;
  if (flags().log >= 1) log_table_once();
  off_.emplace(false);
}

AutocastScope::~AutocastScope() = default;

Tensor AutocastScope::operator()(const Tensor& t) const {
  if (!active_ || !t.defined()) return t;
  const DType d = t.dtype();
  const bool half = d == DType::BFloat16 || d == DType::Float16;
  if (policy_ == CastPolicy::LowPrecision && (d == DType::Float32 || (half && d != low_))) return low_copy(t, low_);
  if (policy_ == CastPolicy::Float32 && half) return prim::cast(t, DType::Float32);
  return t;
}

Tensor refresh_autocast_copy(const Tensor& param, const Node* before) {
  const std::shared_ptr<Var>& v = TensorAccess::var(param);
  if (!v->low_copy || v->node.get() == before || v->low_copy_of.lock().get() != before) return {};
  if (!v->low_copy_used) {
    v->low_copy.reset();
    return {};
  }
  v->low_copy_used = false;
  NoGradGuard no_grad;
  AutocastGuard off(false);
  Tensor copy = prim::cast(param, v->low_copy->dtype);
  v->low_copy = copy.node();
  v->low_copy_of = v->node;
  return copy;
}

}  // namespace kiln
