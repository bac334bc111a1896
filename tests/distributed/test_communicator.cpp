// Collectives in any world: one process under plain ctest (every collective the identity), and 2
// and 3 ranks under `mpiexec` (ctest entries mpi.np2 / mpi.np3 run the [distributed] cases).
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <chrono>
#include <numeric>
#include <thread>

#include "backends/cuda/cuda_runtime.h"
#include "distributed/nccl.h"

using namespace kiln;
namespace dist = kiln::distributed;

namespace {

// Rank r's tensor: values r*10 + i.
Tensor rank_values(int r, int64_t n, DType t = DType::Float32) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = r * 10.0 + static_cast<double>(i);
  return cast(from_vector<double>(v, {n}), t);
}

}  // namespace

TEST_CASE("collectives reduce, gather, scatter and send across every rank", "[distributed]") {
  dist::init();
  const int n = dist::world_size(), me = dist::rank();
  REQUIRE(me >= 0);
  REQUIRE(me < n);
  for (DType t : {DType::Float32, DType::Float64, DType::Int64, DType::BFloat16}) {
    INFO(dtype_name(t));
    std::vector<double> sum = dist::all_reduce(rank_values(me, 4, t)).to_doubles();
    std::vector<double> max = dist::all_reduce(rank_values(me, 4, t), dist::ReduceOp::Max).to_doubles();
    for (int64_t i = 0; i < 4; ++i) {
      double want = 0;
      for (int r = 0; r < n; ++r) want += r * 10.0 + static_cast<double>(i);
      CHECK(sum[static_cast<size_t>(i)] == want);
      CHECK(max[static_cast<size_t>(i)] == (n - 1) * 10.0 + static_cast<double>(i));
    }
    CHECK(dist::all_reduce(rank_values(me, 4, t)).dtype() == t);
  }
  std::vector<double> mean = dist::all_reduce(rank_values(me, 3, DType::Float64), dist::ReduceOp::Mean).to_doubles();
  CHECK(mean[1] == Approx(10.0 * (n - 1) / 2.0 + 1.0));

  const int root = n - 1;  // not always 0
  std::vector<double> b = dist::broadcast(rank_values(me, 5), root).to_doubles();
  CHECK(b == rank_values(root, 5).to_doubles());

  Tensor gathered = dist::all_gather(rank_values(me, 2).reshape({1, 2}));
  CHECK(gathered.shape() == Shape{n, 2});
  std::vector<double> g = gathered.to_doubles();
  for (int r = 0; r < n; ++r) CHECK(g[static_cast<size_t>(2 * r + 1)] == r * 10.0 + 1.0);

  // Each rank contributes (n*2) values; rank r receives the sum of block r.
  Tensor scattered = dist::reduce_scatter(rank_values(me, 2 * n, DType::Float64));
  CHECK(scattered.shape() == Shape{2});
  std::vector<double> s = scattered.to_doubles();
  double want = 0;
  for (int r = 0; r < n; ++r) want += r * 10.0 + 2.0 * me;
  CHECK(s[0] == want);

  if (n > 1) {  // a ring: each rank sends to the next and receives from the previous
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    if (me % 2 == 0) {
      dist::send(rank_values(me, 3, DType::Int32), next, 7);
      CHECK(dist::recv({3}, DType::Int32, prev, 7).to_doubles() == rank_values(prev, 3, DType::Int32).to_doubles());
    } else {
      Tensor got = dist::recv({3}, DType::Int32, prev, 7);
      dist::send(rank_values(me, 3, DType::Int32), next, 7);
      CHECK(got.to_doubles() == rank_values(prev, 3, DType::Int32).to_doubles());
    }
  }
  dist::barrier();
}

TEST_CASE("groups run collectives among their members only", "[distributed]") {
  dist::init();
  const int me = dist::rank(), n = dist::world_size();
  // Every rank makes every group, members or not, in the same order.
  dist::Group all = dist::new_group([n] {
    std::vector<int> r(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) r[static_cast<size_t>(i)] = i;
    return r;
  }());
  dist::Group pair = dist::new_group(n == 1 ? std::vector<int>{0} : std::vector<int>{0, n - 1});
  CHECK(all.size() == n);
  CHECK(all.rank() == me);
  CHECK(all.id() > 0);
  CHECK(pair.id() == all.id() + 1);
  CHECK_THROWS_WITH(dist::new_group({0, n}), Catch::Contains("distinct ranks of this world of"));
  CHECK_THROWS_WITH(dist::new_group({}), Catch::Contains("at least one rank"));
  // The lazy all-reduce of a host tensor (a node of the plan) over a group.
  Tensor mine = from_vector<float>({static_cast<float>(me + 1)}, {1});
  CHECK(dist::all_reduce(mine * 2.0, dist::ReduceOp::Sum, all).item() == Approx(n * (n + 1)));
  if (!pair.contains_me()) {
    CHECK(pair.rank() == -1);
    CHECK_THROWS_WITH(dist::all_reduce(mine, dist::ReduceOp::Sum, pair), Catch::Contains("not a member"));
    CHECK_THROWS_WITH(dist::barrier(pair), Catch::Contains("not a member"));
    dist::barrier();
    return;
  }
  const int expected = n == 1 ? 1 : 1 + n;  // ranks 0 and n - 1, plus one each
  CHECK(dist::all_reduce(mine, dist::ReduceOp::Sum, pair).item() == Approx(expected));
  CHECK(dist::all_reduce(mine, dist::ReduceOp::Mean, pair).item() == Approx(expected / static_cast<double>(pair.size())));
  // Ranks are group ranks: root 1 of the pair is world rank n - 1.
  const int root = pair.size() - 1;
  CHECK(dist::broadcast(mine, root, pair).item() == Approx(pair.world_rank(root) + 1));
  CHECK(dist::all_gather(mine, pair).to_vector<float>() == (n == 1 ? std::vector<float>{1} : std::vector<float>{1, static_cast<float>(n)}));
  dist::barrier(pair);
  dist::barrier();
}

TEST_CASE("collectives take lazy and CUDA tensors and leave their input alone", "[distributed][device]") {
  dist::init();
  Tensor x = rank_values(dist::rank(), 6) * 2.0;  // pending until the collective realizes it
  Tensor y = dist::all_reduce(x);
  CHECK(x.to_doubles() == (rank_values(dist::rank(), 6) * 2.0).to_doubles());
  CHECK(y.shape() == x.shape());
  if (cuda::available()) {
    Tensor d = rank_values(dist::rank(), 6).to(Device::cuda(0));
    Tensor r = dist::all_reduce(d, dist::ReduceOp::Max);
    CHECK(r.device() == Device::cuda(0));
    CHECK(r.to_doubles() == rank_values(dist::world_size() - 1, 6).to_doubles());
  }
}

TEST_CASE("collectives reject what they cannot do with an Error", "[distributed]") {
  dist::init();
  CHECK_THROWS_WITH(dist::all_reduce(rank_values(0, 2, DType::Int64), dist::ReduceOp::Mean),
                    Catch::Contains("a mean of int64 values would truncate"));
  CHECK_THROWS_WITH(dist::broadcast(rank_values(0, 2), dist::world_size()), Catch::Contains("is not a rank"));
  if (dist::world_size() > 1)
    CHECK_THROWS_WITH(dist::reduce_scatter(rank_values(0, 2 * dist::world_size() + 1)),
                      Catch::Contains("must divide into"));
  CHECK_THROWS_WITH(dist::send(rank_values(0, 2), dist::rank()), Catch::Contains("cannot send to rank"));
}

TEST_CASE("a build without MPI started by an MPI launcher fails at init()", "[distributed]") {
  if (KILN_WITH_MPI || dist::initialized()) return;  // this process joined its world already
  setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  CHECK_THROWS_WITH(dist::init(), Catch::Contains("kiln was built without MPI") && Catch::Contains("libopenmpi-dev"));
  unsetenv("OMPI_COMM_WORLD_SIZE");
  CHECK_FALSE(dist::initialized());
}

TEST_CASE("KILN_BUCKET_MB and KILN_COLLECTIVE_TIMEOUT reject junk", "[distributed][flags]") {
  FlagsGuard guard;
  CHECK_THROWS_WITH(flags().set("bucket_mb", "0"), Catch::Contains("KILN_BUCKET_MB"));
  CHECK_THROWS_WITH(flags().set("bucket_mb", "lots"), Catch::Contains("a number"));
  CHECK_THROWS_WITH(flags().set("collective_timeout", "-1"), Catch::Contains("KILN_COLLECTIVE_TIMEOUT"));
  flags().set("bucket_mb", "0.5");
  CHECK(flags().bucket_mb == 0.5);
}

TEST_CASE("a rank that skips a collective makes the others throw within KILN_COLLECTIVE_TIMEOUT", "[distributed]") {
  dist::init();
  if (dist::world_size() == 1) return;
  Tensor x = rank_values(dist::rank(), 4);
  if (dist::rank() == 0) {
    FlagsGuard guard;
    flags().collective_timeout = 1.0;
    CHECK_THROWS_WITH(dist::all_reduce(x).realize(),
                      Catch::Contains("rank 0 of") && Catch::Contains("KILN_COLLECTIVE_TIMEOUT"));
  } else {
    // Late, not never: the abandoned all-reduce on rank 0 still completes, so MPI shuts down cleanly.
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    dist::all_reduce(x).realize();
  }
  dist::barrier();
}

TEST_CASE("NCCL all-reduces a GPU tensor in place on kiln's stream (a world of one)", "[distributed][cuda]") {
  if (!dist::nccl_built() || !cuda::available() || !cuda::is_gpu(Device::cuda(0))) {
    WARN("SKIPPED: no CUDA GPU with NCCL here (the emulator takes the host path)");
    return;
  }
  std::string why;
  void* comm = dist::nccl_comm(Device::cuda(0), 0, 1, [](void*, size_t) {}, why);
  REQUIRE(comm != nullptr);
  for (DType t : {DType::Float32, DType::BFloat16, DType::Int64}) {
    Tensor x = rank_values(3, 1000, t).to(Device::cuda(0)).realize();
    dist::nccl_all_reduce(comm, const_cast<void*>(x.data()), x.numel(), t, 0, Device::cuda(0));
    CHECK(x.to_doubles() == rank_values(3, 1000, t).to_doubles());  // the sum over one rank
  }
}
