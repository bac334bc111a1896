// Offload of saved activations to host memory (KILN_OFFLOAD=auto|off|all; the seed's "CPU-GPU
// memory sharing"): on a CUDA device, a value the forward writes and the backward reads is copied
// to pinned host memory after its last forward reader and fetched back ahead of its first
// backward reader, so its device memory serves other buffers in between. Exact: the bytes come
// back as they went.
//
//   KILN_OFFLOAD=all KILN_USE_CUDA=1 ./build/samples/train_gpt     // every saved activation
//   KILN_OFFLOAD=auto KILN_MEMORY_BUDGET=0.5 ...                   // what a budget needs (default)
//
// A pass over the lowered program (jit/plan.cc runs it before memory planning): each offloaded
// value gets four Transfer kernels (jit/kernel_ir.h) — the copy out starts after the last forward
// reader and is joined a few kernels later (the value's device memory lives until the join), the
// copy back starts a few kernels before the first backward reader into a new buffer that the
// backward then reads, and is joined just before it. "A few" is as many kernels as the device
// model below says the copy takes, so on a GPU the copies run on a second stream beside them.
// The host copies get offsets in a host arena of their own, planned like the device's.
//
// The choice: under `all`, every candidate; under `auto`, only when a memory budget is over the
// plan's arena: the largest candidates whose round trip hides behind the kernels between their
// forward and backward use, as few as bring the arena under the budget (the budget's recomputation
// then does the rest, memory/recompute.h). On the CPU, where host memory is device memory,
// offload does nothing (said once).
#pragma once
#include <cstdint>
#include <vector>

#include "jit/lower.h"

namespace kiln::jit {

// The device the choice is made for: an H200-class GPU on PCIe 5 (the copy rate is what pinned
// copies reach one way, not the link's peak).
struct DeviceModel {
  double copy_bytes_per_s = 25e9;
  double memory_bytes_per_s = 3e12;
  double flops_per_s = 50e12;
  double launch_s = 4e-6;
};

// A value the pass may offload: its buffer, its last reader before the backward's first (its
// writer when none), its first backward reader, where its copy out and its wait for the copy back
// go (before kernels `begin` and `end`: outside row groups), its size, and the estimated time of
// one copy and of the kernels between the two readers.
struct OffloadCandidate {
  int slot = -1;
  int last_forward = -1;
  int first_backward = -1;
  int begin = -1, end = -1;
  int64_t bytes = 0;
  double copy_s = 0, gap_s = 0;
  bool hides() const { return 2 * copy_s <= gap_s; }
};

// Every offloadable value of `program`, largest first: an intermediate written by a forward
// kernel and read by a backward one, with room for the copies between its last forward and first
// backward reader. `group_start`: the backend's row groups (Backend::row_groups; empty: none),
// which transfers never split — a group run as separate kernels may round differently.
std::vector<OffloadCandidate> offload_candidates(const Program& program, const std::vector<int>& group_start = {},
                                                 const DeviceModel& model = {});

// Rewrites `program`: the transfer kernels of `chosen` (candidates of this program, found with
// the same `group_start`), a host slot and a fetched device slot per value, the backward's reads
// moved to the fetched one.
void insert_offloads(Program& program, const std::vector<OffloadCandidate>& chosen,
                     const std::vector<int>& group_start = {}, const DeviceModel& model = {});

// Estimated time of kernel `k` on the model's device: its bytes at memory speed or its FLOPs at
// peak (matmul, convolution, attention), whichever is longer, plus a launch.
double estimated_seconds(const Program& program, const Kernel& k, const DeviceModel& model);

}  // namespace kiln::jit
