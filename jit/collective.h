// Collectives inside a plan. An AllReduce node is a kernel of its own that the executor starts
// where the schedule put it (as soon as its input is computed) and waits for only before the
// first kernel that reads its result, so the kernels in between (the rest of a backward pass)
// run while the bytes travel. Send and Recv nodes (pipeline stages) are started the same way; a
// send is never waited for. The engine that moves them (MPI, distributed/communicator.cc)
// registers itself here, so the JIT does not depend on it.
#pragma once
#include <cstdint>
#include <memory>

#include "core/dtype.h"

namespace kiln::jit {

class CollectiveEngine {
 public:
  virtual ~CollectiveEngine() = default;
  // Starts a sum (op 0) or maximum (op 2) all-reduce of `count` elements of `dtype` in place on
  // host memory `data` among the ranks of `group` (0: the world; distributed::Group::id());
  // returns a handle for wait().
  virtual int64_t start_all_reduce(void* data, int64_t count, DType dtype, int64_t op, int64_t group) = 0;
  // Starts sending `count` elements at `data` to rank `peer` with `tag`. Nothing waits for it: the
  // engine keeps `keep` (the memory under `data`) until the message has gone, and a message still
  // not received after the collective timeout becomes an Error in a later call.
  virtual void start_send(const void* data, int64_t count, DType dtype, int64_t peer, int64_t tag,
                          std::shared_ptr<void> keep) = 0;
  // Starts receiving `count` elements from rank `peer` with `tag` into `data`; wait() for it.
  virtual int64_t start_recv(void* data, int64_t count, DType dtype, int64_t peer, int64_t tag) = 0;
  // Abandons a receive that a failed plan no longer waits for: it will not write into its buffer
  // (a message that already arrived is dropped).
  virtual void cancel(int64_t handle) noexcept = 0;
  // Blocks until the collective `handle` has finished (or throws after the collective timeout).
  virtual void wait(int64_t handle) = 0;
  // Lets collectives in flight advance (MPI moves bytes only inside its calls); cheap.
  virtual void progress() = 0;
};

// The engine plans run their collectives on; null until distributed::init() joins a world of
// more than one process.
void set_collective_engine(CollectiveEngine* engine);
CollectiveEngine* collective_engine();

}  // namespace kiln::jit
