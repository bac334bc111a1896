// The seam between the executor and a device: what running a plan needs from the CPU, a GPU or
// the CUDA emulator. The executor (jit/executor.cc) is written once against it; each backend in
// backends/ implements it (backends/cpu/cpu_backend.h, backends/cuda/cuda_backend.h). Memory is
// the other half of a device and sits below the JIT, since ops move tensors too: each device's
// memory::Allocator allocates, fills and copies (memory/allocator.h).
//
//   const Backend& b = backend_for(plan.device);
//   auto kernels = b.compile(plan.program, plan.group_start);   // once per plan
//   auto run = kernels->start(scalars, int_scalars);           // once per run
//   run->launch(k, ptrs);                                      // JIT kernel k
//   b.run_library(kernel, ptrs, device);                       // matmul, convolutions
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/device.h"
#include "jit/kernel_ir.h"

namespace kiln::jit {

// One run of a plan's compiled kernels: the run's bound values live as long as it does.
class KernelRun {
 public:
  virtual ~KernelRun() = default;
  // Runs (host) or queues (device) JIT kernel `k` of the plan on the buffers `ptrs` (indexed by
  // plan slot). A backend that learns of a bad index at once throws it here.
  virtual void launch(size_t k, void* const* ptrs) = 0;
  // Throws kiln::Error for the first bad index reported by the kernels launched so far (on a
  // device: one wait for it). Called once, after the plan's last kernel that can fail.
  virtual void check_errors() = 0;
};

// The JIT kernels of one plan compiled for one device.
class CompiledKernels {
 public:
  virtual ~CompiledKernels() = default;
  // Binds one run's float scalars and Rand seed/offset pairs (copied to the device if needed).
  // The caller keeps both vectors alive and unchanged until the run is destroyed.
  virtual std::unique_ptr<KernelRun> start(const std::vector<double>& scalars,
                                           const std::vector<int64_t>& int_scalars) const = 0;
};

// The copies of offloaded activations in one run of a plan (jit/offload.h).
class TransferQueue {
 public:
  virtual ~TransferQueue() = default;
  // A Transfer start: queues its copy (buffers[1] to buffers[0], by plan slot in `ptrs`) after
  // the work queued so far; kernels queued later may overlap it.
  virtual void start(const Kernel& kernel, void* const* ptrs) = 0;
  // A Transfer join: the work queued from now on waits for its start's copy.
  virtual void join(const Kernel& kernel) = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // Consecutive kernels the backend runs as one function (a CUDA row group): per kernel, the
  // first kernel of its group, itself when alone. Empty when the backend has none.
  virtual std::vector<int> row_groups(const std::vector<Kernel>& kernels) const;
  // Renders, compiles (or finds in the caches) and loads the JIT kernels among `kernels` for
  // `device`; null when every kernel is a library call. `groups` as row_groups returned. The
  // result refers to `kernels` (error messages name them): the plan owns both.
  virtual std::unique_ptr<CompiledKernels> compile(const std::vector<Kernel>& kernels, Device device,
                                                   const std::vector<int>& groups) const = 0;
  // A library kernel (Matmul, Conv) on the buffers `ptrs`, indexed by plan slot.
  virtual void run_library(const Kernel& kernel, void* const* ptrs, Device device) const = 0;
  // Whether an elementwise kernel may compute a matmul operand tile by tile (Kernel::tiles).
  virtual bool runs_matmul_tiles() const { return false; }
  // Waits until the work queued on `device` has finished (a kernel's time, not its launch's).
  virtual void synchronize(Device device) const = 0;
  // Whether saved activations may be offloaded to host memory (jit/offload.h): a device whose
  // memory is not the host's. The CPU's is.
  virtual bool offloads() const { return false; }
  // One run's queue of offload copies. This one copies at once through the device's allocator
  // (the emulator, where a copy is a memcpy); a GPU copies on a second stream.
  virtual std::unique_ptr<TransferQueue> transfers(Device device) const;
  // Host memory an offloading plan keeps its copies in across runs (pinned on a GPU); null when
  // none is available.
  virtual std::shared_ptr<void> allocate_host(size_t bytes) const;
};

// Where a library kernel (Matmul, Conv) reads and writes, from the plan's buffers `ptrs`: the
// operands' addresses include a matmul's element offsets (views that start inside a buffer).
struct LibraryOperands {
  const void* a;
  const void* b;
  void* out;
  DType dtype;  // the output's, which the library computes in
};
LibraryOperands library_operands(const Kernel& kernel, void* const* ptrs);

// The error a kernel reports for an index out of range (gather, scatter_add): names the kernel.
[[noreturn]] void throw_index_error(int64_t index, const Kernel& kernel);

// The backend running plans on `device`: the CPU's, a GPU's, or the CUDA emulator's when cuda:0
// is emulated. Throws kiln::Error for a device this build or process cannot use.
const Backend& backend_for(Device device);

}  // namespace kiln::jit
