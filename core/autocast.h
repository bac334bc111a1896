// The autocast mode of the calling thread: the low-precision float type that autocast casts ops
// to (ops/autocast.h has the policy), from the innermost AutocastGuard or else flags().amp.
//
//   kiln::AutocastGuard amp(kiln::DType::BFloat16);  // this thread, until the guard ends
//   { kiln::AutocastGuard off(false); ... }           // float32 again inside (guards nest)
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace kiln {

// BFloat16 or Float16 while autocast is on, Float32 while it is off.
DType autocast_dtype();
inline bool autocast_enabled() { return autocast_dtype() != DType::Float32; }

class AutocastGuard {
 public:
  // BFloat16 or Float16 turns autocast on with that type, Float32 turns it off; any other dtype
  // throws kiln::Error.
  explicit AutocastGuard(DType low);
  // true: on with bfloat16 (PyTorch's CPU default; flags().amp's type when it names one);
  // false: off.
  explicit AutocastGuard(bool enabled);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  int previous_;
};

}  // namespace kiln
