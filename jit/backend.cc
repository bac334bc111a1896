#include "jit/backend.h"

#include "backends/cpu/cpu_backend.h"
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_runtime.h"
#include "core/error.h"
#include "memory/allocator.h"

namespace kiln::jit {

std::vector<int> Backend::row_groups(const std::vector<Kernel>&) const { return {}; }

namespace {

// Copies at once, in order with the kernels: nothing to join.
class ImmediateTransfers final : public TransferQueue {
 public:
  explicit ImmediateTransfers(Device device) : memory_(memory::device_allocator(device)) {}
  void start(const Kernel& kernel, void* const* ptrs) override {
    void* dst = ptrs[kernel.buffers[0].slot];
    const void* src = ptrs[kernel.buffers[1].slot];
    const auto bytes = static_cast<size_t>(kernel.transfer.bytes);
    if (kernel.transfer.stage == TransferStage::OffloadStart) memory_.copy_to_host(dst, src, bytes);
    else memory_.copy_from_host(dst, src, bytes);
  }
  void join(const Kernel&) override {}

 private:
  memory::Allocator& memory_;
};

}  // namespace

std::unique_ptr<TransferQueue> Backend::transfers(Device device) const {
  return std::make_unique<ImmediateTransfers>(device);
}

std::shared_ptr<void> Backend::allocate_host(size_t bytes) const {
  void* p = memory::host_allocator().allocate(bytes);
  if (!p) return nullptr;
  return std::shared_ptr<void>(p, [bytes](void* q) { memory::host_allocator().release(q, bytes); });
}

LibraryOperands library_operands(const Kernel& k, void* const* ptrs) {
  const DType t = k.buffers[0].dtype;
  void* out = ptrs[k.buffers[0].slot];
  if (k.kind == KernelKind::Conv)
    return {ptrs[k.buffers[k.conv.a_buffer].slot], ptrs[k.buffers[k.conv.b_buffer].slot], out, t};
  const MatmulCall& mm = k.matmul;
  const size_t es = dtype_size(t);
  return {static_cast<const char*>(ptrs[k.buffers[mm.a_buffer].slot]) + mm.a_offset * es,
          static_cast<const char*>(ptrs[k.buffers[mm.b_buffer].slot]) + mm.b_offset * es, out, t};
}

void throw_index_error(int64_t index, const Kernel& kernel) {
  KILN_FAIL("gather/scatter_add",
            "index {} is out of range in kernel `{}`; indices must lie in [0, size) of the indexed dimension", index,
            kernel.summary);
}

const Backend& backend_for(Device device) {
  // Never destroyed: cached plans may still hold kernels when static destructors run.
  static const auto* cpu = new cpu::CpuBackend;
  static const auto* gpu = new cuda::CudaBackend;
  static const auto* emulator = new cuda::CudaEmulatorBackend;
  if (device.is_cpu()) return *cpu;
  cuda::check_device(device, "run");
  return cuda::emulated() ? static_cast<const Backend&>(*emulator) : *gpu;
}

}  // namespace kiln::jit
