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

// Rows per block when `rows` rows of `bytes` in all are split into blocks of about
// `block_bytes`, evenly, in multiples of 8 rows and at least 64 (or 0: one block).
int64_t even_blocks(int64_t rows, int64_t bytes, int64_t block_bytes = kMatmulBlockBytes) {
  if (rows <= 0 || bytes <= 0) return 0;  // an empty product: one (empty) block
  const int64_t blocks = (bytes + block_bytes - 1) / block_bytes;
  int64_t per = std::max<int64_t>(64, (rows + blocks - 1) / blocks);
  per += (8 - per % 8) % 8;
  return per < rows ? per : 0;
}

}  // namespace

int64_t matmul_row_block(const MatmulCall& mm, DType t) {
  if (mm.batch != 1 || mm.N <= 0) return 0;
  const int64_t size = static_cast<int64_t>(dtype_size(t));
  const bool column_major_a = mm.a_strides[1] == 1 && mm.a_strides[2] >= mm.M;
  // A row-major A (a data gradient δ·W, a layer's output x·Wᵀ): only large products, where a
  // block is still a GEMM worth the call, of a B that stays in cache (each block reads all of it:
  // not a language model's vocabulary projection).
  const bool large_row_major_a = mm.a_strides[2] == 1 && mm.a_strides[1] >= mm.K &&
                                 mm.M * mm.N * size > 2 * kMatmulBlockBytes && mm.K * mm.N * size <= kMatmulBlockBytes;
  if (!column_major_a && !large_row_major_a) return 0;
  if (!column_major_a) return even_blocks(mm.M, mm.M * mm.N * size);
  // Each call packs all of B for the bfloat16 kernels (AMX: 4-6x float32's rate), a fixed cost
  // that outweighs their arithmetic in a small tile: tiles of twice the bytes, of even rows (a
  // 512 x 784 weight gradient: 2 calls of 256 rows instead of 3 of 160 and one of 32).
  if (t == DType::BFloat16) return even_blocks(mm.M, mm.M * mm.N * size, 2 * kMatmulTileBytes);
  // At least 64 rows, so that wide products still make GEMMs worth the call (a tile then holds
  // more than kMatmulTileBytes).
  int64_t rows = std::max<int64_t>(64, kMatmulTileBytes / (mm.N * size));
  rows -= rows % 8;  // row blocks the GEMM kernels like
  return rows < mm.M ? rows : 0;
}

int64_t matmul_k_block(const MatmulCall& mm, DType t) {
  if (t != DType::Float32 || mm.batch != 1 || mm.M < 8 || mm.N < 8 || matmul_row_block(mm, t) > 0) return 0;
  // The product transposed_sgemm (backends/cpu/matmul_onednn.cc) makes: A column-major, and here
  // B row-major, so that a block of its rows is a block of memory.
  if (mm.a_strides[1] != 1 || mm.a_strides[2] < mm.M || mm.b_strides[2] != 1 || mm.b_strides[1] < mm.N ||
      mm.M * mm.K < (int64_t{1} << 16))
    return 0;
  const int64_t size = static_cast<int64_t>(dtype_size(t));
  // B small: nothing to gain; the product large: each block reads and writes all of it.
  if (mm.K * mm.N * size <= 2 * kMatmulBlockBytes || mm.M * mm.N * size > kMatmulBlockBytes) return 0;
  return even_blocks(mm.K, mm.K * mm.N * size);
}

namespace {

// Moves each elementwise kernel that makes the B operand of a K-blocked product, read by nothing
// else, into the product's place (MatmulTiles::operand). `moved` marks the kernels it empties.
int tile_operands(Program& program, std::vector<char>& moved) {
  std::vector<Kernel>& kernels = program.kernels;
  std::vector<int> users(program.slots.size(), 0), writer(program.slots.size(), -1);
  for (size_t k = 0; k < kernels.size(); ++k)
    for (const KernelBuffer& b : kernels[k].buffers) {
      users[b.slot]++;
      if (b.written && writer[b.slot] < 0) writer[b.slot] = static_cast<int>(k);
    }
  std::vector<char> aliased(program.slots.size(), 0);
  for (const PlanAlias& alias : program.aliases) aliased[alias.slot] = 1;
  int count = 0;
  for (size_t k = 0; k < kernels.size(); ++k) {
    Kernel& mm = kernels[k];
    if (moved[k] || mm.kind != KernelKind::Matmul) continue;
    const MatmulCall& call = mm.matmul;
    const int operand = mm.buffers[call.b_buffer].slot, product = mm.buffers[0].slot;
    const PlanSlot& b_slot = program.slots[operand];
    const int64_t rows = matmul_k_block(call, b_slot.dtype);
    if (rows == 0 || call.b_offset != 0 || call.b_strides[1] != call.N || mm.buffers[call.a_buffer].slot == operand)
      continue;
    if (b_slot.external >= 0 || b_slot.keep || b_slot.output || aliased[operand] || users[operand] != 2) continue;
    const PlanSlot& c_slot = program.slots[product];
    if (c_slot.external >= 0) continue;  // (kept, or shared by an output's view: it is made whole)
    const int w = writer[operand];
    if (w < 0 || w >= static_cast<int>(k) || moved[static_cast<size_t>(w)]) continue;
    const Kernel& maker = kernels[static_cast<size_t>(w)];
    // Made later, where the product runs, the operand reads the same values: every slot is written
    // once, and in-place updates are chosen after this pass, from the lifetimes it leaves.
    if (maker.kind != KernelKind::Elementwise || maker.buffers[0].slot != operand || !maker.side_stores.empty() ||
        maker.tiles.buffer >= 0 || may_fail(maker) || maker.out_numel != call.K * call.N || !stores_in_loop_order(maker))
      continue;
    const int64_t inner = maker.loops.size() == 2 ? maker.loops[1].extent : 1;
    if (rows * call.N % inner != 0) continue;  // a block must be a range of loop 0
    Kernel fused = maker;
    fused.matmul = call;
    fused.matmul.a_buffer = buffer_of(fused, mm.buffers[call.a_buffer].slot, mm.buffers[call.a_buffer].dtype);
    fused.matmul.b_buffer = 0;
    const int c = buffer_of(fused, product, c_slot.dtype);
    fused.buffers[static_cast<size_t>(c)].written = true;
    fused.tiles = {c, rows, rows * call.N / inner, true};
    fused.summary = fmt::format("{} -> {} ({} blocks of {} rows)", maker.summary, mm.summary,
                                (call.K + rows - 1) / rows, rows);
    fused.label = mm.label;
    fused.backward = mm.backward || maker.backward;
    fused.recompute = false;  // (its time is the product's in KILN_LOG=2)
    program.slots[operand].numel = rows * call.N;
    mm = std::move(fused);
    moved[static_cast<size_t>(w)] = 1;
    ++count;
  }
  return count;
}

}  // namespace

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
  count += tile_operands(program, moved);
  if (count == 0) return 0;
  std::vector<Kernel> kept;
  kept.reserve(kernels.size() - static_cast<size_t>(count));
  for (size_t k = 0; k < kernels.size(); ++k)
    if (!moved[k]) kept.push_back(std::move(kernels[k]));
  kernels = std::move(kept);
  return count;
}

}  // namespace kiln::jit
