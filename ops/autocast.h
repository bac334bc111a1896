// Autocast's policy: which ops run in the low-precision float type (bfloat16 / float16) and which
// in float32, applied as each op is recorded (core/autocast.h says when autocast is on). The casts
// are ordinary Cast nodes, so the JIT fuses them into the kernels around them; gradients flow back
// through them in the dtype of each forward value, and a float32 parameter's gradient arrives in
// float32. One table, printed by KILN_LOG=1 and readable from code:
//
//   for (const kiln::AutocastRule& r : kiln::autocast_rules()) ...
//   kiln::autocast_policy("softmax");  // CastPolicy::Float32
#pragma once
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "core/autocast.h"
#include "core/tensor.h"

namespace kiln {

enum class CastPolicy : uint8_t {
  LowPrecision,  // float32 inputs cast to the autocast type (libraries accumulate in float32)
  Float32,       // bfloat16 / float16 inputs cast to float32
  Promote,       // all inputs promoted to the widest one (ordinary dtype promotion)
  Inputs,        // runs in its inputs' type; the ops a composite is made of are not autocast
};

struct AutocastRule {
  std::string_view op;
  CastPolicy policy;
};

// Every op autocast knows, in one table. Ops not listed run in their inputs' types. Integer,
// boolean and float64 tensors are never cast.
std::span<const AutocastRule> autocast_rules();
// The policy of `op` (a name of the table, e.g. "matmul"); Inputs for ops it does not list.
CastPolicy autocast_policy(std::string_view op);
std::string_view policy_name(CastPolicy p);
// The table as text, one "op: policy" line per rule.
std::string autocast_table();

// The entry of an op that has a rule: `AutocastScope amp("softmax"); Tensor x = amp(x_in);`
// casts each argument by the op's policy (when autocast is on) and keeps autocast off while the
// op records its body, whose inner ops (a softmax's exp and sum) are part of it, not ops of their
// own. Costs a thread-local read when autocast is off.
class AutocastScope {
 public:
  explicit AutocastScope(std::string_view op);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;
  // `t` cast by the policy; undefined stays undefined. A parameter's low-precision copy is made
  // once per value and reused by every use (see refresh_autocast_copy).
  Tensor operator()(const Tensor& t) const;
  // The type the op's floating inputs are cast to, or Float32 when autocast is off or the
  // policy casts nothing.
  DType low() const { return low_; }

 private:
  CastPolicy policy_ = CastPolicy::Inputs;
  DType low_ = DType::Float32;
  bool active_ = false;
  std::optional<AutocastGuard> off_;
};

// For optimizers, after `param.assign(new value)`: when autocast copied the value the parameter
// had before (node `before`), records the copy of the new value and returns it, to be realized in
// the same plan as the update. The JIT writes it from the update's own kernel (a second output),
// so the next forward reads a ready copy and makes none. Undefined when there is nothing to do.
// A copy no forward has used since the last refresh is dropped instead (autocast was turned off:
// nothing keeps writing copies nobody reads).
Tensor refresh_autocast_copy(const Tensor& param, const Node* before);

}  // namespace kiln
