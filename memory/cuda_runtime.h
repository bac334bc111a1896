// The CUDA runtime as kiln sees it: whether a device is there (never a crash when the driver or
// the GPU is missing), what it is, and synchronous host <-> device copies. Only the runtime
// library (cudart) is used, never libcuda directly. In a build without the CUDA toolkit every
// query answers "no device" with that reason.
//
//   if (kiln::cuda::available()) fmt::print("{}\n", kiln::cuda::device_info(0).name);
//   else fmt::print("no CUDA: {}\n", kiln::cuda::unavailable_reason());
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/device.h"

namespace kiln::cuda {

// True when this build has CUDA and the runtime reports at least one device.
bool available();
int device_count();  // 0 when unavailable
// Why available() is false, in words (e.g. the runtime's "CUDA driver version is insufficient");
// empty when it is true.
const std::string& unavailable_reason();

struct DeviceInfo {
  std::string name;
  int major = 0, minor = 0;  // compute capability
  int64_t total_memory = 0;  // bytes
  int multiprocessors = 0;
};
DeviceInfo device_info(int index);

// Throws kiln::Error naming `op` when `device` is a CUDA device this process cannot use (no CUDA
// in the build, no device, or an index past the last one); does nothing for the CPU.
void check_device(Device device, std::string_view op);

// Raw device memory (cudaMalloc / cudaFree). allocate returns nullptr when the device is out of
// memory; other failures throw.
void* device_malloc(int index, size_t bytes);
void device_free(int index, void* p);

// Synchronous copies of `bytes` between host memory and device `index`.
void copy_to_device(int index, void* device_dst, const void* host_src, size_t bytes);
void copy_to_host(int index, void* host_dst, const void* device_src, size_t bytes);

}  // namespace kiln::cuda
