// NCCL communicators and calls. See nccl.h.
#include "distributed/nccl.h"

#include <map>
#include <mutex>

#include "backends/cuda/cuda_runtime.h"
#include "core/error.h"

#if KILN_WITH_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace kiln::distributed {

#if KILN_WITH_NCCL

namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::Float32: return ncclFloat32;
    case DType::Float64: return ncclFloat64;
    case DType::Float16: return ncclFloat16;
    case DType::BFloat16: return ncclBfloat16;
    case DType::Int32: return ncclInt32;
    case DType::Int64: return ncclInt64;
    case DType::Int8: return ncclInt8;
    case DType::UInt8: return ncclUint8;
    default: KILN_FAIL("distributed::all_reduce", "NCCL has no type for {}", dtype_name(t));
  }
}

struct Comms {
  std::mutex mutex;
  std::map<int, ncclComm_t> by_device;
  std::map<int, std::string> refused;  // devices where NCCL said no, and why
};

Comms& comms() {
  static auto& c = *new Comms;  // never destroyed: ncclCommDestroy at exit may race the driver's teardown
  return c;
}

}  // namespace

bool nccl_built() { return true; }

void* nccl_comm(Device device, int rank, int world, const std::function<void(void*, size_t)>& share_id,
                std::string& why) {
  Comms& c = comms();
  std::lock_guard<std::mutex> lock(c.mutex);
  if (auto it = c.by_device.find(device.index); it != c.by_device.end()) return it->second;
  if (auto it = c.refused.find(device.index); it != c.refused.end()) {
    why = it->second;
    return nullptr;
  }
  ncclUniqueId id{};
  if (rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    KILN_CHECK(r == ncclSuccess, "distributed", "ncclGetUniqueId failed: {}", ncclGetErrorString(r));
  }
  share_id(&id, sizeof id);  // every rank, so that all of them leave together
  cudaSetDevice(device.index);
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRank(&comm, world, id, rank);
  if (r != ncclSuccess) {
    why = fmt::format("ncclCommInitRank failed on {} (rank {} of {}): {}", device.str(), rank, world,
                      ncclGetErrorString(r));
    c.refused[device.index] = why;
    return nullptr;
  }
  c.by_device[device.index] = comm;
  return comm;
}

void nccl_all_reduce(void* comm, void* data, int64_t count, DType dtype, int64_t op, Device device) {
  cudaStream_t stream = static_cast<cudaStream_t>(cuda::stream(device.index));
  ncclResult_t r = ncclAllReduce(data, data, static_cast<size_t>(count), nccl_type(dtype), op == 2 ? ncclMax : ncclSum,
                                 static_cast<ncclComm_t>(comm), stream);
  KILN_CHECK(r == ncclSuccess, "distributed::all_reduce", "ncclAllReduce of {} {} values on {} failed: {}", count,
             dtype_name(dtype), device.str(), ncclGetErrorString(r));
}

#else

bool nccl_built() { return false; }

void* nccl_comm(Device, int, int, const std::function<void(void*, size_t)>&, std::string& why) {
  why = "kiln was built without NCCL";
  return nullptr;
}

void nccl_all_reduce(void*, void*, int64_t, DType, int64_t, Device) {
  KILN_FAIL("distributed::all_reduce", "kiln was built without NCCL");
}

#endif

}  // namespace kiln::distributed
