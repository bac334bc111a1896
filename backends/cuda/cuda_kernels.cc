#include "backends/cuda/cuda_kernels.h"

#include <fmt/format.h>

#include "core/error.h"
#include "core/flags.h"
#include "backends/cuda/cuda_emulator.h"
#include "backends/cuda/cuda_runtime.h"

#if KILN_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace kiln::cuda {

namespace {

#if KILN_WITH_CUDA
void check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) KILN_FAIL("cuda", "{} failed: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e));
}
#endif

}  // namespace

std::string cuda_arch(int device) {
  cuda::DeviceInfo info = cuda::device_info(device);
  return fmt::format("sm_{}{}", info.major, info.minor);
}

CudaKernels::CudaKernels(const std::vector<jit::Kernel>& kernels, int device, const std::vector<int>& groups)
    : device_(device), source_(render_cuda(kernels, groups, flags().share_functions)) {
  cuda::check_device(Device::cuda(device), "CUDA kernels");
  functions_.resize(kernels.size());
  if (cuda::emulated()) {
    host_module_ = cpu::compile_cached(emulator::host_source(source_), source_.function_count);
    for (size_t k = 0; k < kernels.size(); ++k)
      for (const CudaLaunch& l : source_.launches[k])
        functions_[k].push_back({l, reinterpret_cast<const void*>(emulator::entry(*host_module_, l.function))});
    return;
  }
#if KILN_WITH_CUDA
  cubin_ = compile_cuda_cached(source_.source, cuda_arch(device), source_.function_count);
  check(cudaSetDevice(device), fmt::format("cudaSetDevice({})", device));
  cudaLibrary_t library = nullptr;
  check(cudaLibraryLoadData(&library, cubin_->image.data(), nullptr, nullptr, 0, nullptr, nullptr, 0),
        fmt::format("loading cubin {} ({})", cubin_->key, cubin_->path));
  library_ = library;
  for (size_t k = 0; k < kernels.size(); ++k)
    for (const CudaLaunch& l : source_.launches[k]) {
      cudaKernel_t handle = nullptr;
      check(cudaLibraryGetKernel(&handle, library, l.function.c_str()), "finding kernel " + l.function);
      functions_[k].push_back({l, reinterpret_cast<const void*>(handle)});
    }
#endif
}

CudaKernels::~CudaKernels() {
#if KILN_WITH_CUDA
  // A library must not be unloaded while launches of its kernels are still queued.
  if (library_) {
    cudaStreamSynchronize(static_cast<cudaStream_t>(cuda::stream(device_)));
    cudaLibraryUnload(static_cast<cudaLibrary_t>(library_));
  }
#endif
}

void CudaKernels::launch(size_t k, void** args) const {
  for (const Function& f : functions_[k]) {
    if (host_module_) {
      emulator::launch(reinterpret_cast<emulator::Entry>(const_cast<void*>(f.handle)), f.launch, args);
      continue;
    }
#if KILN_WITH_CUDA
    // A cudaKernel_t launches in the current device's context.
    check(cudaSetDevice(device_), fmt::format("cudaSetDevice({})", device_));
    const dim3 grid(static_cast<unsigned int>(f.launch.blocks)), block(static_cast<unsigned int>(f.launch.threads));
    check(cudaLaunchKernel(f.handle, grid, block, args, 0, static_cast<cudaStream_t>(cuda::stream(device_))),
          fmt::format("launching {} ({} x {})", f.launch.function, f.launch.blocks, f.launch.threads));
#endif
  }
}

}  // namespace kiln::cuda
