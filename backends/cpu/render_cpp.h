// The C++ renderer: kernel IR -> one C++ translation unit for the host compiler. OpenMP over the
// outer loop, inner loops written so the compiler can vectorize them.
#pragma once
#include <string>
#include <vector>

#include "jit/kernel_ir.h"

namespace kiln::cpu {

// Every generated kernel has this signature; `buffers` is indexed by plan slot, `error` receives
// an out-of-range index (error[0] = value, error[1] = 1) instead of reading out of bounds.
using KernelFn = void (*)(void* const* buffers, const double* scalars, const int64_t* int_scalars, int64_t* error);

// Source of all JIT kernels (not Matmul) of a plan, each an extern "C" function named k.name.
std::string render_cpp(const std::vector<jit::Kernel>& kernels);

}  // namespace kiln::cpu
