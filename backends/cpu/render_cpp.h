// The C++ renderer: kernel IR -> C++ functions for the host compiler. OpenMP over the outer loop,
// inner loops written so the compiler can vectorize them. Kernels that differ only in which plan
// slots they touch (the same layer repeated) share one function (jit/canonical_kernel.h).
//
//   CppSource cpp = render_cpp(plan_kernels);
//   auto module = compile_cached(cpp.translation_units(2), kernels, cpp.functions.size());  // compiler.h
//   KernelFn f = (KernelFn)module->symbol(cpp.names[cpp.function_of[k]]);
//   f(local buffers, local scalars, local Rand pairs, error);              // per cpp.bindings[k]
#pragma once
#include <string>
#include <vector>

#include "jit/canonical_kernel.h"
#include "jit/kernel_ir.h"

namespace kiln::cpu {

// Every generated function has this signature. Its arguments are the kernel's own, gathered by
// its binding: `buffers[b]` is the plan buffer of Kernel::buffers[b], `scalars[i]` its i-th bound
// scalar, `int_scalars[2j]`, `[2j + 1]` its j-th Rand seed and offset. `error` receives an
// out-of-range index (error[0] = value, error[1] = 1) instead of reading out of bounds.
using KernelFn = void (*)(void* const* buffers, const double* scalars, const int64_t* int_scalars, int64_t* error);

// The JIT kernels (not library calls) of a plan as C++: a prelude and one extern "C" function per
// distinct canonical kernel, named after the first kernel it runs.
struct CppSource {
  std::string prelude;                         // helpers every translation unit needs, first
  std::vector<std::string> functions;          // per function: its text
  std::vector<std::string> names;              // per function: its symbol
  std::vector<size_t> costs;                   // per function: the compiler's work, in characters of text
  std::vector<int> function_of;                // per plan kernel: its function, -1 for library calls
  std::vector<jit::KernelBinding> bindings;    // per plan kernel: where its local indices point
  std::vector<int64_t> extents;                // per plan kernel: the extent its function reads after the Rand pairs, or -1
  // The functions in up to `count` translation units of about equal cost, each after the prelude
  // (for as many compiler processes at once; a unit keeps its functions in their order); one
  // when `count` is 1.
  std::vector<std::string> translation_units(int count) const;
};

// A kernel of one loop over whole buffers (an elementwise kernel, a whole sum): its function takes
// the loop's extent at run time, so kernels that differ only in size (an optimizer's update of
// each parameter) share it.
bool runtime_extent(const jit::Kernel& k);

// Outputs of flat kernels with at least this many bytes are written with non-temporal stores:
// flags().stream_bytes, or when it is -1 the last-level cache's size (0: never).
int64_t stream_threshold_bytes();

// `share` false gives every kernel a function of its own (the reference sharing is tested against).
CppSource render_cpp(const std::vector<jit::Kernel>& kernels, bool share = true);

}  // namespace kiln::cpu
