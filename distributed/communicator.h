// The world of processes a program runs in and the collectives between them: OpenMPI for host
// tensors when the program is started by `mpirun`, a world of one (every collective the identity)
// when it is not, so single-process programs and tests need no launcher.
//
//   kiln::distributed::init();                       // mpirun -np 2 ./train  ->  ranks 0 and 1
//   Tensor g = kiln::distributed::all_reduce(grad, kiln::distributed::ReduceOp::Mean);
//   if (kiln::distributed::rank() == 0) save(...);
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace kiln::distributed {

enum class ReduceOp : uint8_t { Sum, Mean, Max };

// A set of the world's ranks whose collectives run among themselves: one axis of a 2-D layout
// (the data-parallel replicas of one pipeline stage, or the stages of one replica). A default
// Group is the whole world. Made by new_group().
class Group {
 public:
  Group() = default;  // the world
  bool is_world() const { return id_ == 0; }
  bool contains_me() const;  // this process is a member
  // Throws kiln::Error naming `op`, this rank and the group's ranks when this process is not a member.
  void require_me(const char* op) const;
  int rank() const;          // this process's index in the group; -1 when it is not a member
  int size() const;
  int world_rank(int group_rank) const;  // the world rank of a member
  int64_t id() const { return id_; }     // 0: the world; then 1, 2, ... in creation order
  const std::vector<int>& ranks() const { return ranks_; }  // world ranks, ascending; empty: the world

 private:
  friend Group new_group(std::vector<int> ranks);
  int64_t id_ = 0;
  std::vector<int> ranks_;
};

// A group of the given world ranks. Every rank calls it, member or not, with the same ranks and
// in the same order as the other calls (as torch.distributed.new_group); throws kiln::Error on a
// rank outside the world or a repeated one. In a world of 1: a group of rank 0.
Group new_group(std::vector<int> ranks);

// Joins the world: under mpirun (or another MPI launcher) initializes MPI and reads this
// process's rank and the world size; otherwise a world of 1. Idempotent. Throws kiln::Error when
// launched with more than one process by a kiln built without MPI.
void init();
bool initialized();
int rank();        // 0 when not initialized
int world_size();  // 1 when not initialized

// Every rank (of the group) waits here for the others (a no-op in a world of 1).
void barrier(const Group& group = {});

// Collectives: every rank calls them in the same order with tensors of the same shape and dtype
// (all_gather: the same dtype and trailing shape); each waits at most KILN_COLLECTIVE_TIMEOUT
// seconds for the others and then throws. In a world of 1 each returns its input's values.
// With a group, only its members call it (an Error elsewhere), and ranks are group ranks.
//
// all_reduce of a host tensor is lazy, a node of the graph like any op (with a gradient: the
// all-reduced output gradient, for a sum or mean): the plan that needs its value starts it as
// soon as its input is computed and waits for it just before the first kernel that reads the
// result, running the kernels in between meanwhile. Every rank must realize it (in whatever plan)
// for any to finish. On a CUDA tensor it runs at once, through the host, without gradient.
// float16/bfloat16 are reduced in float32 (MPI has no such types).
Tensor all_reduce(const Tensor& t, ReduceOp op = ReduceOp::Sum, const Group& group = {});
// These run at once: they realize their input and return realized tensors on its device
// (values only: no gradient flows through them).
Tensor broadcast(const Tensor& t, int root = 0, const Group& group = {});  // rank root's value on every rank
Tensor all_gather(const Tensor& t, const Group& group = {});  // every rank's t, concatenated along axis 0
// The reduction of every rank's t, split along axis 0 (whose size must divide by the world):
// rank r gets block r.
Tensor reduce_scatter(const Tensor& t, ReduceOp op = ReduceOp::Sum);
void send(const Tensor& t, int to, int tag = 0);
// Receives what rank `from` sent with `tag`; shape and dtype must match what it sent.
Tensor recv(const Shape& shape, DType dtype, int from, int tag = 0);

}  // namespace kiln::distributed
