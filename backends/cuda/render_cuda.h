// The CUDA renderer: kernel IR -> one CUDA C++ translation unit for NVRTC (backends/cuda/nvrtc.h), from
// the same kernels the C++ renderer gets. Elementwise kernels are grid-stride loops over the
// output, reading and writing 16-byte vectors where operands are contiguous and aligned; row reductions fold one output per block (warp shuffles, then across warps), or one
// output per thread when the reduced extent is tiny; column reductions give each warp 32
// neighbouring outputs and 8 warps share the reduced rows; scatter kernels zero the output and
// then add with atomics. Values are computed in fp32 for fp16/bf16 data.
//
//   CudaSource cuda = render_cuda(schedule.kernels);
//   Cubin cubin = compile_cuda_cached(cuda.source, "sm_90");      // backends/cuda/nvrtc.h
//   for (const CudaLaunch& l : cuda.launches[k])                  // in order, on one stream:
//     launch l.function with <<<l.blocks, l.threads>>> and the arguments
//     (the buffers of cuda.parameter_slots[k], then sc, isc, err, scratch: device pointers; sc and
//     isc hold kernel k's own bound values, cuda.scalar_slots[k] and cuda.rand_slots[k])
// Kernels (and row groups) that differ only in the plan slots they touch share their functions
// (jit/canonical_kernel.h): their launches name the same functions.
#pragma once
#include <string>
#include <vector>

#include "jit/kernel_ir.h"

namespace kiln::cuda {

// One __global__ function launch of a kernel. Every function of a kernel takes the same
// parameters: a typed pointer per jit::Kernel::buffers entry (buffers[0], the output, first), then
// `const double* sc`, `const int64_t* isc` and `int64_t* err`, as the CPU kernels get them
// (render_cpp.h): the kernel's bound scalars and Rand seed/offset pairs in its own numbering, the
// out-of-range index slot;
// last `void* plan_scratch`, CudaSource::scratch_bytes of device memory that one kernel's functions
// pass between them (the parts of a split reduction), shared by all kernels of a plan since they
// run one after another.
struct CudaLaunch {
  std::string function;
  int64_t blocks = 1;  // grid-stride loops: any count >= 1 is correct; the launcher may clamp it
  int threads = 256;   // a multiple of 32, at most 256; the block size the function relies on
};

struct CudaSource {
  std::string source;                            // prelude + every function, for NVRTC
  std::string functions;                         // the functions alone (the emulator's prelude differs)
  std::vector<std::vector<CudaLaunch>> launches;  // per kernel of the plan; empty for library kernels
                                                  // and for the later phases of a row group
  // Per kernel with launches: the plan slots its functions take as buffer parameters, in order
  // (jit::Kernel::buffers, or a row group's union), and every parameter's type (then sc, isc, err,
  // scratch).
  std::vector<std::vector<int>> parameter_slots;
  std::vector<std::vector<std::string>> parameter_types;
  // Per kernel with launches: the plan's scalar slots of its sc[0], sc[1], ..., and the plan's
  // int-scalar slots of its Rand pairs isc[0, 1], isc[2, 3], ... (jit::KernelBinding).
  std::vector<std::vector<int>> scalar_slots;
  std::vector<std::vector<int>> rand_slots;
  int function_count = 0;                         // distinct functions, shared ones once
  int64_t scratch_bytes = 0;  // the most any kernel uses
};

// Row groups: runs of kernels over the same rows (reductions of one value per row, then one
// more row-wise kernel; softmax, layer norm, log-softmax) that one CUDA function can run a row
// at a time, a block per row, so each row is read from DRAM once and reread from cache. Returns,
// per kernel, the first kernel of its group (itself when alone). A plan that uses the groups must
// plan memory as if each group were one kernel: its buffers live from the group's start to its
// end, and no phase writes over its inputs.
std::vector<int> cuda_row_groups(const std::vector<jit::Kernel>& kernels);

// Source of all JIT kernels (not Matmul or Conv) of a plan; `groups` from cuda_row_groups (empty:
// every kernel alone). `share` false gives every kernel functions of its own.
CudaSource render_cuda(const std::vector<jit::Kernel>& kernels, const std::vector<int>& groups = {}, bool share = true);


}  // namespace kiln::cuda
