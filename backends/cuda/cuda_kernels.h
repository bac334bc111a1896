// The JIT kernels of one plan, ready to launch on one CUDA device: rendered (backends/cuda/render_cuda.h),
// compiled by NVRTC for the device's architecture (backends/cuda/nvrtc.h) and loaded through the CUDA
// runtime's library API (no libcuda link), or built for the host emulator (backends/cuda/cuda_emulator.h)
// when cuda::emulated(). Launches are queued on cuda::stream(device).
//
//   CudaKernels kernels(schedule.kernels, 0);
//   void* args[] = {&out, &in, &sc, &isc, &err, &scratch};  // pointers to device pointers, in
//   kernels.launch(k, args);                                // the order of parameter_slots(k)
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "backends/cpu/compiler.h"
#include "jit/kernel_ir.h"
#include "backends/cuda/nvrtc.h"
#include "backends/cuda/render_cuda.h"

namespace kiln::cuda {

class CudaKernels {
 public:
  // Renders, compiles (or finds in the caches) and loads the JIT kernels among `kernels`, with
  // the row groups `groups` (cuda_row_groups; empty: none).
  CudaKernels(const std::vector<jit::Kernel>& kernels, int device, const std::vector<int>& groups = {});
  ~CudaKernels();
  CudaKernels(const CudaKernels&) = delete;
  CudaKernels& operator=(const CudaKernels&) = delete;

  // Queues every function of kernel `k` in order (none for a later phase of a row group); `args`
  // as for cudaLaunchKernel: the buffers of parameter_slots(k), then sc, isc, err and a scratch
  // buffer of scratch_bytes().
  void launch(size_t k, void** args) const;
  const std::vector<int>& parameter_slots(size_t k) const { return source_.parameter_slots[k]; }
  // The plan's scalar slots of kernel k's sc[0], sc[1], ... and int-scalar slots of its Rand pairs.
  const std::vector<int>& scalar_slots(size_t k) const { return source_.scalar_slots[k]; }
  const std::vector<int>& rand_slots(size_t k) const { return source_.rand_slots[k]; }
  int64_t scratch_bytes() const { return source_.scratch_bytes; }
  int function_count() const { return source_.function_count; }

 private:
  struct Function {
    CudaLaunch launch;
    const void* handle = nullptr;  // cudaKernel_t, or the emulator's Entry
  };
  int device_;
  CudaSource source_;
  std::vector<std::vector<Function>> functions_;  // per kernel
  std::shared_ptr<const Cubin> cubin_;            // a GPU's
  void* library_ = nullptr;                       // its cudaLibrary_t
  std::shared_ptr<cpu::CompiledModule> host_module_;   // the emulator's
};

// "sm_90" for a device of compute capability 9.0.
std::string cuda_arch(int device);

}  // namespace kiln::cuda
