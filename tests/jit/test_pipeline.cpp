// The realize pipeline's seams: lowering that amends the schedule, one structural key across
// devices, the backend chosen per device, and what the planner reports it handed on.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <algorithm>
#include <cstring>

#include "jit/backend.h"
#include "jit/collect.h"
#include "jit/executor.h"
#include "jit/lower.h"
#include "jit/plan.h"
#include "jit/schedule.h"
#include "memory/planner.h"
#include "ops/primitive.h"
#include "backends/cuda/cuda_runtime.h"

using namespace kiln;

TEST_CASE("a matmul operand that is no strided view gets a buffer of its own", "[jit][lower]") {
  // permute then reshape mixes dimensions: no strides describe it, so lowering materializes it.
  std::vector<float> xs(2 * 3 * 4), ws(3 * 5);
  for (size_t i = 0; i < xs.size(); ++i) xs[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
  for (size_t i = 0; i < ws.size(); ++i) ws[i] = 0.125f * static_cast<float>(i % 5) - 0.25f;
  Tensor x = from_vector<float>(xs, {2, 3, 4}), w = from_vector<float>(ws, {3, 5});
  Tensor a = reshape(permute(x, {0, 2, 1}), {8, 3});
  Tensor y = matmul(a, w);
  jit::Program program = jit::lower_for({y.node()});
  REQUIRE(program.kernels.size() == 2);
  CHECK(program.kernels[0].kind == jit::KernelKind::Elementwise);  // the copy of `a`
  CHECK(program.kernels[1].kind == jit::KernelKind::Matmul);
  std::vector<float> got = y.to_vector<float>();
  for (int64_t r = 0; r < 8; ++r)
    for (int64_t c = 0; c < 5; ++c) {
      const int64_t b = r / 4, i = r % 4;  // a[r, k] = x[b, k, i]
      float want = 0;
      for (int64_t k = 0; k < 3; ++k) want += xs[static_cast<size_t>(b * 12 + k * 4 + i)] * ws[static_cast<size_t>(k * 5 + c)];
      CHECK(got[static_cast<size_t>(r * 5 + c)] == Approx(want).margin(1e-6));
    }
}

TEST_CASE("an elementwise kernel loops innermost over every axis its addresses walk linearly", "[jit][lower]") {
  // A per-channel bias over (N, C, H, W): no flat loop (the channel is (i / HW) % C), but o over
  // (N, C) and i over H*W keep every address affine in i: a long inner loop, not one of W.
  Tensor x = rand({2, 3, 4, 5}), b = rand({3, 1, 1});
  Tensor y = relu(x + b);
  jit::Program program = jit::lower_for({y.node()});
  REQUIRE(program.kernels.size() == 1);
  const jit::Kernel& k = program.kernels[0];
  REQUIRE(k.loops.size() == 2);
  CHECK(k.loops[0].extent == 6);
  CHECK(k.loops[1].extent == 20);
  // A transposed operand walks H*W with a jump at each row of the permuted view: i over W only.
  Tensor z = x + permute(rand({2, 3, 5, 4}), {0, 1, 3, 2});
  jit::Program transposed = jit::lower_for({z.node()});
  REQUIRE(transposed.kernels.size() == 1);
  REQUIRE(transposed.kernels[0].loops.size() == 2);
  CHECK(transposed.kernels[0].loops[1].extent == 5);
  std::vector<float> xs = x.to_vector<float>(), bs = b.to_vector<float>(), ys = y.to_vector<float>();
  for (size_t e = 0; e < xs.size(); ++e) CHECK(ys[e] == std::max(0.0f, xs[e] + bs[(e / 20) % 3]));
}

TEST_CASE("the structural key tells devices apart by itself", "[jit][plan-cache][device]") {
  if (!cuda::available()) return;
  auto graph_on = [](Device d) {
    Tensor x = ones({4, 4}).to(d).realize();
    return exp(x) * 2.0;
  };
  Tensor on_cpu = graph_on(Device::cpu()), on_gpu = graph_on(Device::cuda(0));
  const std::string cpu_key = jit::collect_pending({on_cpu.node()}).key;
  const std::string gpu_key = jit::collect_pending({on_gpu.node()}).key;
  CHECK(cpu_key != gpu_key);
  jit::clear_plan_cache();
  on_cpu.realize();
  on_gpu.realize();
  CHECK(jit::plan_cache_size() == 2);
  CHECK(on_gpu.to(Device::cpu()).to_vector<float>() == on_cpu.to_vector<float>());
}

TEST_CASE("each device runs plans through its own backend", "[jit][backend][device]") {
  CHECK(std::strcmp(jit::backend_for(Device::cpu()).name(), "cpu") == 0);
  CHECK(jit::backend_for(Device::cpu()).row_groups({}).empty());
  if (!cuda::available()) {
    CHECK_THROWS_AS(jit::backend_for(Device::cuda(0)), Error);
    return;
  }
  CHECK(std::strcmp(jit::backend_for(Device::cuda(0)).name(), cuda::emulated() ? "cuda-emulator" : "cuda") == 0);
}

TEST_CASE("planner: an in-place pair reports the buffer it handed on", "[planner]") {
  // b takes a over where a dies; c lives beside b. Only a's memory is handed on.
  std::vector<memory::BufferRequest> r = {{4096, 0, 1, -1}, {4096, 1, 2, 0}, {4096, 1, 3, -1}};
  memory::MemoryPlan plan = memory::plan_memory(r);
  REQUIRE(plan.handed_on.size() == 3);
  CHECK(plan.handed_on == std::vector<bool>{true, false, false});
  CHECK(plan.offsets[0] == plan.offsets[1]);
  // Without the in-place permission nothing is handed on.
  r[1].in_place_of = -1;
  CHECK(memory::plan_memory(r).handed_on == std::vector<bool>{false, false, false});
}

TEST_CASE("an all-reduce starts as soon as its input is computed and its readers run last", "[jit][lower]") {
  Tensor a = rand({64}) * 2.0;
  Tensor reduced = prim::all_reduce(a, 0, 2);  // lowered only: no world is needed to plan it
  Tensor independent = exp(rand({1000})).sum();
  Tensor y = reduced + 1.0;
  jit::Program program = jit::lower_for({y.node(), independent.node()});
  int collective = -1, reader = -1, other = -1;
  for (size_t k = 0; k < program.kernels.size(); ++k) {
    const jit::Kernel& kernel = program.kernels[k];
    if (kernel.kind == jit::KernelKind::Collective) collective = static_cast<int>(k);
    else if (kernel.kind == jit::KernelKind::Reduce) other = static_cast<int>(k);
    else if (collective >= 0 && kernel.summary.find("Add") != std::string::npos) reader = static_cast<int>(k);
  }
  REQUIRE(collective >= 0);
  REQUIRE(reader >= 0);
  REQUIRE(other >= 0);
  CHECK(collective < other);  // y was asked for first, yet the independent sum runs in between
  CHECK(other < reader);
}

TEST_CASE("a bucket's gradients are written straight into the all-reduce's buffer", "[jit][planner]") {
  // Three parts computed in the plan, read by nothing but the all-reduce: the planner places each
  // inside the collective's output, end to end, so the executor copies nothing.
  // (Built in a lambda: a handle still held on a part would keep it as an output of its own.)
  Tensor y = [] {
    Tensor a = exp(rand({100})), b = rand({7, 9}) * 3.0, c = tanh(rand({50}));
    return prim::all_reduce({a, b, c}, 0, 2) * 2.0;
  }();
  jit::PendingGraph graph = jit::collect_pending({y.node()});
  auto plan = jit::make_plan(graph, jit::lower(graph, jit::schedule(graph)), Device::cpu());
  const auto& kernels = plan->program.kernels;
  auto collective = std::find_if(kernels.begin(), kernels.end(),
                                 [](const jit::Kernel& k) { return k.kind == jit::KernelKind::Collective; });
  REQUIRE(collective != kernels.end());
  const int out = collective->buffers[0].slot;
  REQUIRE(plan->offset[out] >= 0);
  int64_t at = 0;
  for (size_t i = 0; i < collective->collective.in_buffers.size(); ++i) {
    CHECK(plan->offset[collective->buffers[collective->collective.in_buffers[i]].slot] == plan->offset[out] + at);
    at += collective->collective.counts[i] * 4;
  }
  CHECK(at == 4 * (100 + 63 + 50));
}
