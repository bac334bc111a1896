#include "jit/canonical_kernel.h"

#include <algorithm>
#include <unordered_map>

namespace kiln::jit {

namespace {

// The position of `slot` in `slots`, appended when new.
int local_index(std::vector<int>& slots, int slot) {
  auto found = std::find(slots.begin(), slots.end(), slot);
  if (found != slots.end()) return static_cast<int>(found - slots.begin());
  slots.push_back(slot);
  return static_cast<int>(slots.size()) - 1;
}

}  // namespace

Kernel canonical_kernel(const Kernel& k, KernelBinding* binding) {
  KernelBinding own;
  KernelBinding& local = binding != nullptr ? *binding : own;
  Kernel canonical = k;
  canonical.name = kCanonicalName;
  canonical.summary.clear();
  canonical.label = 0;
  // A kernel lists each slot once, so alone its buffer b becomes local slot b.
  for (KernelBuffer& b : canonical.buffers) b.slot = local_index(local.buffer_slots, b.slot);
  for (Expr& e : canonical.exprs) {
    if (e.kind == Expr::Kind::Scalar) e.slot = local_index(local.scalar_slots, e.slot);
    // A Rand value reads the pair (seed, offset) at slot, slot + 1: local pairs are 0, 2, 4, ...
    if (e.kind == Expr::Kind::Rand) e.slot = 2 * local_index(local.rand_slots, e.slot);
  }
  return canonical;
}

FunctionSharing share_functions(const std::vector<Kernel>& kernels,
                                const std::function<std::string(const Kernel&)>& render, bool share,
                                std::vector<KernelBinding>* bindings) {
  FunctionSharing sharing;
  sharing.function_of.assign(kernels.size(), -1);
  if (bindings != nullptr) bindings->assign(kernels.size(), {});
  // Keyed by the whole text, not a hash of it: two kernels share a function only when the
  // compiler would see the same code.
  std::unordered_map<std::string, int> function_of_text;
  for (size_t k = 0; k < kernels.size(); ++k) {
    if (is_library(kernels[k].kind)) continue;
    std::string text = render(canonical_kernel(kernels[k], bindings ? &(*bindings)[k] : nullptr));
    if (share) {
      auto found = function_of_text.find(text);
      if (found != function_of_text.end()) {
        sharing.function_of[k] = found->second;
        continue;
      }
      function_of_text.emplace(text, static_cast<int>(sharing.texts.size()));
    }
    sharing.function_of[k] = static_cast<int>(sharing.texts.size());
    sharing.first_kernel.push_back(static_cast<int>(k));
    sharing.texts.push_back(std::move(text));
  }
  return sharing;
}

std::string rename_function(const std::string& text, const std::string& name) {
  const std::string placeholder = kCanonicalName;
  std::string renamed;
  renamed.reserve(text.size());
  size_t from = 0;
  for (size_t at = text.find(placeholder); at != std::string::npos; at = text.find(placeholder, from)) {
    renamed.append(text, from, at - from);
    renamed += name;
    from = at + placeholder.size();
  }
  renamed.append(text, from, std::string::npos);
  return renamed;
}

}  // namespace kiln::jit
