// The CUDA runtime queries and copies of cuda_runtime.h; stubs answering "no device" when the
// build has no CUDA toolkit (KILN_WITH_CUDA=0).
#include "memory/cuda_runtime.h"

#include <mutex>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"

#if KILN_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace kiln::cuda {

namespace {

struct Discovery {
  int count = 0;
  std::string reason;
  std::vector<DeviceInfo> devices;
};

// Asked once: the answer cannot change while the process runs.
const Discovery& discovery() {
  static const Discovery d = [] {
    Discovery out;
#if KILN_WITH_CUDA
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      out.reason = fmt::format("the CUDA runtime reports {} ({})", cudaGetErrorString(e), cudaGetErrorName(e));
      cudaGetLastError();  // clear the sticky error so later queries start clean
      return out;
    }
    if (n == 0) {
      out.reason = "the CUDA runtime finds no device";
      return out;
    }
    for (int i = 0; i < n; ++i) {
      cudaDeviceProp p{};
      if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
      out.devices.push_back({p.name, p.major, p.minor, static_cast<int64_t>(p.totalGlobalMem), p.multiProcessorCount});
    }
    out.count = static_cast<int>(out.devices.size());
    if (out.count == 0) out.reason = "no CUDA device answered a properties query";
#else
    out.reason = "kiln was built without the CUDA toolkit (CMake did not find CUDAToolkit)";
#endif
    return out;
  }();
  return d;
}

#if KILN_WITH_CUDA
void check(cudaError_t e, std::string_view what) {
  if (e != cudaSuccess)
    KILN_FAIL("cuda", "{} failed: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

void use_device(int index) { check(cudaSetDevice(index), fmt::format("cudaSetDevice({})", index)); }
#endif

}  // namespace

bool available() { return discovery().count > 0; }
int device_count() { return discovery().count; }
const std::string& unavailable_reason() { return discovery().reason; }

DeviceInfo device_info(int index) {
  check_device(Device::cuda(index), "cuda::device_info");
  return discovery().devices[static_cast<size_t>(index)];
}

void check_device(Device device, std::string_view op) {
  if (device.is_cpu()) return;
  KILN_CHECK(available(), op, "{} was requested but CUDA is not available: {}. Use the cpu (unset "
             "KILN_USE_CUDA, or Device::cpu()) on this machine", device.str(), unavailable_reason());
  KILN_CHECK(device.index >= 0 && device.index < device_count(), op, "{} does not exist: this machine has {} "
             "CUDA device(s)", device.str(), device_count());
}

#if KILN_WITH_CUDA
void* device_malloc(int index, size_t bytes) {
  check_device(Device::cuda(index), "cuda::device_malloc");
  use_device(index);
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky, but leave no error behind for the next call
    return nullptr;
  }
  check(e, fmt::format("cudaMalloc of {} bytes on cuda:{}", bytes, index));
  return p;
}

void device_free(int index, void* p) {
  use_device(index);
  check(cudaFree(p), fmt::format("cudaFree on cuda:{}", index));
}

void copy_to_device(int index, void* device_dst, const void* host_src, size_t bytes) {
  use_device(index);
  check(cudaMemcpy(device_dst, host_src, bytes, cudaMemcpyHostToDevice), "copy to device");
}

void copy_to_host(int index, void* host_dst, const void* device_src, size_t bytes) {
  use_device(index);
  check(cudaMemcpy(host_dst, device_src, bytes, cudaMemcpyDeviceToHost), "copy to host");
}
#else
void* device_malloc(int index, size_t) {
  check_device(Device::cuda(index), "cuda::device_malloc");
  return nullptr;
}
void device_free(int index, void*) { check_device(Device::cuda(index), "cuda::device_free"); }
void copy_to_device(int index, void*, const void*, size_t) { check_device(Device::cuda(index), "cuda::copy"); }
void copy_to_host(int index, void*, const void*, size_t) { check_device(Device::cuda(index), "cuda::copy"); }
#endif

}  // namespace kiln::cuda
