// The CUDA half of kiln's JIT compilers: CUDA C++ from backends/cuda/render_cuda.h -> a cubin for one GPU
// architecture, through NVRTC (no GPU needed), cached in memory and on disk next to the CPU
// kernels (flags().cache_dir), keyed by source + arch + NVRTC version + options. Loading and
// launching the cubin is the CUDA runtime's job (never linked against libcuda here).
//
//   if (kiln::cuda::nvrtc_available()) {
//     CudaSource cuda = render_cuda(kernels);
//     auto cubin = kiln::cuda::compile_cuda_cached(cuda.source, "sm_90", cuda.function_count);
//     cubin->image;   // ELF bytes for cudaLibraryLoadData
//   }
#pragma once
#include <memory>
#include <string>

namespace kiln::cuda {

struct Cubin {
  std::string key;    // hash of the source, arch, NVRTC version and options
  std::string arch;   // e.g. "sm_90"
  std::string image;  // the cubin (an ELF file)
  std::string path;   // its file in the cache directory; "" when flags().disk_cache is off
  bool from_disk = false;
};

// Whether kiln was built with the CUDA toolkit (NVRTC linked in). Without it the functions below
// throw kiln::Error.
bool nvrtc_available();
// "13.0": NVRTC's version, part of every cache key.
std::string nvrtc_version();

// Compiles `source` (holding `function_count` __global__ functions) for `arch` ("sm_80",
// "sm_90", ...), or reuses the cubin from memory or from the disk cache. On a compile error throws
// kiln::Error with NVRTC's log and the path of the source, saved in the cache directory.
std::shared_ptr<const Cubin> compile_cuda_cached(const std::string& source, const std::string& arch,
                                                 int function_count);

// The PTX of `source` for a virtual architecture ("compute_90"), uncached: to inspect what the
// kernels compile to (vector loads, unrolled loops) without a GPU.
std::string cuda_ptx(const std::string& source, const std::string& virtual_arch);

// Forgets the cubins kept in memory (for tests).
void clear_cuda_memory_cache();

}  // namespace kiln::cuda
