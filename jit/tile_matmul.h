// A matmul whose product only one elementwise kernel reads, element for element, runs inside that
// kernel tile by tile: a weight gradient read only by its optimizer update (SGD, momentum, Adam)
// is made a few hundred KiB at a time into a scratch tile and consumed while still in cache, so
// the arena holds no full weight-gradient buffer.
//
//   Program program = lower(graph, schedule(graph));
//   if (flags().tiled_updates && backend.runs_matmul_tiles()) tile_matmuls(program);
#pragma once
#include <cstdint>

#include "jit/lower.h"

namespace kiln::jit {

// Bytes of one tile of the product: small enough to stay in a core's L2 between the matmul that
// writes it and the kernel that reads it.
inline constexpr int64_t kMatmulTileBytes = 256 * 1024;

// Rows per block in which the CPU computes a batch-1 matmul whose A is column-major (a weight
// gradient xᵀ·δ, the only products tile_matmuls moves), or 0 when it computes it whole. oneDNN's
// sums depend on the problem's size, so the blocks are a property of the product alone: made tile
// by tile inside its reader or whole into a buffer, it has the same bits.
int64_t matmul_row_block(const MatmulCall& mm, DType t);

// Moves each qualifying Matmul kernel into its reader (Kernel::tiles, Kernel::matmul), where the
// reader stood, and shrinks the product's slot to one tile. Returns how many it moved.
int tile_matmuls(Program& program);

}  // namespace kiln::jit
