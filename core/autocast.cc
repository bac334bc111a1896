#include "core/autocast.h"

#include "core/error.h"
#include "core/flags.h"

namespace kiln {

namespace {
constexpr int kFollowFlags = -1;
// The innermost guard's type as an int (DType), or kFollowFlags outside every guard.
thread_local int t_mode = kFollowFlags;

DType from_flags() {
  switch (flags().amp) {
    case AmpMode::BFloat16: return DType::BFloat16;
    case AmpMode::Float16: return DType::Float16;
    case AmpMode::None: break;
  }
  return DType::Float32;
}
}  // namespace

DType autocast_dtype() { return t_mode == kFollowFlags ? from_flags() : static_cast<DType>(t_mode); }

AutocastGuard::AutocastGuard(DType low) : previous_(t_mode) {
  KILN_CHECK(low == DType::BFloat16 || low == DType::Float16 || low == DType::Float32, "AutocastGuard",
             "autocast runs in bfloat16 or float16 (float32 turns it off), not {}", dtype_name(low));
  t_mode = static_cast<int>(low);
}

AutocastGuard::AutocastGuard(bool enabled) : previous_(t_mode) {
  DType flagged = from_flags();
  t_mode = static_cast<int>(!enabled ? DType::Float32 : flagged != DType::Float32 ? flagged : DType::BFloat16);
}

AutocastGuard::~AutocastGuard() { t_mode = previous_; }

}  // namespace kiln
