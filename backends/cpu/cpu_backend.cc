#include "backends/cpu/cpu_backend.h"

#include <algorithm>

#include "backends/cpu/compiler.h"
#include "backends/cpu/conv_onednn.h"
#include "backends/cpu/matmul_onednn.h"
#include "backends/cpu/pool_cpu.h"
#include "backends/cpu/render_cpp.h"
#include "core/flags.h"
#include "jit/tile_matmul.h"

namespace kiln::cpu {

namespace {

// A module of fewer functions is one translation unit: a second compiler process costs its
// start-up and another parse of the prelude, more than it saves on a few functions.
constexpr size_t kSplitFunctions = 16;

// Kernels run on the calling thread's OpenMP team. A function may run several kernels, so each
// launch passes the kernel's own buffers, scalars and Rand pairs, gathered through its binding.
class HostRun final : public jit::KernelRun {
 public:
  HostRun(const std::vector<KernelFn>& fns, const std::vector<jit::KernelBinding>& bindings,
          const std::vector<int64_t>& extents, const std::vector<jit::Kernel>& kernels,
          const std::vector<double>& scalars, const std::vector<int64_t>& ints)
      : fns_(fns), bindings_(bindings), kernels_(kernels) {
    // The run's bound values are fixed: every kernel's local scalars, Rand pairs and extent, once,
    // end to end.
    size_t most_buffers = 0;
    for (size_t k = 0; k < bindings.size(); ++k) {
      const jit::KernelBinding& b = bindings[k];
      scalar_start_.push_back(local_scalars_.size());
      for (int slot : b.scalar_slots) local_scalars_.push_back(scalars[static_cast<size_t>(slot)]);
      int_start_.push_back(local_ints_.size());
      for (int slot : b.rand_slots) local_ints_.insert(local_ints_.end(), {ints[slot], ints[slot + 1]});
      if (extents[k] >= 0) local_ints_.push_back(extents[k]);
      most_buffers = std::max(most_buffers, b.buffer_slots.size());
    }
    local_scalars_.push_back(0);  // a valid pointer for kernels without any
    local_ints_.push_back(0);
    local_buffers_.resize(most_buffers);
  }
  void launch(size_t k, void* const* ptrs) override {
    const std::vector<int>& slots = bindings_[k].buffer_slots;
    for (size_t b = 0; b < slots.size(); ++b) local_buffers_[b] = ptrs[slots[b]];
    int64_t error[2] = {0, 0};
    if (kernels_[k].tiles.operand)
      launch_operand_tiles(k, error);
    else if (kernels_[k].tiles.buffer >= 0)
      launch_tiles(k, error);
    else
      fns_[k](local_buffers_.data(), local_scalars_.data() + scalar_start_[k], local_ints_.data() + int_start_[k], error);
    if (error[1] != 0) jit::throw_index_error(error[0], kernels_[k]);
  }
  void check_errors() override {}  // launch has thrown already

 private:
  // Each tile: its rows of the matmul into the scratch buffer (which the kernel then reads as if
  // the whole product were there: its address moved back by the tile's start), then the kernel
  // over those rows.
  void launch_tiles(size_t k, int64_t* error) {
    using TiledFn = void (*)(void* const*, const double*, const int64_t*, int64_t*, int64_t, int64_t);
    const jit::Kernel& kernel = kernels_[k];
    const jit::MatmulCall& mm = kernel.matmul;
    const jit::MatmulTiles& tiles = kernel.tiles;
    const DType t = kernel.buffers[static_cast<size_t>(tiles.buffer)].dtype;
    const int64_t es = static_cast<int64_t>(dtype_size(t));
    char* scratch = static_cast<char*>(local_buffers_[static_cast<size_t>(tiles.buffer)]);
    const char* a = static_cast<const char*>(local_buffers_[static_cast<size_t>(mm.a_buffer)]) + mm.a_offset * es;
    const char* b = static_cast<const char*>(local_buffers_[static_cast<size_t>(mm.b_buffer)]) + mm.b_offset * es;
    // (Through void (*)(): the compiled function takes the range its symbol was stored without.)
    const auto fn = reinterpret_cast<TiledFn>(reinterpret_cast<void (*)()>(fns_[k]));
    const int64_t loop_end = kernel.loops[0].extent;
    for (int64_t row = 0, lo = 0; row < mm.M; row += tiles.rows, lo += tiles.loop_per_tile) {
      onednn_matmul_rows(t, a, mm.a_strides, b, mm.b_strides, scratch, mm.M, mm.K, mm.N, row,
                         std::min(tiles.rows, mm.M - row));
      local_buffers_[static_cast<size_t>(tiles.buffer)] = scratch - row * mm.N * es;
      fn(local_buffers_.data(), local_scalars_.data() + scalar_start_[k], local_ints_.data() + int_start_[k], error,
         lo, std::min(loop_end, lo + tiles.loop_per_tile));
    }
  }

  // Each block: its rows of the operand into the scratch buffer (the kernel's output, its address
  // moved back by the block's start), then those rows' part of the product's sum.
  void launch_operand_tiles(size_t k, int64_t* error) {
    using TiledFn = void (*)(void* const*, const double*, const int64_t*, int64_t*, int64_t, int64_t);
    const jit::Kernel& kernel = kernels_[k];
    const jit::MatmulCall& mm = kernel.matmul;
    const jit::MatmulTiles& tiles = kernel.tiles;
    auto* scratch = static_cast<float*>(local_buffers_[0]);
    const float* a = static_cast<const float*>(local_buffers_[static_cast<size_t>(mm.a_buffer)]) + mm.a_offset;
    auto* c = static_cast<float*>(local_buffers_[static_cast<size_t>(tiles.buffer)]);
    const auto fn = reinterpret_cast<TiledFn>(reinterpret_cast<void (*)()>(fns_[k]));
    const int64_t loop_end = kernel.loops[0].extent;
    for (int64_t row = 0, lo = 0; row < mm.K; row += tiles.rows, lo += tiles.loop_per_tile) {
      local_buffers_[0] = scratch - row * mm.N;
      fn(local_buffers_.data(), local_scalars_.data() + scalar_start_[k], local_ints_.data() + int_start_[k], error,
         lo, std::min(loop_end, lo + tiles.loop_per_tile));
      if (error[1] != 0) return;
      onednn_matmul_k_part(a, mm.a_strides[2], scratch, mm.N, c, mm.M, mm.N, row, std::min(tiles.rows, mm.K - row));
    }
  }

  const std::vector<KernelFn>& fns_;
  const std::vector<jit::KernelBinding>& bindings_;
  const std::vector<jit::Kernel>& kernels_;
  std::vector<double> local_scalars_;
  std::vector<int64_t> local_ints_;
  std::vector<size_t> scalar_start_, int_start_;  // per kernel: where its values start
  std::vector<void*> local_buffers_;  // the launched kernel's buffers
};

class HostKernels final : public jit::CompiledKernels {
 public:
  explicit HostKernels(const std::vector<jit::Kernel>& kernels, int jit_kernels) : kernels_(kernels) {
    CppSource cpp = render_cpp(kernels, flags().share_functions);
    const int units = cpp.functions.size() < kSplitFunctions ? 1 : flags().compile_jobs;
    module_ = compile_cached(cpp.translation_units(units), jit_kernels, static_cast<int>(cpp.functions.size()));
    std::vector<KernelFn> functions;
    for (const std::string& name : cpp.names) functions.push_back(reinterpret_cast<KernelFn>(module_->symbol(name)));
    fns_.assign(kernels.size(), nullptr);
    for (size_t k = 0; k < kernels.size(); ++k)
      if (cpp.function_of[k] >= 0) fns_[k] = functions[static_cast<size_t>(cpp.function_of[k])];
    bindings_ = std::move(cpp.bindings);
    extents_ = std::move(cpp.extents);
  }
  std::unique_ptr<jit::KernelRun> start(const std::vector<double>& scalars,
                                        const std::vector<int64_t>& ints) const override {
    return std::make_unique<HostRun>(fns_, bindings_, extents_, kernels_, scalars, ints);
  }

 private:
  const std::vector<jit::Kernel>& kernels_;  // the plan's, which owns this object
  std::shared_ptr<CompiledModule> module_;
  std::vector<KernelFn> fns_;                  // per kernel; null for library calls
  std::vector<jit::KernelBinding> bindings_;   // per kernel; empty for library calls
  std::vector<int64_t> extents_;               // per kernel; -1 where the function has its sizes
};

}  // namespace

std::unique_ptr<jit::CompiledKernels> CpuBackend::compile(const std::vector<jit::Kernel>& kernels, Device,
                                                          const std::vector<int>&) const {
  int jit_kernels = 0;
  for (const jit::Kernel& k : kernels) jit_kernels += !jit::is_library(k.kind);
  if (jit_kernels == 0) return nullptr;
  return std::make_unique<HostKernels>(kernels, jit_kernels);
}

void run_host_library(const jit::Kernel& k, void* const* ptrs) {
  if (k.kind == jit::KernelKind::QuantizedMatmul) {
    const jit::QuantizedMatmulCall& q = k.quantized;
    auto at = [&](int buffer) { return ptrs[k.buffers[static_cast<size_t>(buffer)].slot]; };
    onednn_quantized_matmul(at(q.a_buffer), at(q.b_buffer), static_cast<float*>(ptrs[k.buffers[0].slot]), q.M, q.K,
                            q.N, q.b_packed);
    return;
  }
  if (k.kind == jit::KernelKind::Pool) {
    const jit::PoolCall& p = k.pool;
    auto at = [&](int buffer) { return ptrs[k.buffers[static_cast<size_t>(buffer)].slot]; };
    if (p.offsets_buffer < 0)
      max_pool_offsets(k.buffers[static_cast<size_t>(p.x_buffer)].dtype, k.buffers[0].dtype, at(p.x_buffer), at(0),
                       p.planes, p.OH, p.OW, p.kh, p.kw);
    else if (p.scatter)
      max_pool_scatter(k.buffers[0].dtype, k.buffers[static_cast<size_t>(p.offsets_buffer)].dtype, at(p.x_buffer),
                       at(p.offsets_buffer), at(0), p.planes, p.OH, p.OW, p.kh, p.kw);
    else
      max_pool_gather(k.buffers[0].dtype, k.buffers[static_cast<size_t>(p.offsets_buffer)].dtype, at(p.x_buffer),
                      at(p.offsets_buffer), at(0), p.planes, p.OH, p.OW, p.kh, p.kw);
    return;
  }
  const jit::LibraryOperands op = jit::library_operands(k, ptrs);
  if (k.kind == jit::KernelKind::Matmul) {
    const jit::MatmulCall& mm = k.matmul;
    if (const int64_t k_block = jit::matmul_k_block(mm, op.dtype); k_block > 0) {
      const auto* a = static_cast<const float*>(op.a);
      const auto* b = static_cast<const float*>(op.b);
      for (int64_t row = 0; row < mm.K; row += k_block)
        onednn_matmul_k_part(a, mm.a_strides[2], b + row * mm.b_strides[1], mm.b_strides[1], static_cast<float*>(op.out),
                             mm.M, mm.N, row, std::min(k_block, mm.K - row));
      return;
    }
    const int64_t block = jit::matmul_row_block(mm, op.dtype);
    if (block == 0) {
      onednn_matmul(op.dtype, op.a, mm.a_strides, op.b, mm.b_strides, op.out, mm.batch, mm.M, mm.K, mm.N);
      return;
    }
    const int64_t row_bytes = mm.N * static_cast<int64_t>(dtype_size(op.dtype));
    for (int64_t row = 0; row < mm.M; row += block)
      onednn_matmul_rows(op.dtype, op.a, mm.a_strides, op.b, mm.b_strides, static_cast<char*>(op.out) + row * row_bytes,
                         mm.M, mm.K, mm.N, row, std::min(block, mm.M - row));
  } else {
    onednn_conv2d(k.conv.pass, op.dtype, k.conv.geometry, op.a, op.b, op.out);
  }
}

void CpuBackend::run_library(const jit::Kernel& kernel, void* const* ptrs, Device) const {
  run_host_library(kernel, ptrs);
}

}  // namespace kiln::cpu
