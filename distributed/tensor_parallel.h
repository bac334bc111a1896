// Tensor parallel layers (Megatron-style): one layer's weight split across the ranks, every rank
// computing its share of each output from the same input, and the graph nodes that move values
// between the replicated and the split form, each with its gradient.
//
//   kiln::distributed::init();                                  // mpirun -np 2
//   distributed::ColumnParallelLinear fc1(784, 512);            // this rank: 256 of the outputs
//   distributed::RowParallelLinear fc2(512, 10);                // this rank: 256 of the inputs
//   Tensor logits = fc2.forward(relu(fc1.forward(x)));          // one all-reduce; one in backward
//
// Every rank feeds the same input and computes the same loss from the same output (the
// replicated loss of tensor parallelism, unlike data parallel's per-rank losses), so gradients
// of replicated values are the same on every rank and need no reduction; only the gradient of a
// column-parallel layer's input is summed over the ranks. Every function and layer takes an
// optional Group (distributed/communicator.h): the ranks that split the layer; by default, all.
#pragma once
#include <cstdint>

#include "distributed/communicator.h"
#include "nn/layers.h"

namespace kiln::distributed {

// Rank r's block r of `t` along `dim` (whose size must divide by the world); `t` is the same on
// every rank. The gradient is the gather of the blocks' gradients. World of 1: t.
Tensor split(const Tensor& t, int64_t dim, const Group& group = {});
// Every rank's `t` laid end to end along `dim` (one all-reduce of the zero-padded blocks); each
// rank's gradient is its block of the output's gradient. World of 1: t.
Tensor gather(const Tensor& t, int64_t dim, const Group& group = {});
// The sum of every rank's `t` (one all-reduce), read as a replicated value: its gradient passes
// through unchanged (Megatron's g). Differs from all_reduce(), whose gradient is all-reduced
// because each rank's loss is its own.
Tensor reduce_from_ranks(const Tensor& t, const Group& group = {});
// The identity on a replicated `t` whose gradient is summed over the ranks, one all-reduce in
// backward (Megatron's f): the input of per-rank computations.
Tensor copy_to_ranks(const Tensor& t, const Group& group = {});

// y = x @ weight^T + bias with the outputs split over the ranks: this rank holds rows
// [r * out / world, (r + 1) * out / world) of the dense layer's weight (out, in) and bias, and
// returns its block of y's last axis (or all of y with gather_output). The same seed gives the
// dense nn::Linear's weight, sharded: construction draws the whole dense weight and keeps a block.
class ColumnParallelLinear : public nn::Module {
 public:
  ColumnParallelLinear(int64_t in_features, int64_t out_features, bool gather_output = false)
      : ColumnParallelLinear(nn::LinearOptions(in_features, out_features), gather_output) {}
  ColumnParallelLinear(const nn::LinearOptions& options, bool gather_output, Group group = {});
  Tensor forward(const Tensor& x) override;
  Tensor weight;  // (out / world, in)
  Tensor bias;    // (out / world), undefined without bias

 private:
  nn::LinearOptions options_;
  bool gather_output_;
  Group group_;
};

// y = x @ weight^T + bias with the inputs split over the ranks: this rank holds columns
// [r * in / world, (r + 1) * in / world) of the dense weight and all of the bias; the partial
// products are summed over the ranks with one all-reduce. x is this rank's block of the input's
// last axis (a ColumnParallelLinear's output) or, without input_is_parallel, the whole input.
class RowParallelLinear : public nn::Module {
 public:
  RowParallelLinear(int64_t in_features, int64_t out_features, bool input_is_parallel = true)
      : RowParallelLinear(nn::LinearOptions(in_features, out_features), input_is_parallel) {}
  RowParallelLinear(const nn::LinearOptions& options, bool input_is_parallel, Group group = {});
  Tensor forward(const Tensor& x) override;
  Tensor weight;  // (out, in / world)
  Tensor bias;    // (out), the same on every rank

 private:
  nn::LinearOptions options_;
  bool input_is_parallel_;
  Group group_;
};

}  // namespace kiln::distributed
