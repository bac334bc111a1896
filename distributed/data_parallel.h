// Data parallel training: every rank runs the same model on its own shard of the batch, and the
// gradients are averaged over the ranks (bucketed all-reduces) before the optimizer applies them,
// so every rank takes the same step as one process would on the whole batch.
//
//   kiln::distributed::init();
//   Net net;
//   kiln::distributed::DataParallel model(net);      // rank 0's weights on every rank
//   optim::SGD opt(model.parameters(), optim::SGDOptions(0.1).momentum(0.9));
//   opt.step(cross_entropy(model.forward(x), y));    // gradients averaged over the ranks
//
// Gradients are averaged when the optimizer applies them (not during backward()). Gradient
// accumulation: `model.accumulate(k)`, then opt.step(loss) per micro-batch (one all-reduce and
// one update per k), or backward() on k micro-batches and one opt.step(). Inside a NoSyncGuard
// the optimizer applies each rank's own gradients.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "distributed/communicator.h"
#include "nn/module.h"

namespace kiln::distributed {

class Reducer;  // data_parallel.cc

// How the gradients of a DataParallel travel.
struct BucketPlan {
  std::vector<std::vector<size_t>> buckets;  // parameter indices, in all-reduce order
};

class DataParallel : public nn::Module {
 public:
  // Wraps `module` (copies of a module alias it: training `model` trains `module`). Calls init()
  // if needed, checks that every rank has the same parameters (names, shapes, dtypes), and
  // broadcasts rank 0's parameters and buffers. Throws kiln::Error naming the first parameter
  // that differs and the ranks. `group`: the replicas (default: every rank); with a pipeline or
  // tensor-parallel group on the other axis, a 2-D layout (distributed::new_group).
  explicit DataParallel(nn::AnyModule module, Group group = {});

  Tensor forward(const Tensor& x) override { return module_.forward(x); }
  nn::AnyModule& module() { return module_; }

  // The buckets for the current KILN_BUCKET_MB: gradients in reverse registration order (the
  // order backward produces them), the first bucket capped at 1 MiB, the others at bucket_mb MiB;
  // a bucket holds one dtype on one device.
  BucketPlan bucket_plan() const;
  // All-reduces performed so far (by every step through this wrapper), for tests and benchmarks.
  int64_t all_reduce_count() const;
  // Gradient accumulation: each optimizer step on this model's parameters (opt.step(loss) or
  // backward(); step()) now counts as one micro-batch; every k-th applies the mean of the last
  // k micro-batches' gradients, all-reduced once, and the others update nothing. k = 1: off.
  // In a world of 1 it is plain accumulation.
  void accumulate(int64_t k);

 private:
  friend class NoSyncGuard;
  nn::AnyModule module_;
  std::shared_ptr<Reducer> reducer_;
};

// While alive, optimizer steps apply each rank's own gradients of this DataParallel, without an
// all-reduce (PyTorch's no_sync()). Not needed for gradient accumulation, which reduces at the step.
class NoSyncGuard {
 public:
  explicit NoSyncGuard(DataParallel& model);
  ~NoSyncGuard();
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  std::shared_ptr<Reducer> reducer_;
  bool previous_;
};

}  // namespace kiln::distributed
