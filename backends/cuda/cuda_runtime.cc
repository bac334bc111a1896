// The CUDA runtime queries and copies of cuda_runtime.h, the emulator's host-memory versions of
// them, and answers of "no device" when the build has no CUDA toolkit (KILN_WITH_CUDA=0).
#include "backends/cuda/cuda_runtime.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "core/flags.h"
#include "backends/cuda/staging_ring.h"

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

namespace {
// Stream `which` of device `index` (0: kiln's, 1: the copy stream), non-blocking, created on first
// use and never destroyed (storages freed at exit may still queue).
void* device_stream(int index, int which) {
  check_device(Device::cuda(index), "cuda::stream");
  if (emulated()) return nullptr;
#if KILN_WITH_CUDA
  static std::mutex& mutex = *new std::mutex;
  static std::vector<cudaStream_t>& streams = *new std::vector<cudaStream_t>(2 * static_cast<size_t>(device_count()), nullptr);
  std::lock_guard<std::mutex> lock(mutex);
  cudaStream_t& s = streams[2 * static_cast<size_t>(index) + static_cast<size_t>(which)];
  if (!s) {
    use_device(index);
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), fmt::format("creating a stream on cuda:{}", index));
  }
  return s;
#else
  (void)which;
  return nullptr;
#endif
}
}  // namespace

void* stream(int index) { return device_stream(index, 0); }
void* copy_stream(int index) { return device_stream(index, 1); }

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

// ---- events ----

namespace {
double host_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

Event::Event(int device, [[maybe_unused]] bool timing) : device_(device) {
  check_device(Device::cuda(device), "cuda::Event");
  if (emulated()) return;
#if KILN_WITH_CUDA
  use_device(device);
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming),
        fmt::format("creating an event on cuda:{}", device));
  event_ = e;
#endif
}

Event::~Event() {
#if KILN_WITH_CUDA
  if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));  // a failure here has no one to tell
#endif
}

void Event::record() { record_on(stream(device_)); }

void Event::record_on([[maybe_unused]] void* s) {
  host_ms_ = host_ms();
#if KILN_WITH_CUDA
  if (!emulated()) {
    use_device(device_);
    check(cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(s)), "cudaEventRecord");
  }
#else
  (void)s;
#endif
  recorded_ = true;
}

bool Event::done() const {
  if (emulated() || !recorded_) return true;
#if KILN_WITH_CUDA
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (e == cudaErrorNotReady) return false;
  check(e, fmt::format("work queued on cuda:{} (a kernel or library call failed)", device_));
#endif
  return true;
}

void Event::synchronize() const {
  if (emulated() || !recorded_) return;
#if KILN_WITH_CUDA
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)),
        fmt::format("waiting for work queued on cuda:{} (a kernel or library call failed)", device_));
#endif
}

double Event::elapsed_ms(const Event& start, const Event& end) {
  KILN_CHECK(start.recorded_ && end.recorded_, "cuda::Event::elapsed_ms", "both events must be recorded first");
  KILN_CHECK(start.device_ == end.device_, "cuda::Event::elapsed_ms", "events on cuda:{} and cuda:{}; time events "
             "of one device", start.device_, end.device_);
  if (emulated()) return end.host_ms_ - start.host_ms_;
  float ms = 0;
#if KILN_WITH_CUDA
  end.synchronize();
  check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.event_), static_cast<cudaEvent_t>(end.event_)),
        "cudaEventElapsedTime");
#endif
  return ms;
}

// ---- pinned staging of host-to-device copies ----

namespace {

// One device's staging buffer, its ring of regions in flight, and the events marking their
// copies' ends (kept for reuse). The buffer is allocated on first use; nullptr after a failed
// allocation, when copies go from pageable memory.
struct Staging {
  std::mutex mutex;
  bool tried = false;
  unsigned char* buffer = nullptr;
  StagingRing ring{kStagingBytes};
  std::vector<std::unique_ptr<Event>> events;
  std::vector<Event*> free_events;
};

unsigned char* allocate_pinned(size_t bytes) {
  if (emulated()) return static_cast<unsigned char*>(std::aligned_alloc(4096, bytes));
#if KILN_WITH_CUDA
  void* p = nullptr;
  // Portable: pinned for every device, whichever is current.
  if (cudaHostAlloc(&p, bytes, cudaHostAllocPortable) == cudaSuccess) return static_cast<unsigned char*>(p);
  cudaGetLastError();  // e.g. a locked-memory limit: copy from pageable memory instead
#endif
  (void)bytes;
  return nullptr;
}

// Never destroyed: copies may be queued while the process exits.
Staging& staging(int index) {
  static std::vector<Staging*>& all = *new std::vector<Staging*>([] {
    std::vector<Staging*> v(static_cast<size_t>(device_count()));
    for (Staging*& s : v) s = new Staging;
    return v;
  }());
  return *all[static_cast<size_t>(index)];
}

}  // namespace

void copy_to_device(int index, void* device_dst, const void* host_src, size_t bytes) {
  stream(index);  // checks the device
  if (bytes == 0) return;
  Staging& st = staging(index);
  std::lock_guard<std::mutex> lock(st.mutex);
  if (!st.tried) {
    st.tried = true;
    st.buffer = allocate_pinned(kStagingBytes);
  }
  if (!st.buffer) return copy(index, device_dst, host_src, bytes, kToDevice, false, "copy to device");
  auto release = [&](void* token) { st.free_events.push_back(static_cast<Event*>(token)); };
  st.ring.reclaim([&](void* token) { return static_cast<Event*>(token)->done() ? (release(token), true) : false; });
  // Pieces of a quarter of the ring: a long copy streams through it while earlier pieces land.
  constexpr size_t kPiece = kStagingBytes / 4;
  for (size_t offset = 0; offset < bytes; offset += kPiece) {
    const size_t n = std::min(kPiece, bytes - offset);
    // The event first: once the copy is queued, its region must be committed whatever happens.
    if (st.free_events.empty())
      st.free_events.push_back(st.events.emplace_back(std::make_unique<Event>(index, false)).get());
    Event* done = st.free_events.back();
    st.free_events.pop_back();
    const size_t at = st.ring.reserve(n, [&](void* token) {
      static_cast<Event*>(token)->synchronize();
      release(token);
    });
    std::memcpy(st.buffer + at, static_cast<const unsigned char*>(host_src) + offset, n);
    try {
      copy(index, static_cast<unsigned char*>(device_dst) + offset, st.buffer + at, n, kToDevice, false, "copy to device");
      done->record();
    } catch (...) {
      synchronize(index);  // nothing may still read the region when the next copy takes it
      release(done);
      throw;
    }
    st.ring.commit(at, n, done);
  }
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

// ---- copies beside the kernels: offloaded activations ----

void* allocate_pinned_host(size_t bytes) { return allocate_pinned(std::max<size_t>(bytes, 1)); }

void free_pinned_host(void* p) {
  if (!p) return;
  if (emulated()) return std::free(p);
#if KILN_WITH_CUDA
  cudaFreeHost(p);  // runs in destructors: a failure here has no one to tell
#endif
}

void side_copy(int index, void* dst, const void* src, size_t bytes, Event& ready, Event& done) {
  void* side = copy_stream(index);
  if (emulated()) {
    std::memcpy(dst, src, bytes);
    ready.record(), done.record();
    return;
  }
#if KILN_WITH_CUDA
  use_device(index);
  ready.record();  // the point of kiln's stream the copy must come after
  check(cudaStreamWaitEvent(static_cast<cudaStream_t>(side), static_cast<cudaEvent_t>(ready.event_), 0),
        "cudaStreamWaitEvent (copy stream)");
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(side)), "offload copy");
  done.record_on(side);
#else
  (void)side, (void)dst, (void)src, (void)bytes, (void)ready, (void)done;
#endif
}

void wait_for(int index, const Event& done) {
  void* s = stream(index);
  if (emulated()) return;
#if KILN_WITH_CUDA
  use_device(index);
  check(cudaStreamWaitEvent(static_cast<cudaStream_t>(s), static_cast<cudaEvent_t>(done.event_), 0),
        "cudaStreamWaitEvent");
#else
  (void)s, (void)done;
#endif
}

}  // namespace kiln::cuda
