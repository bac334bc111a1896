// NCCL for CUDA tensors on real GPUs: one communicator per device among the ranks, made on first
// use from a unique id that rank 0 creates and the communicator's MPI broadcast hands to all.
// The collectives run on kiln's stream for the device, so they are ordered with its kernels.
// Builds without NCCL (then nccl_built() is false and the host path is used).
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "core/device.h"
#include "core/dtype.h"

namespace kiln::distributed {

bool nccl_built();

// This rank's communicator on `device` among `world` ranks (created once); null when NCCL cannot
// make one here (e.g. two ranks on one GPU, which NCCL refuses), with the reason in `why`.
// `share_id(bytes, size)` must broadcast rank 0's bytes to every rank (collective).
void* nccl_comm(Device device, int rank, int world, const std::function<void(void*, size_t)>& share_id,
                std::string& why);

// In place on device memory `data`: the sum (op 0) or maximum (op 2) over the ranks.
void nccl_all_reduce(void* comm, void* data, int64_t count, DType dtype, int64_t op, Device device);

}  // namespace kiln::distributed
