// The world and its collectives over MPI. Every MPI call is non-blocking and polled against the
// collective timeout, so a rank that dies or skips a collective turns into an Error on the
// others instead of a hang. See communicator.h.
#include "distributed/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <mutex>
#include <unordered_map>

#include "core/error.h"
#include "core/flags.h"
#include "backends/cuda/cuda_runtime.h"
#include "distributed/nccl.h"
#include "jit/collective.h"
#include "memory/profile.h"
#include "ops/ops.h"
#include "ops/primitive.h"

#if KILN_WITH_MPI
// The C API only: OpenMPI's and MPICH's headers otherwise pull in C++ bindings that need a
// library kiln does not link.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace kiln::distributed {

namespace {

struct World {
  bool initialized = false;
  bool mpi = false;
  int rank = 0, size = 1;
  ~World();
};

World& world() {
  static World w;
  return w;
}

int64_t g_groups = 0;  // groups made so far: the next one's id is this + 1

#if KILN_WITH_MPI
// Communicators by group id (0: the world); MPI_COMM_NULL where this rank is not a member.
std::vector<MPI_Comm>& communicators() {
  static std::vector<MPI_Comm> comms{MPI_COMM_WORLD};
  return comms;
}

MPI_Comm communicator(int64_t group, const char* op) {
  auto& comms = communicators();
  KILN_CHECK(group >= 0 && group < static_cast<int64_t>(comms.size()) && comms[static_cast<size_t>(group)] != MPI_COMM_NULL,
             op, "rank {} is not a member of group {}", world().rank, group);
  return comms[static_cast<size_t>(group)];
}
#endif

// The world size an MPI launcher announces in the environment (OpenMPI, MPICH's Hydra, PMIx),
// or 0 when no launcher started this process.
int launcher_world_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"})
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0') return std::max(1, std::atoi(v));
  if (std::getenv("PMIX_RANK") != nullptr) return 1;
  return 0;
}

void require_init(const char* op) {
  KILN_CHECK(world().initialized, op, "call kiln::distributed::init() first (once, before any collective)");
}

// The tensor's values on the host, realized and contiguous (MPI reads them; nothing writes them).
// Values only: a collective's result carries no gradient history.
Tensor host_values(const Tensor& t) {
  Tensor h = t.device().is_cpu() ? t.detach() : t.detach().to(Device::cpu());
  h.realize();
  return h;
}

// A realized host tensor whose buffer a collective may write.
Tensor fresh_host(const Shape& shape, DType dtype) {
  Tensor out = zeros(shape, dtype);
  if (!out.device().is_cpu()) out = out.to(Device::cpu());
  out.realize();
  return out;
}

void* writable(const Tensor& t) { return const_cast<void*>(t.data()); }

// Back on the device the input came from.
Tensor like_input(Tensor host, const Tensor& input) {
  return input.device().is_cpu() ? host : host.to(input.device());
}

bool is_half(DType t) { return t == DType::Float16 || t == DType::BFloat16; }

#if KILN_WITH_MPI

MPI_Datatype mpi_type(DType t, const char* op) {
  switch (t) {
    case DType::Float32: return MPI_FLOAT;
    case DType::Float64: return MPI_DOUBLE;
    case DType::Int64: return MPI_INT64_T;
    case DType::Int32: return MPI_INT32_T;
    case DType::Int8: return MPI_INT8_T;
    case DType::UInt8: return MPI_UINT8_T;
    case DType::Bool: return MPI_C_BOOL;
    default: KILN_FAIL(op, "no MPI type for {}; cast to float32 first", dtype_name(t));
  }
}

MPI_Op mpi_op(ReduceOp op, DType t) {
  if (t == DType::Bool) return MPI_LOR;  // check_reduce allows only Max for bools
  return op == ReduceOp::Max ? MPI_MAX : MPI_SUM;
}

void check_mpi(int code, const char* op) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  KILN_FAIL(op, "MPI failed on rank {} of {}: {}", world().rank, world().size, std::string(text, length));
}

// Polls `request` until it completes or the collective timeout passes; `peer`: the one rank a
// receive waits for, or -1 for a collective.
void wait_request(MPI_Request& request, const char* op, int64_t peer = -1) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto limit = std::chrono::duration<double>(flags().collective_timeout);
  int done = 0;
  for (int polls = 0;; ++polls) {
    check_mpi(MPI_Test(&request, &done, MPI_STATUS_IGNORE), op);
    if (done) return;
    if (Clock::now() - start > limit && peer >= 0) {
      // A receive left posted would take the next message with its tag, meant for a later one.
      MPI_Cancel(&request);
      MPI_Wait(&request, MPI_STATUS_IGNORE);
      KILN_FAIL(op, "rank {} waited {} s (KILN_COLLECTIVE_TIMEOUT) for a message from rank {}: rank {} failed, exited, "
                "or runs another schedule",
                world().rank, flags().collective_timeout, peer, peer);
    }
    if (Clock::now() - start > limit)
      KILN_FAIL(op, "rank {} of {} waited {} s for the other ranks (KILN_COLLECTIVE_TIMEOUT): one of them failed, "
                "exited, or skipped this collective (every rank must call the same collectives in the same order)",
                world().rank, world().size, flags().collective_timeout);
    // Spin briefly (short collectives answer in microseconds), then give the core away.
    if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// An element or byte count as one MPI call takes it (an int).
int mpi_count(int64_t n, const char* op) {
  KILN_CHECK(n <= INT32_MAX, op, "{} elements (or bytes) are more than one MPI call takes (2^31 - 1); split the tensor",
             n);
  return static_cast<int>(n);
}

// A message tag as MPI takes it: every MPI guarantees tags up to 32767.
int mpi_tag(int64_t tag, const char* op) {
  KILN_CHECK(tag >= 0 && tag <= 32767, op, "message tag {} is outside [0, 32767], the tags every MPI accepts", tag);
  return static_cast<int>(tag);
}

// Starts a non-blocking MPI call (`start` fills in the request) and waits for it.
template <class Start> void run_mpi(const char* op, Start start) {
  MPI_Request request;
  check_mpi(start(&request), op);
  wait_request(request, op);
}

// Collectives inside plans (jit/collective.h): non-blocking on the group's communicator, polled.
class MpiEngine : public jit::CollectiveEngine {
 public:
  int64_t start_all_reduce(void* data, int64_t count, DType dtype, int64_t op, int64_t group) override {
    const char* name = "distributed::all_reduce";
    MPI_Request request;
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, data, mpi_count(count, name), mpi_type(dtype, name),
                             mpi_op(op == 2 ? ReduceOp::Max : ReduceOp::Sum, dtype), communicator(group, name), &request),
              name);
    std::lock_guard<std::mutex> lock(mutex_);
    requests_.emplace(next_, Request{request, -1});
    return next_++;
  }

  void wait(int64_t handle) override {
    Request r;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = requests_.find(handle);
      KILN_CHECK(it != requests_.end(), "distributed::all_reduce", "no collective in flight with handle {}", handle);
      r = it->second;
      requests_.erase(it);
    }
    wait_request(r.request, r.peer >= 0 ? "distributed::recv" : "distributed::all_reduce", r.peer);
  }

  void start_send(const void* data, int64_t count, DType dtype, int64_t peer, int64_t tag,
                  std::shared_ptr<void> keep) override {
    const char* name = "distributed::send";
    check_peer(peer, name);
    MPI_Request request;
    const int64_t bytes = count * static_cast<int64_t>(dtype_size(dtype));  // bytes: half types too
    check_mpi(MPI_Isend(data, mpi_count(bytes, name), MPI_BYTE, static_cast<int>(peer), mpi_tag(tag, name),
                        MPI_COMM_WORLD, &request),
              name);
    std::lock_guard<std::mutex> lock(mutex_);
    reap_sends();  // a rank that never waits for anything (progress()) still lets go of sent messages
    sends_.push_back({request, std::move(keep), Clock::now(), peer, tag});
  }

  int64_t start_recv(void* data, int64_t count, DType dtype, int64_t peer, int64_t tag) override {
    const char* name = "distributed::recv";
    check_peer(peer, name);
    MPI_Request request;
    const int64_t bytes = count * static_cast<int64_t>(dtype_size(dtype));
    check_mpi(MPI_Irecv(data, mpi_count(bytes, name), MPI_BYTE, static_cast<int>(peer), mpi_tag(tag, name),
                        MPI_COMM_WORLD, &request),
              name);
    std::lock_guard<std::mutex> lock(mutex_);
    requests_.emplace(next_, Request{request, peer});
    return next_++;
  }

  void cancel(int64_t handle) noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = requests_.find(handle);
    if (it == requests_.end()) return;
    MPI_Request request = it->second.request;
    requests_.erase(it);
    if (request == MPI_REQUEST_NULL) return;
    MPI_Cancel(&request);
    MPI_Wait(&request, MPI_STATUS_IGNORE);  // returns at once for a cancelled receive
  }

  void progress() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [handle, r] : requests_) {
      int done = 0;
      // A completed request becomes MPI_REQUEST_NULL, which wait() then finds done at once.
      MPI_Test(&r.request, &done, MPI_STATUS_IGNORE);
    }
    reap_sends();
  }

  // Waits (up to the collective timeout) for every send to be received: before MPI_Finalize,
  // which must not find a message in flight. Never throws.
  void flush_sends() noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    while (!sends_.empty()) {
      try {
        reap_sends();
      } catch (const std::exception& e) {
        fmt::print(stderr, "[kiln] {}\n", e.what());
        for (Send& s : sends_) MPI_Cancel(&s.request);
        sends_.clear();
        return;
      }
      if (!sends_.empty()) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Send {
    MPI_Request request;
    std::shared_ptr<void> keep;
    Clock::time_point since;
    int64_t peer, tag;
  };

  static void check_peer(int64_t peer, const char* name) {
    KILN_CHECK(peer >= 0 && peer < world().size && peer != world().rank, name,
               "rank {} cannot exchange a message with rank {} in a world of {}", world().rank, peer, world().size);
  }

  // Drops the sends that have gone; a send older than the collective timeout is an Error naming
  // the rank that never received it.
  void reap_sends() {
    const auto limit = std::chrono::duration<double>(flags().collective_timeout);
    for (size_t i = 0; i < sends_.size();) {
      int done = 0;
      check_mpi(MPI_Test(&sends_[i].request, &done, MPI_STATUS_IGNORE), "distributed::send");
      if (done) {
        sends_.erase(sends_.begin() + static_cast<std::ptrdiff_t>(i));
        continue;
      }
      if (Clock::now() - sends_[i].since > limit) {
        const Send s = sends_[i];
        sends_.erase(sends_.begin() + static_cast<std::ptrdiff_t>(i));
        KILN_FAIL("distributed::send",
                  "rank {} sent a message (tag {}) that rank {} has not received after {} s (KILN_COLLECTIVE_TIMEOUT): "
                  "rank {} failed, exited, or runs another schedule",
                  world().rank, s.tag, s.peer, flags().collective_timeout, s.peer);
      }
      ++i;
    }
  }

  std::mutex mutex_;
  struct Request {
    MPI_Request request;
    int64_t peer;  // a receive's sender; -1 for an all-reduce
  };
  std::unordered_map<int64_t, Request> requests_;
  std::vector<Send> sends_;  // started, not yet received, in start order
  int64_t next_ = 0;
};

MpiEngine* g_engine = nullptr;

#endif  // KILN_WITH_MPI

World::~World() {
#if KILN_WITH_MPI
  if (g_engine) g_engine->flush_sends();
  int finalized = 0;
  if (mpi && MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) MPI_Finalize();
#endif
}

// Reductions of half types run in float32: MPI has no such types, and a sum in float32 rounds once.
Tensor reduce_wide(const Tensor& t, ReduceOp op, Tensor (*reduce)(const Tensor&, ReduceOp)) {
  return cast(reduce(cast(t, DType::Float32), op), t.dtype());
}

void check_reduce(const Tensor& t, ReduceOp op, const char* name) {
  KILN_CHECK(op != ReduceOp::Mean || is_floating(t.dtype()), name,
             "a mean of {} values would truncate; use Sum and divide, or cast to a float type first", dtype_name(t.dtype()));
  KILN_CHECK(t.dtype() != DType::Bool || op == ReduceOp::Max, name, "bool tensors reduce with Max (logical or) only");
}

// A CUDA tensor on a real GPU, reduced by NCCL on kiln's stream into a fresh device buffer;
// undefined when NCCL cannot do it here (no NCCL, the emulator, two ranks on one GPU), and the
// caller takes the host path.
Tensor nccl_all_reduce_on_device(const Tensor& t, ReduceOp op) {
  if (!nccl_built() || !cuda::is_gpu(t.device()) || !world().mpi || t.numel() == 0 || t.dtype() == DType::Bool)
    return {};
  std::string why;
  void* comm = nccl_comm(t.device(), world().rank, world().size,
                         [](void* bytes, size_t size) {
                           Tensor id = from_vector<uint8_t>(std::vector<uint8_t>(static_cast<const uint8_t*>(bytes),
                                                                                 static_cast<const uint8_t*>(bytes) + size),
                                                            {static_cast<int64_t>(size)});
                           std::vector<uint8_t> shared = broadcast(id, 0).to_vector<uint8_t>();
                           std::memcpy(bytes, shared.data(), size);
                         },
                         why);
  if (comm == nullptr) {
    if (flags().log >= 1) fmt::print(stderr, "[kiln] all_reduce through the host: {}\n", why);
    return {};
  }
  Tensor in = t.detach();
  in.realize();
  Tensor out = zeros(t.shape(), t.dtype()).to(t.device());
  out.realize();
  const size_t bytes = static_cast<size_t>(t.numel()) * dtype_size(t.dtype());
  cuda::copy_on_device(t.device().index, writable(out), in.data(), bytes);
  nccl_all_reduce(comm, writable(out), t.numel(), t.dtype(), op == ReduceOp::Max ? 2 : 0, t.device());
  return op == ReduceOp::Mean ? out / static_cast<double>(world().size) : out;
}

}  // namespace

void init() {
  World& w = world();
  if (w.initialized) return;
  const int launched = launcher_world_size();
#if KILN_WITH_MPI
  if (launched > 0) {
    int already = 0;
    MPI_Initialized(&already);
    if (!already) {
      int provided = 0;
      // FUNNELED: only the thread that called init() makes MPI calls (kiln's data loader threads
      // and OpenMP teams never do).
      if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        KILN_FAIL("distributed::init", "MPI_Init_thread failed (launcher world size {})", launched);
    }
    // Errors come back as codes that become kiln::Error, instead of MPI aborting the job.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &w.rank), "distributed::init");
    check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &w.size), "distributed::init");
    w.mpi = true;
    if (w.size > 1) {
      // Never destroyed: plans may use it until exit, and ~World flushes its sends.
      g_engine = new MpiEngine;
      jit::set_collective_engine(g_engine);
    }
  }
#else
  KILN_CHECK(launched <= 1, "distributed::init",
             "this process was started by an MPI launcher with {} processes, but kiln was built without MPI; "
             "install libopenmpi-dev and rebuild kiln (CMake finds MPI by itself), or run a single process",
             launched);
#endif
  if (w.size > 1) memory::set_trace_process_name(fmt::format("kiln rank {} of {}", w.rank, w.size));
  w.initialized = true;
}

bool initialized() { return world().initialized; }
int rank() { return world().rank; }
int world_size() { return world().size; }

// Group ---------------------------------------------------------------------------------------

bool Group::contains_me() const { return rank() >= 0; }

void Group::require_me(const char* op) const {
  KILN_CHECK(contains_me(), op, "rank {} is not a member of the group of world ranks [{}]", world().rank,
             fmt::join(ranks_, ", "));
}

int Group::rank() const {
  if (ranks_.empty()) return world().rank;
  auto at = std::find(ranks_.begin(), ranks_.end(), world().rank);
  return at == ranks_.end() ? -1 : static_cast<int>(at - ranks_.begin());
}

int Group::size() const { return ranks_.empty() ? world().size : static_cast<int>(ranks_.size()); }

int Group::world_rank(int group_rank) const {
  KILN_CHECK(group_rank >= 0 && group_rank < size(), "distributed::Group", "rank {} is not a member of a group of {}",
             group_rank, size());
  return ranks_.empty() ? group_rank : ranks_[static_cast<size_t>(group_rank)];
}

Group new_group(std::vector<int> ranks) {
  const char* name = "distributed::new_group";
  require_init(name);
  std::sort(ranks.begin(), ranks.end());
  KILN_CHECK(!ranks.empty(), name, "a group needs at least one rank");
  for (size_t i = 0; i < ranks.size(); ++i)
    KILN_CHECK(ranks[i] >= 0 && ranks[i] < world().size && (i == 0 || ranks[i] != ranks[i - 1]), name,
               "ranks [{}] must be distinct ranks of this world of {}", fmt::join(ranks, ", "), world().size);
  Group g;
  g.id_ = ++g_groups;
  g.ranks_ = std::move(ranks);
#if KILN_WITH_MPI
  if (world().mpi) {
    // Collective over the world: members get a communicator, the others MPI_COMM_NULL.
    MPI_Comm comm = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(MPI_COMM_WORLD, g.contains_me() ? 0 : MPI_UNDEFINED, world().rank, &comm), name);
    if (comm != MPI_COMM_NULL) MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    communicators().push_back(comm);
  }
#endif
  return g;
}


void barrier(const Group& group) {
  const char* name = "distributed::barrier";
  require_init(name);
  group.require_me(name);
#if KILN_WITH_MPI
  if (!world().mpi || group.size() == 1) return;
  run_mpi(name, [&](MPI_Request* r) { return MPI_Ibarrier(communicator(group.id(), name), r); });
#endif
}

Tensor all_reduce(const Tensor& t, ReduceOp op, const Group& group) {
  const char* name = "distributed::all_reduce";
  require_init(name);
  group.require_me(name);
  check_reduce(t, op, name);
  const int n = group.size();
  if (n == 1) return t;
  if (is_half(t.dtype())) return cast(all_reduce(cast(t, DType::Float32), op, group), t.dtype());
  if (t.device().is_cpu() && t.dtype() != DType::Bool) {
    // Host tensors: a node of the lazy graph, run where the plan needs it (jit/collective.h).
    Tensor sum = prim::all_reduce(t, op == ReduceOp::Max ? 2 : 0, n, false, group.id());
    return op == ReduceOp::Mean ? sum / static_cast<double>(n) : sum;
  }
  if (group.is_world())
    if (Tensor on_gpu = nccl_all_reduce_on_device(t, op); on_gpu.defined()) return on_gpu;
  Tensor in = host_values(t);
  Tensor out = fresh_host(t.shape(), t.dtype());
  const size_t bytes = static_cast<size_t>(t.numel()) * dtype_size(t.dtype());
  if (bytes > 0) std::memcpy(writable(out), in.data(), bytes);
#if KILN_WITH_MPI
  if (world().mpi && t.numel() > 0)
    run_mpi(name, [&](MPI_Request* r) {
      return MPI_Iallreduce(MPI_IN_PLACE, writable(out), mpi_count(t.numel(), name), mpi_type(t.dtype(), name),
                            mpi_op(op, t.dtype()), communicator(group.id(), name), r);
    });
#endif
  if (op == ReduceOp::Mean) out = (out / static_cast<double>(n)).realize();
  return like_input(out, t);
}

Tensor broadcast(const Tensor& t, int root, const Group& group) {
  const char* name = "distributed::broadcast";
  require_init(name);
  group.require_me(name);
  KILN_CHECK(root >= 0 && root < group.size(), name, "root {} is not a rank of this group of {}", root, group.size());
  Tensor in = host_values(t);
  Tensor out = fresh_host(t.shape(), t.dtype());
  const size_t bytes = static_cast<size_t>(t.numel()) * dtype_size(t.dtype());
  if (bytes > 0) std::memcpy(writable(out), in.data(), bytes);
#if KILN_WITH_MPI
  if (world().mpi && bytes > 0 && group.size() > 1)
    run_mpi(name, [&](MPI_Request* r) {
      return MPI_Ibcast(writable(out), mpi_count(static_cast<int64_t>(bytes), name), MPI_BYTE, root,
                        communicator(group.id(), name), r);
    });
#endif
  return like_input(out, t);
}

Tensor all_gather(const Tensor& t, const Group& group) {
  const char* name = "distributed::all_gather";
  require_init(name);
  group.require_me(name);
  KILN_CHECK(t.dim() >= 1, name, "needs a tensor with an axis 0 to concatenate along, got {}", t.str());
  Shape shape = t.shape();
  shape[0] *= group.size();
  Tensor in = host_values(t);
  Tensor out = fresh_host(shape, t.dtype());
  const size_t bytes = static_cast<size_t>(t.numel()) * dtype_size(t.dtype());
#if KILN_WITH_MPI
  if (world().mpi && group.size() > 1) {
    const int count = mpi_count(static_cast<int64_t>(bytes), name);
    run_mpi(name, [&](MPI_Request* r) {
      return MPI_Iallgather(in.data(), count, MPI_BYTE, writable(out), count, MPI_BYTE, communicator(group.id(), name), r);
    });
    return like_input(out, t);
  }
#endif
  if (bytes > 0) std::memcpy(writable(out), in.data(), bytes);
  return like_input(out, t);
}

Tensor reduce_scatter(const Tensor& t, ReduceOp op) {
  const char* name = "distributed::reduce_scatter";
  require_init(name);
  check_reduce(t, op, name);
  const int n = world().size;
  KILN_CHECK(t.dim() >= 1 && t.size(0) % n == 0, name, "axis 0 of {} must divide into {} blocks, one per rank",
             t.str(), n);
  if (is_half(t.dtype())) return reduce_wide(t, op, reduce_scatter);
  Shape shape = t.shape();
  shape[0] /= n;
  Tensor in = host_values(t);
  Tensor out = fresh_host(shape, t.dtype());
  const int64_t block = numel(shape);
#if KILN_WITH_MPI
  if (world().mpi) {
    run_mpi(name, [&](MPI_Request* r) {
      return MPI_Ireduce_scatter_block(in.data(), writable(out), mpi_count(block, name), mpi_type(t.dtype(), name),
                                       mpi_op(op, t.dtype()), MPI_COMM_WORLD, r);
    });
    if (op == ReduceOp::Mean) out = (out / static_cast<double>(n)).realize();
    return like_input(out, t);
  }
#endif
  if (block > 0) std::memcpy(writable(out), in.data(), static_cast<size_t>(block) * dtype_size(t.dtype()));
  return like_input(out, t);
}

void send(const Tensor& t, int to, int tag) {
  const char* name = "distributed::send";
  require_init(name);
  KILN_CHECK(to >= 0 && to < world().size && to != world().rank, name,
             "rank {} cannot send to rank {} in a world of {}", world().rank, to, world().size);
#if KILN_WITH_MPI
  Tensor in = host_values(t);
  const int64_t bytes = t.numel() * static_cast<int64_t>(dtype_size(t.dtype()));
  run_mpi(name, [&](MPI_Request* r) {
    return MPI_Isend(in.data(), mpi_count(bytes, name), MPI_BYTE, to, tag, MPI_COMM_WORLD, r);
  });
#else
  (void)t, (void)tag;
#endif
}

Tensor recv(const Shape& shape, DType dtype, int from, int tag) {
  const char* name = "distributed::recv";
  require_init(name);
  KILN_CHECK(from >= 0 && from < world().size && from != world().rank, name,
             "rank {} cannot receive from rank {} in a world of {}", world().rank, from, world().size);
  Tensor out = fresh_host(shape, dtype);
#if KILN_WITH_MPI
  const int64_t bytes = numel(shape) * static_cast<int64_t>(dtype_size(dtype));
  run_mpi(name, [&](MPI_Request* r) {
    return MPI_Irecv(writable(out), mpi_count(bytes, name), MPI_BYTE, from, tag, MPI_COMM_WORLD, r);
  });
#else
  (void)tag;
#endif
  return out;
}

}  // namespace kiln::distributed
