// bfloat16 matmul on Intel's AMX tile unit: kiln's own kernel, run where the CPU has AMX-BF16 in
// place of oneDNN 2.6's, which reached about half the tile unit's rate at a training step's shapes.
//
//   if (kiln::cpu::amx_matmul_available())  // bfloat16 a, b and c; strides as onednn_matmul's
//     kiln::cpu::amx_matmul(a, a_strides, b, b_strides, c, batch, M, K, N);
#pragma once
#include <cstdint>

namespace kiln::cpu {

// True when the CPU has AMX-BF16 and the kernel grants this process the tile state (asked once),
// and amx_matmul_enable has not turned it off.
bool amx_matmul_available();
// Turns kiln's AMX kernel off (bfloat16 products go to oneDNN) or back on where the CPU has it:
// for tests and benchmarks comparing the two. Returns the previous setting.
bool amx_matmul_enable(bool on);

// C[b] = A[b] @ B[b] for b in [0, batch), bfloat16 operands and result, summed in float32 over K in
// steps of 32 from k = 0 and rounded once to nearest even as core/dtype.cc rounds (the tile unit
// itself, as in oneDNN's AMX kernels, treats denormal inputs and sums as zero). The
// operands' element strides are {batch, row, col}, any sign; a batch stride of 0 broadcasts.
// C is (batch, M, N), contiguous. Each element's value depends only on its row of A and column of
// B, so a block of rows computed alone has the whole product's bits.
void amx_matmul(const void* a, const int64_t a_strides[3], const void* b, const int64_t b_strides[3], void* c,
                int64_t batch, int64_t M, int64_t K, int64_t N);

}  // namespace kiln::cpu
