// One compiled function for structurally identical kernels. The layers of a network lower to
// kernels that differ only in which plan slots they touch (buffers, bound scalars, Rand
// seeds); their canonical forms read everything through kernel-local indices, so the renderers
// give them the same text, and a backend compiles that text once and binds each kernel's slots
// at launch. Sizes, constants, dtypes and index arithmetic stay in the text: kernels differing
// in any of them keep distinct functions (the C++ renderer leaves a flat kernel's extent out of
// its text: backends/cpu/render_cpp.h runtime_extent).
//
//   std::vector<KernelBinding> bindings;
//   FunctionSharing sharing = share_functions(kernels, [&](const Kernel& canonical) {
//     return render(canonical);            // a backend's renderer; names the function kCanonicalName
//   }, &bindings);
//   for (const std::string& text : sharing.texts) source += rename_function(text, name);
//   // launch kernel k: buffer b is ptrs[bindings[k].buffer_slots[b]], scalar i is
//   // scalars[bindings[k].scalar_slots[i]], Rand pair j is int_scalars[bindings[k].rand_slots[j] + 0/1]
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "jit/kernel_ir.h"

namespace kiln::jit {

// The name a canonical kernel carries; renderers write it where a function's name goes (CUDA
// adds suffixes such as _parts), and rename_function puts the real name in its place.
inline constexpr const char* kCanonicalName = "KILN_CANONICAL_FUNCTION";

// Where a canonical kernel's local indices point in its plan.
struct KernelBinding {
  std::vector<int> buffer_slots;  // per kernel buffer (Kernel::buffers order): the plan slot
  std::vector<int> scalar_slots;  // per local bound scalar: the plan's scalar slot
  std::vector<int> rand_slots;    // per local Rand pair: the plan's int-scalar slot of its seed
};

// `k` reading through local indices: buffer slots, bound scalars and Rand pairs (0, 2, ...)
// numbered in order of first use; named kCanonicalName, with no summary. `binding` (if not null)
// receives the plan slots they stand for, after those it holds already: kernels made canonical
// with one binding share its numbering (a CUDA row group, one function for several kernels).
// Alone, a kernel's buffer b is local slot b.
Kernel canonical_kernel(const Kernel& k, KernelBinding* binding);

// Which kernels share a function: the distinct texts of the canonical forms of `kernels` (library
// kernels have none), in order of first use.
struct FunctionSharing {
  std::vector<std::string> texts;  // per function: its canonical text
  std::vector<int> first_kernel;   // per function: the first kernel it runs (its name is this kernel's)
  std::vector<int> function_of;    // per kernel: its function, -1 for library kernels
};

// Renders the canonical form of every JIT kernel with `render` and groups equal texts; with
// `share` false every kernel keeps a function of its own (the reference the sharing is tested
// against). `bindings` (if not null) receives every kernel's binding (empty for library kernels).
FunctionSharing share_functions(const std::vector<Kernel>& kernels,
                                const std::function<std::string(const Kernel&)>& render, bool share,
                                std::vector<KernelBinding>* bindings);

// `text` with every kCanonicalName replaced by `name`.
std::string rename_function(const std::string& text, const std::string& name);

}  // namespace kiln::jit
