#include "backends/cpu/cpu_backend.h"

#include "backends/cpu/compiler.h"
#include "backends/cpu/conv_onednn.h"
#include "backends/cpu/matmul_onednn.h"
#include "backends/cpu/render_cpp.h"

namespace kiln::cpu {

namespace {

// Kernels run on the calling thread's OpenMP team; the bound scalars are read from host memory.
class HostRun final : public jit::KernelRun {
 public:
  HostRun(const std::vector<KernelFn>& fns, const std::vector<jit::Kernel>& kernels,
          const std::vector<double>& scalars, const std::vector<int64_t>& ints)
      : fns_(fns), kernels_(kernels), scalars_(scalars), ints_(ints) {}
  void launch(size_t k, void* const* ptrs) override {
    int64_t error[2] = {0, 0};
    fns_[k](ptrs, scalars_.data(), ints_.data(), error);
    if (error[1] != 0) jit::throw_index_error(error[0], kernels_[k]);
  }
  void check_errors() override {}  // launch has thrown already

 private:
  const std::vector<KernelFn>& fns_;
  const std::vector<jit::Kernel>& kernels_;
  const std::vector<double>& scalars_;
  const std::vector<int64_t>& ints_;
};

class HostKernels final : public jit::CompiledKernels {
 public:
  explicit HostKernels(const std::vector<jit::Kernel>& kernels, int jit_kernels) : kernels_(kernels) {
    module_ = compile_cached(render_cpp(kernels), jit_kernels);
    fns_.assign(kernels.size(), nullptr);
    for (size_t k = 0; k < kernels.size(); ++k)
      if (!jit::is_library(kernels[k].kind))
        fns_[k] = reinterpret_cast<KernelFn>(module_->symbol(kernels[k].name));
  }
  std::unique_ptr<jit::KernelRun> start(const std::vector<double>& scalars,
                                        const std::vector<int64_t>& ints) const override {
    return std::make_unique<HostRun>(fns_, kernels_, scalars, ints);
  }

 private:
  const std::vector<jit::Kernel>& kernels_;  // the plan's, which owns this object
  std::shared_ptr<CompiledModule> module_;
  std::vector<KernelFn> fns_;  // per kernel; null for library calls
};

}  // namespace

std::unique_ptr<jit::CompiledKernels> CpuBackend::compile(const std::vector<jit::Kernel>& kernels, Device,
                                                          const std::vector<int>&) const {
  int jit_kernels = 0;
  for (const jit::Kernel& k : kernels) jit_kernels += !jit::is_library(k.kind);
  if (jit_kernels == 0) return nullptr;
  return std::make_unique<HostKernels>(kernels, jit_kernels);
}

void run_onednn(const jit::Kernel& k, void* const* ptrs) {
  if (k.kind == jit::KernelKind::QuantizedMatmul) {
    const jit::QuantizedMatmulCall& q = k.quantized;
    auto at = [&](int buffer) { return ptrs[k.buffers[static_cast<size_t>(buffer)].slot]; };
    onednn_quantized_matmul(at(q.a_buffer), at(q.b_buffer), static_cast<float*>(ptrs[k.buffers[0].slot]), q.M, q.K,
                            q.N, q.b_packed);
    return;
  }
  const jit::LibraryOperands op = jit::library_operands(k, ptrs);
  if (k.kind == jit::KernelKind::Matmul) {
    const jit::MatmulCall& mm = k.matmul;
    onednn_matmul(op.dtype, op.a, mm.a_strides, op.b, mm.b_strides, op.out, mm.batch, mm.M, mm.K, mm.N);
  } else {
    onednn_conv2d(k.conv.pass, op.dtype, k.conv.geometry, op.a, op.b, op.out);
  }
}

void CpuBackend::run_library(const jit::Kernel& kernel, void* const* ptrs, Device) const { run_onednn(kernel, ptrs); }

}  // namespace kiln::cpu
