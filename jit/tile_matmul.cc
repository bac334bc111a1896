#include "jit/tile_matmul.h"

#include <fmt/format.h>

#include <algorithm>

namespace kiln::jit {

namespace {

// Whether the kernel stores element i of its output at flat position i of its loops: loop 0
// (and loop 1, innermost) walk the output in order, so a range of loop 0 is a range of rows.
bool stores_in_loop_order(const Kernel& k) {
  if (k.loops.empty() || k.loops.size() > 2 || !k.ctx.is_affine(k.store_index) || k.ctx.offset(k.store_index) != 0 ||
      k.store_index.terms.size() != k.loops.size())
    return false;
  const int64_t inner = k.loops.size() == 2 ? k.loops[1].extent : 1;
  if (k.ctx.coefficient(k.store_index, k.loops[0].var) != inner) return false;
  return k.loops.size() == 1 || k.ctx.coefficient(k.store_index, k.loops[1].var) == 1;
}

// The kernel-local index of `slot` in `k`, added as a read-only buffer when absent.
int buffer_of(Kernel& k, int slot, DType dtype) {
  for (size_t b = 0; b < k.buffers.size(); ++b)
    if (k.buffers[b].slot == slot) return static_cast<int>(b);
  k.buffers.push_back({slot, dtype, false});
  return static_cast<int>(k.buffers.size()) - 1;
}

}  // namespace

int64_t matmul_row_block(const MatmulCall& mm, DType t) {
  if (mm.batch != 1 || mm.a_strides[1] != 1 || mm.a_strides[2] < mm.M || mm.N <= 0) return 0;
  // At least 64 rows, so that wide products still make GEMMs worth the call (a tile then holds
  // more than kMatmulTileBytes).
  int64_t rows = std::max<int64_t>(64, kMatmulTileBytes / (mm.N * static_cast<int64_t>(dtype_size(t))));
  rows -= rows % 8;  // row blocks the GEMM kernels like
  return rows < mm.M ? rows : 0;
}

int tile_matmuls(Program& program) {
  std::vector<Kernel>& kernels = program.kernels;
  // Per slot: how many kernels list it, and the last of them.
  std::vector<int> users(program.slots.size(), 0), last_user(program.slots.size(), -1);
  for (size_t k = 0; k < kernels.size(); ++k)
    for (const KernelBuffer& b : kernels[k].buffers) {
      users[b.slot]++;
      last_user[b.slot] = static_cast<int>(k);
    }
  std::vector<char> aliased(program.slots.size(), 0);
  for (const PlanAlias& alias : program.aliases) aliased[alias.slot] = 1;
  std::vector<char> moved(kernels.size(), 0);
  int count = 0;
  for (size_t k = 0; k < kernels.size(); ++k) {
    const Kernel& mm = kernels[k];
    if (mm.kind != KernelKind::Matmul || mm.matmul.batch != 1) continue;
    const int product = mm.buffers[0].slot;
    const PlanSlot& slot = program.slots[product];
    if (slot.external >= 0 || slot.keep || slot.output || aliased[product] || users[product] != 2) continue;
    Kernel& reader = kernels[static_cast<size_t>(last_user[product])];
    if (reader.kind != KernelKind::Elementwise || reader.tiles.buffer >= 0 || reader.out_numel != mm.out_numel ||
        !stores_in_loop_order(reader))
      continue;
    const int b = buffer_of(reader, product, slot.dtype);
    // (A guarded load reads element 0 where its guard fails: outside a later tile's scratch.)
    const bool guarded = std::any_of(reader.exprs.begin(), reader.exprs.end(),
                                     [&](const Expr& e) { return e.buffer == b && !e.guards.empty(); });
    if (b == 0 || reader.buffers[b].written || guarded || !reads_at_store_index(reader, b)) continue;
    const int64_t M = mm.matmul.M, N = mm.matmul.N;
    const int64_t rows = matmul_row_block(mm.matmul, slot.dtype);
    const int64_t inner = reader.loops.size() == 2 ? reader.loops[1].extent : 1;
    if (rows == 0 || rows * N % inner != 0) continue;  // a tile must be a range of loop 0
    MatmulCall call = mm.matmul;
    call.a_buffer = buffer_of(reader, mm.buffers[mm.matmul.a_buffer].slot, mm.buffers[mm.matmul.a_buffer].dtype);
    call.b_buffer = buffer_of(reader, mm.buffers[mm.matmul.b_buffer].slot, mm.buffers[mm.matmul.b_buffer].dtype);
    reader.matmul = call;
    reader.tiles = {b, rows, rows * N / inner};
    reader.summary = fmt::format("{} -> {} ({} tiles of {} rows)", mm.summary, reader.summary, (M + rows - 1) / rows,
                                 rows);
    program.slots[product].numel = rows * N;
    moved[k] = 1;
    ++count;
  }
  if (count == 0) return 0;
  std::vector<Kernel> kept;
  kept.reserve(kernels.size() - static_cast<size_t>(count));
  for (size_t k = 0; k < kernels.size(); ++k)
    if (!moved[k]) kept.push_back(std::move(kernels[k]));
  kernels = std::move(kept);
  return count;
}

}  // namespace kiln::jit
