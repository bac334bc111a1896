// Compression of saved activations (KILN_COMPRESS_ACTIVATIONS=int8, kiln::CompressActivationsGuard,
// nn::compress_activations): an executor pass that keeps what the backward reads of the forward
// in 8 bits, or 1, instead of full width, in the spirit of ActNN.
//
//   KILN_COMPRESS_ACTIVATIONS=int8 ./build/samples/train_mnist --model cnn
//   { kiln::CompressActivationsGuard int8(true); logits = model.forward(x); }  // this forward only
//
// A float value x recorded with compression on, that the backward of the same plan reads, gets
// q = round(x / s) as int8 with s = max|x| / 126 over groups of its trailing axes (the fewest
// trailing axes holding 32 elements or more; a tensor that needs all its axes for that is kept),
// computed with the forward; the backward reads q * s
// (fused into its kernels). Rounding keeps the sign: a nonzero x never becomes 0, so a mask the
// backward takes of it (relu's y > 0) is exact. A value the backward only compares with a
// constant (a relu output that max pooling reads: its mask is all the backward needs) is kept as
// the comparison's bits, 8 to a byte. Kept at full width: small values (logits (B, 10)),
// integer and bool values, weights, values a user holds, and values a recomputation reads
// (recomputed activations must equal the forward's). Infinities and NaN are kept exactly (three
// codes of their own; the scale is taken over the finite values), so a -inf attention mask
// survives.
#pragma once
#include <vector>

#include "core/node.h"

namespace kiln::memory {

struct Compression {
  int values = 0;          // saved values compressed (as int8 or as masks)
  int64_t full_bytes = 0;  // their bytes at full width
  int64_t kept_bytes = 0;  // the bytes kept instead: int8 values and scales, or bits
};

// Rewires the backward readers of saved values recorded with compression on to compressed
// copies, in `nodes` (a pending graph, inputs before consumers). The caller collects the graph
// again when values is not 0.
Compression compress_saved_activations(const std::vector<NodePtr>& nodes);

}  // namespace kiln::memory
