// Batched matrix multiply on the CPU through oneDNN, for float32 and (where the CPU has it) bfloat16.
// Operands are described by element strides, so transposed views and broadcast batches need no copy:
//
//   if (kiln::cpu::onednn_supports_matmul(DType::Float32)) {
//     int64_t a_strides[3] = {0, K, 1};       // one (M, K) matrix shared by every batch
//     int64_t b_strides[3] = {K * N, 1, K};   // each (K, N) matrix stored transposed
//     kiln::cpu::onednn_matmul(DType::Float32, a, a_strides, b, b_strides, c, batch, M, K, N);
//   }
#pragma once
#include <cstdint>

#include <string>

#include "core/dtype.h"

namespace kiln::cpu {

// True when oneDNN computes matmul for this dtype on this CPU: always for float32; for bfloat16
// only when a native (non-reference) kernel exists, probed once.
bool onednn_supports_matmul(DType t);

// C[b] = A[b] @ B[b] for b in [0, batch), accumulating in fp32.
//   a: (batch, M, K) at element strides a_strides = {batch, row, col}; batch stride 0 broadcasts
//   b: (batch, K, N) at element strides b_strides = {batch, row, col}
//   c: (batch, M, N) contiguous, same dtype as a and b
// bfloat16 products run kiln's own AMX kernel instead where the CPU has one (backends/cpu/amx_matmul.h).
// Layouts oneDNN only handles with its slow reference kernel (no unit stride in a matrix,
// negative strides, interleaved batches) are copied to contiguous buffers first.
// Throws kiln::Error for unsupported dtypes, negative sizes, or a oneDNN failure.
void onednn_matmul(DType t, const void* a, const int64_t a_strides[3], const void* b,
            const int64_t b_strides[3], void* c, int64_t batch, int64_t M, int64_t K, int64_t N);
// Rows [row0, row0 + rows) of the (M, N) product onednn_matmul makes (batch 1), into c (rows x N,
// contiguous), by the routine the whole product would take: each row gets the same bits.
void onednn_matmul_rows(DType t, const void* a, const int64_t a_strides[3], const void* b, const int64_t b_strides[3],
                        void* c, int64_t M, int64_t K, int64_t N, int64_t row0, int64_t rows);
// Rows [k0, k0 + rows) of the sum over K of a float32 product xᵀ·δ (batch 1; A column-major with
// leading dimension lda, B row-major with ldb): c (M, N, contiguous) = A[:, k0:k0+rows] @ B[k0:k0+rows, :],
// added to c unless k0 is 0. b_rows points at B's row k0. jit::matmul_k_block gives the blocks.
void onednn_matmul_k_part(const float* a, int64_t lda, const float* b_rows, int64_t ldb, float* c, int64_t M,
                          int64_t N, int64_t k0, int64_t rows);

}  // namespace kiln::cpu

namespace kiln::cpu {

// C = A @ B summed in int32, as float32: the int8 matmul of a dynamically quantized Linear.
//   a: (M, K) int8, contiguous; b: (K, N) int8, contiguous (the weight, transposed once); c: (M, N)
// AVX-512 VNNI or AMX where the CPU has them. Throws kiln::Error on failure. With b_packed, b is
// the weight as onednn_pack_int8_weight laid it out: no repacking on each call.
void onednn_quantized_matmul(const void* a, const void* b, float* c, int64_t M, int64_t K, int64_t N,
                             bool b_packed = false);
// The largest weight magnitude onednn_quantized_matmul sums exactly: 127 where the CPU has VNNI
// (or AMX); 63 elsewhere, where oneDNN adds pairs of u8 x s8 products in int16 (vpmaddubsw), which
// saturates for 255 x 127 x 2 but not for 255 x 63 x 2 (PyTorch's fbgemm narrows its range too).
int onednn_int8_weight_limit();
// The bytes of a (K, N) int8 weight in the blocked layout oneDNN's int8 matmul reads on this CPU,
// or 0 when that layout is the plain one (nothing to gain by packing).
int64_t onednn_packed_int8_weight_bytes(int64_t K, int64_t N);
// Lays a plain (K, N) int8 weight out in that layout, into `packed` (that many bytes).
void onednn_pack_int8_weight(const void* plain, void* packed, int64_t K, int64_t N);
// The oneDNN implementation that runs (M, K) x (K, N) int8 here, e.g. "brg:avx512_core_vnni".
std::string onednn_quantized_matmul_impl(int64_t M, int64_t K, int64_t N);

}  // namespace kiln::cpu
