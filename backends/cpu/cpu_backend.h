// The CPU backend: JIT kernels rendered as C++ (backends/cpu/render_cpp.h) and built by the host
// compiler (backends/cpu/compiler.h), library kernels on oneDNN, memory the host's.
#pragma once
#include "jit/backend.h"

namespace kiln::cpu {

class CpuBackend : public jit::Backend {
 public:
  const char* name() const override { return "cpu"; }
  std::unique_ptr<jit::CompiledKernels> compile(const std::vector<jit::Kernel>& kernels, Device device,
                                                const std::vector<int>& groups) const override;
  void run_library(const jit::Kernel& kernel, void* const* ptrs, Device device) const override;
  bool runs_matmul_tiles() const override { return true; }
  void synchronize(Device) const override {}
};

// A library kernel on host memory (oneDNN's matmul or convolution, the pooling arg-max of
// backends/cpu/pool_cpu.h); also the CUDA emulator's, whose device memory is host memory.
void run_host_library(const jit::Kernel& kernel, void* const* ptrs);

}  // namespace kiln::cpu
