#include "backends/cuda/cuda_allocator.h"

#include <cstdio>
#include <vector>

#include "backends/cuda/cuda_runtime.h"
#include "core/error.h"

namespace kiln::cuda {

namespace {

// Device memory of one GPU through the CUDA runtime. KILN_MEMORY_LIMIT is a host limit; a GPU's
// limit is its memory.
class CudaAllocator final : public memory::Allocator {
 public:
  explicit CudaAllocator(int index) : index_(index) {}
  void* allocate(size_t bytes) override { return device_malloc(index_, bytes); }
  // Runs inside Storage destructors, which must not throw: a failed cudaFree (the device
  // already in an error state, or the runtime shutting down) is reported and the memory dropped.
  void release(void* p, size_t bytes) override {
    try {
      device_free(index_, p, bytes);
    } catch (const Error& e) {
      std::fprintf(stderr, "kiln: freeing device memory on cuda:%d failed: %s\n", index_, e.what());
    }
  }
  const char* name() const override { return "cuda"; }
  void copy_from_host(void* dst, const void* src, size_t bytes) override { copy_to_device(index_, dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, size_t bytes) override { cuda::copy_to_host(index_, dst, src, bytes); }
  // Runs inside Storage destructors: a failed poisoning (a debugging aid) must not throw.
  void fill(void* p, int value, size_t bytes) override {
    try {
      fill_bytes(index_, p, value, bytes);
    } catch (const Error&) {
    }
  }

 private:
  int index_;
};

}  // namespace

memory::Allocator& device_allocator(Device device) {
  check_device(device, "allocate");
  // One per device, never destroyed (as the host allocator).
  static std::vector<CudaAllocator*>* per_device = [] {
    auto* v = new std::vector<CudaAllocator*>;
    for (int i = 0; i < device_count(); ++i) v->push_back(new CudaAllocator(i));
    return v;
  }();
  return *(*per_device)[static_cast<size_t>(device.index)];
}

}  // namespace kiln::cuda
