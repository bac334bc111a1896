#include "backends/cuda/cuda_backend.h"

#include <cstring>
#include <unordered_map>

#include "backends/cpu/cpu_backend.h"
#include "backends/cuda/cuda_kernels.h"
#include "backends/cuda/cublaslt.h"
#include "backends/cuda/cudnn.h"
#include "backends/cuda/cuda_runtime.h"
#include "backends/cuda/render_cuda.h"
#include "core/error.h"
#include "core/tensor.h"
#include "memory/allocator.h"

namespace kiln::cuda {

namespace {

// A run's bound values in device memory, copied in one transfer: each kernel's own scalars (its
// sc) and Rand seeds and offsets (its isc), and an index-error pair (value, flag) per kernel that
// can fail, zeroed; after them the kernels' scratch buffer (not copied). Kernels sharing a
// function number their values alike, so each gets its own sc and isc.
class DeviceRun final : public jit::KernelRun {
 public:
  DeviceRun(const CudaKernels& kernels, const std::vector<jit::Kernel>& plan_kernels,
            const std::vector<int>& fallible, const std::vector<int>& error_pair, Device device,
            const std::vector<double>& scalars, const std::vector<int64_t>& ints)
      : kernels_(kernels), plan_kernels_(plan_kernels), fallible_(fallible), error_pair_(error_pair), device_(device) {
    static_assert(sizeof(double) == sizeof(int64_t));
    std::vector<double> local_scalars;
    std::vector<int64_t> local_ints;
    for (size_t k = 0; k < plan_kernels.size(); ++k) {
      scalar_start_.push_back(local_scalars.size());
      for (int slot : kernels.scalar_slots(k)) local_scalars.push_back(scalars[static_cast<size_t>(slot)]);
      int_start_.push_back(local_ints.size());
      for (int slot : kernels.rand_slots(k)) local_ints.insert(local_ints.end(), {ints[slot], ints[slot + 1]});
    }
    local_scalars.push_back(0);  // valid pointers for kernels without any
    local_ints.push_back(0);
    std::vector<int64_t> host(local_scalars.size() + local_ints.size() + 2 * std::max<size_t>(fallible.size(), 1), 0);
    std::memcpy(host.data(), local_scalars.data(), local_scalars.size() * sizeof(double));
    std::memcpy(host.data() + local_scalars.size(), local_ints.data(), local_ints.size() * sizeof(int64_t));
    const size_t bytes = (host.size() * sizeof(int64_t) + 15) / 16 * 16;  // scratch holds 16-byte values at most
    const auto scratch = static_cast<size_t>(kernels.scratch_bytes());
    storage_ = memory::allocate_storage(bytes + scratch, device);
    copy_to_device(device.index, storage_->data, host.data(), host.size() * sizeof(int64_t));
    auto* base = static_cast<int64_t*>(storage_->data);
    sc_ = reinterpret_cast<double*>(base);
    isc_ = base + local_scalars.size();
    err_ = base + local_scalars.size() + local_ints.size();
    if (scratch > 0) scratch_ = static_cast<char*>(storage_->data) + bytes;
  }

  // cudaLaunchKernel takes a pointer to each argument: the buffers, then sc, isc, err, scratch.
  // A later phase of a row group launches nothing: its group's function ran it.
  void launch(size_t k, void* const* ptrs) override {
    values_.clear();
    for (int slot : kernels_.parameter_slots(k)) values_.push_back(ptrs[slot]);
    values_.insert(values_.end(), {static_cast<void*>(sc_ + scalar_start_[k]), static_cast<void*>(isc_ + int_start_[k]),
                                   static_cast<void*>(err_ + 2 * error_pair_[k]), scratch_});
    args_.clear();
    for (void*& v : values_) args_.push_back(&v);
    kernels_.launch(k, args_.data());
  }

  void check_errors() override {
    std::vector<int64_t> err(2 * fallible_.size());
    copy_to_host(device_.index, err.data(), err_, err.size() * sizeof(int64_t));
    for (size_t i = 0; i < fallible_.size(); ++i)
      if (err[2 * i + 1] != 0) jit::throw_index_error(err[2 * i], plan_kernels_[static_cast<size_t>(fallible_[i])]);
  }

 private:
  const CudaKernels& kernels_;
  const std::vector<jit::Kernel>& plan_kernels_;
  const std::vector<int>& fallible_;
  const std::vector<int>& error_pair_;
  Device device_;
  std::shared_ptr<Storage> storage_;
  double* sc_ = nullptr;
  int64_t* isc_ = nullptr;
  void* scratch_ = nullptr;
  int64_t* err_ = nullptr;
  std::vector<size_t> scalar_start_, int_start_;  // per kernel: where its sc and isc start
  std::vector<void*> values_, args_;
};

class DeviceKernels final : public jit::CompiledKernels {
 public:
  DeviceKernels(const std::vector<jit::Kernel>& kernels, Device device, const std::vector<int>& groups)
      : kernels_(kernels), device_(device), compiled_(kernels, device.index, groups) {
    for (size_t k = 0; k < kernels.size(); ++k) {
      const bool fails = jit::may_fail(kernels[k]);
      error_pair_.push_back(fails ? static_cast<int>(fallible_.size()) : 0);
      if (fails) fallible_.push_back(static_cast<int>(k));
    }
  }
  std::unique_ptr<jit::KernelRun> start(const std::vector<double>& scalars,
                                        const std::vector<int64_t>& ints) const override {
    return std::make_unique<DeviceRun>(compiled_, kernels_, fallible_, error_pair_, device_, scalars, ints);
  }

 private:
  const std::vector<jit::Kernel>& kernels_;  // the plan's, which owns this object
  Device device_;
  CudaKernels compiled_;
  std::vector<int> fallible_;    // kernels that may report an index out of range, in order
  std::vector<int> error_pair_;  // per kernel: its index-error pair (0 if it cannot fail)
};

// A GPU's offload copies on its copy stream (cuda::side_copy), each start's events kept until
// its join.
class StreamTransfers final : public jit::TransferQueue {
 public:
  explicit StreamTransfers(int index) : index_(index) {}
  void start(const jit::Kernel& kernel, void* const* ptrs) override {
    auto& [ready, done] = events_[key(kernel)];
    if (!ready) ready = std::make_unique<Event>(index_, false), done = std::make_unique<Event>(index_, false);
    side_copy(index_, ptrs[kernel.buffers[0].slot], ptrs[kernel.buffers[1].slot],
              static_cast<size_t>(kernel.transfer.bytes), *ready, *done);
  }
  void join(const jit::Kernel& kernel) override {
    auto it = events_.find(key(kernel));
    if (it != events_.end() && it->second.second) wait_for(index_, *it->second.second);
  }

 private:
  // A value's offload and its fetch are two copies: a join waits for the start of its own stage.
  static int key(const jit::Kernel& k) {
    const bool fetch = k.transfer.stage == jit::TransferStage::FetchStart || k.transfer.stage == jit::TransferStage::FetchJoin;
    return 2 * k.transfer.id + (fetch ? 1 : 0);
  }
  int index_;
  std::unordered_map<int, std::pair<std::unique_ptr<Event>, std::unique_ptr<Event>>> events_;
};

}  // namespace

std::unique_ptr<jit::TransferQueue> CudaBackend::transfers(Device device) const {
  if (emulated()) return jit::Backend::transfers(device);
  return std::make_unique<StreamTransfers>(device.index);
}

std::shared_ptr<void> CudaBackend::allocate_host(size_t bytes) const {
  // The emulator's, from the host allocator: KILN_MEMORY_LIMIT applies, as it does to a GPU's
  // copies below.
  if (emulated()) return jit::Backend::allocate_host(bytes);
  const int64_t limit = memory::memory_limit_bytes();
  if (limit > 0 && memory::host_allocator().bytes_in_use() + static_cast<int64_t>(bytes) > limit) return nullptr;
  void* p = allocate_pinned_host(bytes);
  if (!p) return nullptr;
  return std::shared_ptr<void>(p, [](void* q) { free_pinned_host(q); });
}

std::vector<int> CudaBackend::row_groups(const std::vector<jit::Kernel>& kernels) const {
  return cuda_row_groups(kernels);
}

std::unique_ptr<jit::CompiledKernels> CudaBackend::compile(const std::vector<jit::Kernel>& kernels, Device device,
                                                           const std::vector<int>& groups) const {
  bool any = false;
  for (const jit::Kernel& k : kernels) any |= !jit::is_library(k.kind);
  if (!any) return nullptr;
  return std::make_unique<DeviceKernels>(kernels, device, groups);
}

void CudaBackend::run_library(const jit::Kernel& k, void* const* ptrs, Device device) const {
  // nn::QuantizedLinear records its int8 matmul on the host only; on a GPU it dequantizes.
  KILN_CHECK(k.kind != jit::KernelKind::QuantizedMatmul, "QuantizedLinear", "the int8 matmul has no CUDA kernel here");
  // ops/pooling.cc records it only where kiln::library_pool says so, never for a GPU.
  KILN_CHECK(k.kind != jit::KernelKind::Pool, "max_pool2d", "the window arg-max kernel runs on the host only");
  const jit::LibraryOperands op = jit::library_operands(k, ptrs);
  if (k.kind == jit::KernelKind::Matmul) {
    const jit::MatmulCall& mm = k.matmul;
    cublaslt_matmul(device.index, op.dtype, op.a, mm.a_strides, op.b, mm.b_strides, op.out, mm.batch, mm.M, mm.K,
                    mm.N);
  } else {
    cudnn_conv2d(device.index, k.conv.pass, op.dtype, k.conv.geometry, op.a, op.b, op.out);
  }
}

void CudaBackend::synchronize(Device device) const { cuda::synchronize(device.index); }

void CudaEmulatorBackend::run_library(const jit::Kernel& kernel, void* const* ptrs, Device) const {
  cpu::run_host_library(kernel, ptrs);
}

}  // namespace kiln::cuda
