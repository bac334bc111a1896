// Max pooling over windows that tile the input, on the host (prim::max_pool_offsets and
// prim::max_pool_gather): the JIT's loops over a window's stride-2 elements compile to scalar
// code with branches (GCC 12 does not vectorize them), ~10x slower than the memory they read;
// these kernels use AVX-512 where the CPU has it.
//
//   cpu::max_pool_offsets(DType::Float32, DType::Int8, x, offsets, planes, OH, OW, 2, 2);
//   cpu::max_pool_gather(DType::Float32, DType::Int8, x, offsets, y, planes, OH, OW, 2, 2);
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace kiln::cpu {

// Whether max_pool_offsets takes inputs of this dtype (float32, float64, bfloat16).
bool supports_max_pool_offsets(DType t);

// x: contiguous (planes, OH * kh, OW * kw) of dtype t; out: (planes, OH, OW) of offset_t (Int8 or
// Int32), each the offset a * (OW * kw) + b of its window's first maximum in row-major order, the
// first NaN where the window holds one.
void max_pool_offsets(DType t, DType offset_t, const void* x, void* out, int64_t planes, int64_t OH, int64_t OW,
                      int64_t kh, int64_t kw);

// out: (planes, OH, OW) of dtype t, each the element of its window at `offsets` (as above). An
// offset outside its window throws kiln::Error.
void max_pool_gather(DType t, DType offset_t, const void* x, const void* offsets, void* out, int64_t planes,
                     int64_t OH, int64_t OW, int64_t kh, int64_t kw);

// The gather's gradient. g: (planes, OH, OW) of dtype t; out: contiguous (planes, OH * kh, OW * kw),
// each window g's value at its offset (plus +0.0, as a scatter-add into zeros: a -0.0 lands as
// +0.0) and +0.0 elsewhere. An offset outside its window throws kiln::Error.
void max_pool_scatter(DType t, DType offset_t, const void* g, const void* offsets, void* out, int64_t planes,
                      int64_t OH, int64_t OW, int64_t kh, int64_t kw);

}  // namespace kiln::cpu
