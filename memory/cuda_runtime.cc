// The CUDA runtime queries and copies of cuda_runtime.h, the emulator's host-memory versions of
// them, and answers of "no device" when the build has no CUDA toolkit (KILN_WITH_CUDA=0).
#include "memory/cuda_runtime.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "core/flags.h"

#if KILN_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace kiln::cuda {

namespace {

struct Discovery {
  int count = 0;
  bool emulated = false;
  std::string reason;
  std::vector<DeviceInfo> devices;
};

// No GPU: cuda:0 is the host emulator when asked for, else the reason stands.
void fall_back_to_emulator(Discovery& d) {
  if (!flags().cuda_emulator) return;
  d = Discovery{};
  d.count = 1;
  d.emulated = true;
  d.devices.push_back({"kiln CUDA emulator (host)", 9, 0, int64_t{1} << 34, 1});
}

// Asked once: the answer cannot change while the process runs. Never destroyed: plans cached
// in other static objects still ask about their device while the process exits.
const Discovery& discovery() {
  static const Discovery& d = *new Discovery([] {
    Discovery out;
#if KILN_WITH_CUDA
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      out.reason = fmt::format("the CUDA runtime reports {} ({})", cudaGetErrorString(e), cudaGetErrorName(e));
      cudaGetLastError();  // clear the sticky error so later queries start clean
      fall_back_to_emulator(out);
      return out;
    }
    if (n == 0) {
      out.reason = "the CUDA runtime finds no device";
      fall_back_to_emulator(out);
      return out;
    }
    for (int i = 0; i < n; ++i) {
      cudaDeviceProp p{};
      if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
      out.devices.push_back({p.name, p.major, p.minor, static_cast<int64_t>(p.totalGlobalMem), p.multiProcessorCount});
    }
    out.count = static_cast<int>(out.devices.size());
    if (out.count == 0) {
      out.reason = "no CUDA device answered a properties query";
      fall_back_to_emulator(out);
    }
#else
    out.reason = "kiln was built without the CUDA toolkit (CMake did not find CUDAToolkit)";
    fall_back_to_emulator(out);
#endif
    return out;
  }());
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
bool emulated() { return discovery().emulated; }
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

// The emulator's device memory is host memory, aligned as cudaMalloc's (256 bytes), and no more
// than the emulated device's total_memory is handed out (as a GPU runs out, and so that a
// huge request fails instead of being overcommitted by the host).
namespace {
constexpr size_t kEmulatorAlignment = 256;
std::atomic<int64_t> g_emulated_in_use{0};
size_t emulated_size(size_t bytes) { return (bytes + kEmulatorAlignment - 1) / kEmulatorAlignment * kEmulatorAlignment; }
}  // namespace

void* device_malloc(int index, size_t bytes) {
  check_device(Device::cuda(index), "cuda::device_malloc");
  if (emulated()) {
    const auto size = static_cast<int64_t>(emulated_size(bytes));
    if (g_emulated_in_use.fetch_add(size) + size > discovery().devices[0].total_memory) {
      g_emulated_in_use -= size;
      return nullptr;
    }
    void* p = std::aligned_alloc(kEmulatorAlignment, static_cast<size_t>(size));
    if (!p) g_emulated_in_use -= size;
    return p;
  }
#if KILN_WITH_CUDA
  use_device(index);
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky, but leave no error behind for the next call
    return nullptr;
  }
  check(e, fmt::format("cudaMalloc of {} bytes on cuda:{}", bytes, index));
  return p;
#else
  return nullptr;
#endif
}

void device_free(int index, void* p, size_t bytes) {
  if (emulated()) {
    g_emulated_in_use -= static_cast<int64_t>(emulated_size(bytes));
    return std::free(p);
  }
#if KILN_WITH_CUDA
  use_device(index);
  check(cudaFree(p), fmt::format("cudaFree on cuda:{}", index));
#else
  (void)p, (void)bytes;
  check_device(Device::cuda(index), "cuda::device_free");
#endif
}

void* stream(int index) {
  check_device(Device::cuda(index), "cuda::stream");
  if (emulated()) return nullptr;
#if KILN_WITH_CUDA
  // One non-blocking stream per device, never destroyed (storages freed at exit may still queue).
  static std::mutex& mutex = *new std::mutex;
  static std::vector<cudaStream_t>& streams = *new std::vector<cudaStream_t>(static_cast<size_t>(device_count()), nullptr);
  std::lock_guard<std::mutex> lock(mutex);
  cudaStream_t& s = streams[static_cast<size_t>(index)];
  if (!s) {
    use_device(index);
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), fmt::format("creating a stream on cuda:{}", index));
  }
  return s;
#else
  return nullptr;
#endif
}

void synchronize(int index) {
  void* s = stream(index);
  if (emulated()) return;
#if KILN_WITH_CUDA
  use_device(index);
  check(cudaStreamSynchronize(static_cast<cudaStream_t>(s)),
        fmt::format("running queued work on cuda:{} (a kernel or library call failed)", index));
#else
  (void)s;
#endif
}

namespace {
// One queued copy; `wait` makes it synchronous for the host.
void copy(int index, void* dst, const void* src, size_t bytes, [[maybe_unused]] int kind, bool wait, const char* what) {
  void* s = stream(index);
  if (bytes == 0) return;
  if (emulated()) return (void)std::memcpy(dst, src, bytes);
#if KILN_WITH_CUDA
  use_device(index);
  check(cudaMemcpyAsync(dst, src, bytes, static_cast<cudaMemcpyKind>(kind), static_cast<cudaStream_t>(s)), what);
  if (wait) synchronize(index);
#else
  (void)s, (void)wait, (void)what;
#endif
}
}  // namespace

#if KILN_WITH_CUDA
constexpr int kToDevice = cudaMemcpyHostToDevice, kToHost = cudaMemcpyDeviceToHost, kOnDevice = cudaMemcpyDeviceToDevice;
#else
constexpr int kToDevice = 1, kToHost = 2, kOnDevice = 3;
#endif

// A host-to-device copy from pageable memory returns once the source is staged, so the caller
// may reuse `host_src` at once.
void copy_to_device(int index, void* device_dst, const void* host_src, size_t bytes) {
  copy(index, device_dst, host_src, bytes, kToDevice, false, "copy to device");
}

void copy_to_host(int index, void* host_dst, const void* device_src, size_t bytes) {
  copy(index, host_dst, device_src, bytes, kToHost, true, "copy to host");
}

void copy_on_device(int index, void* dst, const void* src, size_t bytes) {
  copy(index, dst, src, bytes, kOnDevice, false, "device-to-device copy");
}

void fill_bytes(int index, void* p, int value, size_t bytes) {
  void* s = stream(index);
  if (emulated()) return (void)std::memset(p, value, bytes);
#if KILN_WITH_CUDA
  use_device(index);
  check(cudaMemsetAsync(p, value, bytes, static_cast<cudaStream_t>(s)), "cudaMemsetAsync");
#else
  (void)s;
#endif
}

}  // namespace kiln::cuda
