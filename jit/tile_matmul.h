// Matmuls that never hold a whole operand or product. A product only one elementwise kernel reads,
// element for element, runs inside that kernel tile by tile: a weight gradient read only by its
// optimizer update (SGD, momentum, Adam) is made a few hundred KiB at a time into a scratch tile
// and consumed while still in cache. And an operand that elementwise work makes for one product
// alone (a GELU output recomputed for the weight gradient that reads it) is made inside the
// product, a block of rows at a time.
//
//   Program program = lower(graph, schedule(graph));
//   if (flags().tiled_updates && backend.runs_matmul_tiles()) tile_matmuls(program);
#pragma once
#include <cstdint>

#include "jit/lower.h"

namespace kiln::jit {

// Bytes of one tile of the product: small enough to stay in a core's L2 between the matmul that
// writes it and the kernel that reads it (bfloat16 tiles: twice that, see matmul_row_block).
inline constexpr int64_t kMatmulTileBytes = 256 * 1024;
// Bytes of one block of a large product of a row-major A, or of a long sum's B operand: blocks
// are separate GEMM calls, and each call costs tens of microseconds beyond its arithmetic.
inline constexpr int64_t kMatmulBlockBytes = 1024 * 1024;

// Rows per block in which the CPU computes a batch-1 matmul whose A is column-major (a weight
// gradient xᵀ·δ) or row-major, the product over 2 MiB and B within 1 MiB (a data gradient δ·W, a
// layer x·Wᵀ), or 0 when it computes it whole. oneDNN's sums depend on the problem's size, so the blocks are a
// property of the product alone: made tile by tile inside its reader or whole into a buffer, it
// has the same bits.
int64_t matmul_row_block(const MatmulCall& mm, DType t);

// Rows of B per block in which the CPU sums a long weight gradient xᵀ·δ (float32, batch 1, A
// column-major, B row-major and over 2 MiB, the product within 1 MiB, not made in row blocks), or
// 0 when it sums it in one call. Like the row blocks, a property of the product alone: B made block by block inside the
// product (MatmulTiles::operand) or read whole from a buffer, the sums take the same steps.
int64_t matmul_k_block(const MatmulCall& mm, DType t);

// Moves each qualifying Matmul kernel into its reader (Kernel::tiles, Kernel::matmul), where the
// reader stood, and shrinks the product's slot to one tile; then each elementwise kernel that
// makes the B operand of a K-blocked product, and nothing else, into that product's place, its
// slot shrunk to one block (MatmulTiles::operand). Returns how many it moved.
int tile_matmuls(Program& program);

}  // namespace kiln::jit
