// The CUDA runtime as kiln sees it: whether a device is there (never a crash when the driver or
// the GPU is missing), what it is, its memory, kiln's stream and copies. Only the runtime library
// (cudart) is used, never libcuda directly. In a build without the CUDA toolkit every query
// answers "no device" with that reason. Private: the device queries users call (available(),
// device_info(), ...) are declared in the public core/device.h and implemented here.
//
// Work on a device is ordered on one stream per device (stream(index)): kernels, library calls,
// copies. Host-visible results (copy_to_host, synchronize) wait for it.
//
// With no GPU and flags().cuda_emulator (KILN_CUDA_EMULATOR=1), cuda:0 is the host emulator
// (backends/cuda/cuda_emulator.h): "device memory" is host memory, copies are memcpy, kernels run on
// host fibers. The CUDA code paths then run, slowly, on any machine; a real device always wins.
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

// available(), emulated(), device_count(), unavailable_reason() and device_info() are public:
// declared in core/device.h.

// Whether `device` is a real GPU, where NVIDIA's libraries (cuBLASLt, cuDNN) run; the emulator's
// library calls run on the CPU's.
inline bool is_gpu(Device device) { return device.is_cuda() && !emulated(); }

// Throws kiln::Error naming `op` when `device` is a CUDA device this process cannot use (no CUDA
// in the build, no device, or an index past the last one); does nothing for the CPU.
void check_device(Device device, std::string_view op);

// Raw device memory (cudaMalloc / cudaFree). allocate returns nullptr when the device is out of
// memory; other failures throw.
void* device_malloc(int index, size_t bytes);
void device_free(int index, void* p, size_t bytes);

// kiln's stream on device `index` (a cudaStream_t; nullptr for the emulator), created on first use.
void* stream(int index);
// The device's second stream: copies of offloaded activations, overlapping kiln's kernels.
void* copy_stream(int index);
// Waits until everything queued on stream(index) has finished; throws kiln::Error with the
// runtime's message if an earlier kernel failed.
void synchronize(int index);

// A point in the work queued on stream(device): record() marks it, done() asks without waiting,
// synchronize() waits for it, elapsed_ms() is the GPU time between two recorded events. On the
// emulator work runs when queued, so an event is done once recorded.
class Event {
 public:
  // `timing`: whether elapsed_ms may use it (events without timing record and query faster).
  explicit Event(int device, bool timing = true);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record();
  // Records on `stream` (one of this device's streams) instead of stream(device).
  void record_on(void* stream);
  bool done() const;
  void synchronize() const;
  static double elapsed_ms(const Event& start, const Event& end);

 private:
  friend void side_copy(int, void*, const void*, size_t, Event&, Event&);
  friend void wait_for(int, const Event&);
  int device_;
  void* event_ = nullptr;  // cudaEvent_t
  double host_ms_ = 0;     // the emulator's record time
  bool recorded_ = false;
};

// Copies of `bytes` between host memory and device `index`, ordered on stream(index).
// copy_to_device returns once `host_src` may be reused: its bytes are staged in a pinned buffer
// (a ring of kStagingBytes per device, waited on only when full) and the copy from there is
// queued, so the host does not wait for the device's earlier work. copy_to_host returns when
// `host_dst` holds the data.
inline constexpr size_t kStagingBytes = size_t{64} << 20;
void copy_to_device(int index, void* device_dst, const void* host_src, size_t bytes);
void copy_to_host(int index, void* host_dst, const void* device_src, size_t bytes);
// Queued on stream(index): a device-to-device copy, and every byte of [p, p + bytes) set to `value`.
void copy_on_device(int index, void* dst, const void* src, size_t bytes);
void fill_bytes(int index, void* p, int value, size_t bytes);

// Copies of offloaded activations (jit/offload.h), beside the kernels: side_copy queues on
// copy_stream(index), after the work queued on stream(index) so far (`ready` marks that point), a
// copy of `bytes` from `src` to `dst`, one of them pinned host memory, and records `done` after
// it; wait_for(done) makes the work queued on stream(index) from then on wait for that copy. The
// emulator copies at once.
void side_copy(int index, void* dst, const void* src, size_t bytes, Event& ready, Event& done);
void wait_for(int index, const Event& done);
// Page-locked host memory, which copies on a stream need to overlap kernels (the emulator's: plain
// host memory); nullptr when none is available (e.g. the locked-memory limit).
void* allocate_pinned_host(size_t bytes);
void free_pinned_host(void* p);

}  // namespace kiln::cuda
