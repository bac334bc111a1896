// The CUDA backends: a GPU (kernels compiled by NVRTC, library kernels on cuBLASLt and cuDNN) and
// the host emulator that stands for cuda:0 without one (the same CUDA kernels built by the host
// compiler and run on fibers, library kernels on oneDNN, since its device memory is the host's).
#pragma once
#include "jit/backend.h"

namespace kiln::cuda {

class CudaBackend : public jit::Backend {
 public:
  const char* name() const override { return "cuda"; }
  std::vector<int> row_groups(const std::vector<jit::Kernel>& kernels) const override;
  std::unique_ptr<jit::CompiledKernels> compile(const std::vector<jit::Kernel>& kernels, Device device,
                                                const std::vector<int>& groups) const override;
  void run_library(const jit::Kernel& kernel, void* const* ptrs, Device device) const override;
  void synchronize(Device device) const override;
  bool offloads() const override { return true; }
  // A GPU's offload copies run on its copy stream, from pinned memory; the emulator's at once.
  std::unique_ptr<jit::TransferQueue> transfers(Device device) const override;
  std::shared_ptr<void> allocate_host(size_t bytes) const override;
};

// Differs from a GPU only where the host stands in for it: library calls. Kernels, memory and
// copies go through the CUDA runtime layer, which runs them on the emulator (cuda::emulated()).
class CudaEmulatorBackend final : public CudaBackend {
 public:
  const char* name() const override { return "cuda-emulator"; }
  void run_library(const jit::Kernel& kernel, void* const* ptrs, Device device) const override;
};

}  // namespace kiln::cuda
