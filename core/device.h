// Where a tensor lives: the CPU, or (when compiled in and present) a CUDA device; and which CUDA
// devices this process can use (never a crash when the driver or the GPU is missing).
//
//   kiln::Device d = kiln::cuda::available() ? kiln::Device::cuda(0) : kiln::Device::cpu();
//   if (!kiln::cuda::available()) fmt::print("no CUDA: {}\n", kiln::cuda::unavailable_reason());
//   else fmt::print("{}\n", kiln::cuda::device_info(0).name);
#pragma once
#include <cstdint>
#include <string>

namespace kiln {

struct Device {
  enum class Kind : unsigned char { CPU, CUDA };
  Kind kind = Kind::CPU;
  int index = 0;

  static Device cpu() { return {}; }
  static Device cuda(int i = 0) { return {Kind::CUDA, i}; }
  bool is_cpu() const { return kind == Kind::CPU; }
  bool is_cuda() const { return kind == Kind::CUDA; }
  bool operator==(const Device&) const = default;
  std::string str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
};

}  // namespace kiln

// The CUDA devices as kiln sees them. In a build without the CUDA toolkit every query answers
// "no device" with that reason. With no GPU and flags().cuda_emulator (KILN_CUDA_EMULATOR=1),
// cuda:0 is a host emulator: the CUDA code paths run, slowly, on any machine; a real device wins.
// (Implemented with the CUDA runtime in backends/cuda/cuda_runtime.cc.)
namespace kiln::cuda {

// True when this build has CUDA and the runtime reports at least one device, or the emulator is on.
bool available();
// True when cuda:0 is the host emulator (no GPU here, flags().cuda_emulator set at first query).
bool emulated();
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

}  // namespace kiln::cuda
