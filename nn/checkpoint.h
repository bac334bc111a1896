// nn::checkpoint: activation checkpointing for a module (and nn::compress_activations: int8
// saved activations for a module, at the end). y = nn::checkpoint(block, x) runs
// block.forward(x) now and keeps only x (and the parameters) for the backward; the activations
// inside block are recomputed when the backward needs them. Gradients are bit-identical to
// block.forward(x)'s, dropout included (the recomputed mask reuses the original's random numbers).
//
//   struct Net : nn::Module {
//     nn::Sequential block1 = register_module("block1", nn::Sequential(nn::Linear(512, 512), nn::ReLU(), ...));
//     nn::Sequential block2 = register_module("block2", nn::Sequential(...));
//     Tensor forward(const Tensor& x) override {
//       Tensor h = nn::checkpoint(block1, x);   // (B, 512); block1's insides are recomputed
//       return nn::checkpoint(block2, h);
//     }
//   };
//
// Any module runs through its virtual forward (a Module& to a derived module, an nn::AnyModule);
// for several inputs or a plain function, use kiln::checkpoint (memory/recompute.h), which this
// wraps. Checkpointing one segment that covers the whole model saves nothing: it is all
// recomputed at once. Under NoGradGuard, or in eager mode (KILN_LAZY=0), it is a plain forward.
#pragma once
#include "core/autograd.h"
#include "memory/recompute.h"
#include "nn/module.h"

namespace kiln::nn {

inline Tensor checkpoint(Module& module, const Tensor& x) {
  // The function runs once, right here: kiln::checkpoint records it and copies its nodes for
  // the backward, so capturing by reference is safe.
  return kiln::checkpoint([&module](const Tensor& t) { return module.forward(t); }, x);
}

// block.forward(x) with the activations it saves for the backward kept as int8 (memory/compress.h),
// whatever KILN_COMPRESS_ACTIVATIONS says: compression for one module, as checkpoint is
// recomputation for one.
inline Tensor compress_activations(Module& module, const Tensor& x) {
  CompressActivationsGuard on(true);
  return module.forward(x);
}

}  // namespace kiln::nn
