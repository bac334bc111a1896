// Max pooling's window arg-max on the host (prim::max_pool_offsets): the JIT's select chain over
// a window's stride-2 elements compiles to branches (GCC 12 does not vectorize it), ~10x slower
// than the memory it reads; this kernel uses AVX-512 where the CPU has it.
//
//   cpu::max_pool_offsets(DType::Float32, DType::Int8, x, out, planes, OH, OW, 2, 2);
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace kiln::cpu {

// Whether max_pool_offsets takes inputs of this dtype (float32, float64).
bool supports_max_pool_offsets(DType t);

// x: contiguous (planes, OH * kh, OW * kw) of dtype t; out: (planes, OH, OW) of offset_t (Int8 or
// Int32), each the offset a * (OW * kw) + b of its window's first maximum in row-major order, the
// first NaN where the window holds one.
void max_pool_offsets(DType t, DType offset_t, const void* x, void* out, int64_t planes, int64_t OH, int64_t OW,
                      int64_t kh, int64_t kw);

}  // namespace kiln::cpu
