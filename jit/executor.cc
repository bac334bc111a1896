#include "jit/executor.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "core/flags.h"
#include "core/tensor.h"
#include "backends/cpu/compiler.h"
#include "jit/disk_cache.h"
#include "jit/stats.h"
#include "backends/cuda/cuda_kernels.h"
#include "backends/cpu/render_cpp.h"
#include "jit/schedule.h"
#include "memory/allocator.h"
#include "backends/cuda/cuda_runtime.h"
#include "memory/planner.h"
#include "memory/pool.h"
#include "memory/recompute.h"
#include "backends/cpu/conv_onednn.h"
#include "backends/cuda/cuda_library.h"
#include "backends/cpu/matmul_onednn.h"

namespace kiln::jit {

namespace {

struct Plan {
  Device device;
  Schedule schedule;
  std::shared_ptr<CompiledModule> module;
  std::vector<KernelFn> fns;        // per kernel; null for library calls (CPU plans)
  std::unique_ptr<CudaKernels> cuda;  // the JIT kernels of a CUDA plan
  std::vector<int> fallible;        // kernels that may report an index out of range, in order
  std::vector<int> error_pair;      // per kernel: its index-error pair in a CUDA run (0 if it cannot fail)
  // CUDA plans: per kernel, the first kernel of its row group (backends/cuda/render_cuda.h), itself when
  // alone; empty for CPU plans. A group runs as one function, so memory is planned as if it were
  // one kernel.
  std::vector<int> group_start;
  std::vector<int> last_use;        // per slot: last kernel reading or writing it
  std::vector<int> producer;        // per slot: kernel writing it (-1 for externals)
  std::vector<int64_t> offset;      // per slot: arena offset of an intermediate, -1 otherwise
  memory::MemoryPlan memory;
  // Per kernel: arena ranges whose buffers die there (poisoned under KILN_DEBUG_MEMORY).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> dies_after;
  int64_t output_bytes = 0;
  // Parameter updates whose result may overwrite the old value's buffer: {output slot, external
  // slot}. Legal for the plan's structure; run_plan also checks nobody else can see the old value.
  std::vector<std::pair<int, int>> updates;
  std::shared_ptr<memory::PlanLayout> info = std::make_shared<memory::PlanLayout>();
};

// Whether kernel `k` may write its output over input buffer `b`: an elementwise kernel that
// reads that buffer only at the element it writes (so each element is read before it is written).
bool reads_only_in_place(const Kernel& k, int b) {
  if (k.kind != KernelKind::Elementwise) return false;
  std::string store = k.ctx.render(k.store_index);
  for (const Expr& e : k.exprs) {
    if (e.buffer != b) continue;
    if (e.kind != Expr::Kind::Load || k.ctx.render(e.index) != store) return false;
  }
  return true;
}

// Whether kernel k runs as a phase of a row group of two or more kernels.
bool in_row_group(const Plan& plan, size_t k) {
  if (plan.group_start.empty()) return false;
  return plan.group_start[k] != static_cast<int>(k) ||
         (k + 1 < plan.group_start.size() && plan.group_start[k + 1] == static_cast<int>(k));
}

// Every buffer a row group touches lives until the group's last kernel: its phases interleave
// row by row, so nothing read or written by one phase may be handed to another inside it.
void extend_lifetimes_over_groups(Plan& plan) {
  const Schedule& s = plan.schedule;
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    if (!in_row_group(plan, k)) continue;
    size_t end = k;
    while (end + 1 < s.kernels.size() && plan.group_start[end + 1] == plan.group_start[k]) ++end;
    for (const KernelBuffer& b : s.kernels[k].buffers)
      plan.last_use[b.slot] = std::max(plan.last_use[b.slot], static_cast<int>(end));
  }
}

// Intermediates get offsets in one arena; outputs and externals live in their own storage.
void plan_buffers(Plan& plan) {
  const Schedule& s = plan.schedule;
  auto bytes_of = [&](int slot) { return s.slots[slot].numel * static_cast<int64_t>(dtype_size(s.slots[slot].dtype)); };
  auto intermediate = [&](int slot) { return s.slots[slot].external < 0 && !s.slots[slot].keep; };
  std::vector<memory::BufferRequest> requests;
  std::vector<int> request_of(s.slots.size(), -1), slot_of_request;
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    const Kernel& kernel = s.kernels[k];
    int out = kernel.buffers[0].slot;
    if (!intermediate(out)) {
      plan.output_bytes += bytes_of(out);
      continue;
    }
    const bool grouped = in_row_group(plan, k);
    memory::BufferRequest r{bytes_of(out), grouped ? plan.group_start[k] : static_cast<int>(k), plan.last_use[out], -1};
    for (size_t b = 1; b < kernel.buffers.size() && !grouped; ++b) {
      int in = kernel.buffers[b].slot;
      if (intermediate(in) && plan.last_use[in] == static_cast<int>(k) && bytes_of(in) == bytes_of(out) &&
          request_of[in] >= 0 && reads_only_in_place(kernel, static_cast<int>(b))) {
        r.in_place_of = request_of[in];
        break;
      }
    }
    request_of[out] = static_cast<int>(requests.size());
    slot_of_request.push_back(out);
    requests.push_back(r);
  }
  plan.memory = memory::plan_memory(requests);
  for (const Kernel& k : s.kernels) plan.info->kernels.push_back(k.summary);
  for (size_t i = 0; i < requests.size(); ++i)
    plan.info->buffers.push_back({plan.memory.offsets[i], requests[i].bytes, requests[i].first, requests[i].last,
                                 requests[i].in_place_of, s.kernels[requests[i].first].summary});
  plan.info->arena_bytes = plan.memory.arena_bytes;
  plan.info->lower_bound = plan.memory.lower_bound;
  plan.offset.assign(s.slots.size(), -1);
  plan.dies_after.assign(s.kernels.size(), {});
  std::vector<bool> handed_on(requests.size(), false);
  for (const auto& r : requests)
    if (r.in_place_of >= 0 && plan.memory.offsets[&r - requests.data()] == plan.memory.offsets[r.in_place_of])
      handed_on[r.in_place_of] = true;
  for (size_t i = 0; i < requests.size(); ++i) {
    plan.offset[slot_of_request[i]] = plan.memory.offsets[i];
    if (!handed_on[i]) plan.dies_after[requests[i].last].push_back({plan.memory.offsets[i], requests[i].bytes});
  }
}

std::mutex g_mutex;
// Never destroyed: a CUDA plan's kernels must not be unloaded after the CUDA runtime shut down.
std::unordered_map<std::string, std::unique_ptr<Plan>>& g_plans = *new std::unordered_map<std::string, std::unique_ptr<Plan>>;

// Kernels that check their input (an index out of range) and may end a run with an error.
bool can_fail(const Kernel& k) {
  if (k.kind == KernelKind::Scatter) return true;
  for (const Expr& e : k.exprs)
    if (e.kind == Expr::Kind::GatherLoad) return true;
  return false;
}

// An update `p.assign(f(p, ...))` can write straight into p's buffer when its kernel reads p only
// at the element it writes, no later kernel reads p, and no later kernel can fail (a failed run
// must leave every tensor as it was).
void find_in_place_updates(Plan& plan, const PendingGraph& graph) {
  const Schedule& s = plan.schedule;
  std::vector<int> output_index(graph.nodes.size(), -1);
  for (size_t i = 0; i < graph.outputs.size(); ++i) output_index[graph.outputs[i]] = static_cast<int>(i);
  std::vector<int> external_slot(graph.externals.size(), -1);
  for (size_t i = 0; i < s.slots.size(); ++i)
    if (s.slots[i].external >= 0) external_slot[s.slots[i].external] = static_cast<int>(i);
  const int last_fallible = plan.fallible.empty() ? -1 : plan.fallible.back();
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    const Kernel& kernel = s.kernels[k];
    int out = kernel.buffers[0].slot;
    if (s.slots[out].node < 0 || !s.slots[out].output || kernel.kind != KernelKind::Elementwise) continue;
    if (in_row_group(plan, k)) continue;  // other rows' phases may still read the old value
    int oi = output_index[s.slots[out].node];
    if (oi < 0 || graph.replaced_external[oi] < 0) continue;
    int ext = external_slot[graph.replaced_external[oi]];
    if (ext < 0 || s.slots[ext].dtype != s.slots[out].dtype || s.slots[ext].numel != s.slots[out].numel) continue;
    if (plan.last_use[ext] > static_cast<int>(k) || last_fallible > static_cast<int>(k)) continue;
    bool reads_ok = true;
    for (size_t b = 1; b < kernel.buffers.size(); ++b)
      if (kernel.buffers[b].slot == ext) reads_ok = reads_only_in_place(kernel, static_cast<int>(b));
    if (reads_ok) plan.updates.push_back({out, ext});
  }
}

// Nodes of this graph that keep their inputs after the run: lazy views a user holds, and results
// autograd may still go through. Usually none; computed once per run.
std::vector<size_t> history_keepers(const PendingGraph& graph) {
  std::vector<bool> is_output(graph.nodes.size(), false);
  for (int o : graph.outputs) is_output[o] = true;
  std::vector<size_t> keepers;
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    const Node& n = *graph.nodes[i];
    if (n.inputs.empty()) continue;
    if (is_output[i] ? n.requires_grad && !n.grad_leaf && !n.backward_done : n.held > 0) keepers.push_back(i);
  }
  return keepers;
}

// Whether nothing outside this run can observe the old value of external `e`: no handle, no
// other node, and none of the graph's history keepers depends on it.
bool old_value_unobserved(const PendingGraph& graph, int e, const std::vector<size_t>& keepers) {
  const NodePtr& old = graph.externals[e];
  // Storage owners: the node and run_plan's binding table.
  if (old->held > 0 || old->storage.use_count() != 2) return false;
  if (old.use_count() != 1 + graph.external_edges[e]) return false;
  if (keepers.empty()) return true;
  std::vector<char> state(graph.nodes.size(), 0);  // 0 unknown, 1 reaches `old`, 2 does not
  auto reaches_old = [&](size_t start) {
    std::vector<std::pair<size_t, size_t>> stack{{start, 0}};
    while (!stack.empty()) {
      auto& [i, next] = stack.back();
      const Node& n = *graph.nodes[i];
      if (state[i] == 1) return true;
      if (next < n.inputs.size()) {
        const Node* in = n.inputs[next++].get();
        if (in == old.get()) state[i] = 1;
        else if (!in->realized() && state[in->visit_index] == 0) stack.push_back({static_cast<size_t>(in->visit_index), 0});
        else if (!in->realized() && state[in->visit_index] == 1) state[i] = 1;
        continue;
      }
      if (state[i] == 0) state[i] = 2;
      size_t done = i;
      stack.pop_back();
      if (!stack.empty() && state[done] == 1) state[stack.back().first] = 1;
    }
    return state[start] == 1;
  };
  for (size_t i : keepers)
    if (reaches_old(i)) return false;
  return true;
}

std::unique_ptr<Plan> build_plan(const PendingGraph& graph, Device device) {
  auto plan = std::make_unique<Plan>();
  plan->device = device;
  plan->schedule = schedule(graph);
  const Schedule& s = plan->schedule;
  plan->last_use.assign(s.slots.size(), -1);
  plan->producer.assign(s.slots.size(), -1);
  int jit_kernels = 0;
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    for (const KernelBuffer& b : s.kernels[k].buffers) plan->last_use[b.slot] = static_cast<int>(k);
    plan->producer[s.kernels[k].buffers[0].slot] = static_cast<int>(k);
    jit_kernels += !is_library(s.kernels[k].kind);
    plan->error_pair.push_back(can_fail(s.kernels[k]) ? static_cast<int>(plan->fallible.size()) : 0);
    if (can_fail(s.kernels[k])) plan->fallible.push_back(static_cast<int>(k));
  }
  if (device.is_cuda()) {
    plan->group_start = cuda_row_groups(s.kernels);
    extend_lifetimes_over_groups(*plan);
  }
  plan_buffers(*plan);
  find_in_place_updates(*plan, graph);
  plan->info->output_bytes = plan->output_bytes;
  memory::note_plan(plan->info);
  plan->fns.assign(s.kernels.size(), nullptr);
  if (jit_kernels > 0 && device.is_cuda()) {
    plan->cuda = std::make_unique<CudaKernels>(s.kernels, device.index, plan->group_start);
  } else if (jit_kernels > 0) {
    plan->module = compile_cached(render_cpp(s.kernels), jit_kernels);
    for (size_t k = 0; k < s.kernels.size(); ++k)
      if (!is_library(s.kernels[k].kind))
        plan->fns[k] = reinterpret_cast<KernelFn>(plan->module->symbol(s.kernels[k].name));
  }
  stats().plans_built++;
  return plan;
}

// The arena a graph's plan needs: scheduled and planned, not compiled (the budget pass weighs
// several rewrites of one graph).
int64_t planned_arena(const PendingGraph& graph) {
  Plan plan;
  plan.schedule = schedule(graph);
  plan.last_use.assign(plan.schedule.slots.size(), -1);
  for (size_t k = 0; k < plan.schedule.kernels.size(); ++k)
    for (const KernelBuffer& b : plan.schedule.kernels[k].buffers) plan.last_use[b.slot] = static_cast<int>(k);
  plan_buffers(plan);
  return plan.memory.arena_bytes;
}

// The budget pass's choices by graph key and budget: positions of the nodes to recompute.
std::unordered_map<std::string, std::vector<int>> g_recompute_choices;

// Under KILN_MEMORY_BUDGET: rewires `graph` so that its plan fits (memory/recompute.h) and
// collects it again. The rewritten graph has a key of its own, so its plan is cached apart.
void fit_memory_budget(const std::vector<NodePtr>& targets, PendingGraph& graph) {
  const std::string& budget_text = flags().memory_budget;
  std::string choice_key = graph.key + '\0' + budget_text;
  auto it = g_recompute_choices.find(choice_key);
  if (it == g_recompute_choices.end()) {
    auto cached = g_plans.find(graph.key);
    int64_t arena = cached != g_plans.end() ? cached->second->memory.arena_bytes : planned_arena(graph);
    int64_t budget = memory::budget_bytes(budget_text, arena);
    memory::RecomputeChoice choice{{}, arena};
    if (arena > budget)
      choice = memory::choose_recompute(graph.nodes, budget, arena, budget_text,
                                        [&] { return planned_arena(collect_pending(targets)); });
    if (flags().log >= 1 && !choice.dropped.empty())
      fmt::print(stderr, "[kiln] memory budget {}: arena {} -> {}, recomputing {} activations\n",
                 memory::format_bytes(budget), memory::format_bytes(arena), memory::format_bytes(choice.arena_bytes),
                 choice.dropped.size());
    it = g_recompute_choices.emplace(choice_key, std::move(choice.dropped)).first;
  }
  std::vector<int> dropped = it->second;
  if (!flags().plan_cache) g_recompute_choices.erase(it);  // decide again next time
  if (dropped.empty()) return;
  memory::apply_recompute(graph.nodes, dropped);
  graph = collect_pending(targets);
}

// Library kernels: oneDNN on the CPU (and for the CUDA emulator, whose memory is the host's),
// cuBLASLt and cuDNN on a GPU.
void run_matmul(const Kernel& k, void* const* ptrs, Device device) {
  const MatmulCall& mm = k.matmul;
  DType t = k.buffers[0].dtype;
  size_t es = dtype_size(t);
  const char* a = static_cast<const char*>(ptrs[k.buffers[mm.a_buffer].slot]) + mm.a_offset * es;
  const char* b = static_cast<const char*>(ptrs[k.buffers[mm.b_buffer].slot]) + mm.b_offset * es;
  if (cuda::is_gpu(device))
    cuda_library::matmul(device.index, t, a, mm.a_strides, b, mm.b_strides, ptrs[k.buffers[0].slot], mm.batch, mm.M,
                         mm.K, mm.N);
  else
    onednn::matmul(t, a, mm.a_strides, b, mm.b_strides, ptrs[k.buffers[0].slot], mm.batch, mm.M, mm.K, mm.N);
}

void run_conv(const Kernel& k, void* const* ptrs, Device device) {
  const ConvCall& c = k.conv;
  const void* a = ptrs[k.buffers[c.a_buffer].slot];
  const void* b = ptrs[k.buffers[c.b_buffer].slot];
  if (cuda::is_gpu(device))
    cuda_library::conv2d(device.index, c.pass, k.buffers[0].dtype, c.geometry, a, b, ptrs[k.buffers[0].slot]);
  else
    onednn::conv2d(c.pass, k.buffers[0].dtype, c.geometry, a, b, ptrs[k.buffers[0].slot]);
}

// A CUDA plan's bound values in device memory: scalars (sc), Rand seeds and offsets (isc), and an
// index-error pair (value, flag) per kernel that can fail, zeroed, copied in one transfer; after
// them the kernels' scratch buffer (not copied).
struct DeviceScalars {
  std::shared_ptr<Storage> storage;
  const double* sc = nullptr;
  const int64_t* isc = nullptr;
  int64_t* err = nullptr;  // pair i belongs to plan.fallible[i]
  void* scratch = nullptr;
};

DeviceScalars upload_scalars(const Plan& plan, const std::vector<double>& scalars, const std::vector<int64_t>& ints) {
  static_assert(sizeof(double) == sizeof(int64_t));
  std::vector<int64_t> host(scalars.size() + ints.size() + 2 * std::max<size_t>(plan.fallible.size(), 1), 0);
  std::memcpy(host.data(), scalars.data(), scalars.size() * sizeof(double));
  std::memcpy(host.data() + scalars.size(), ints.data(), ints.size() * sizeof(int64_t));
  DeviceScalars d;
  const size_t bytes = (host.size() * sizeof(int64_t) + 15) / 16 * 16;  // scratch holds 16-byte values at most
  const auto scratch = static_cast<size_t>(plan.cuda ? plan.cuda->scratch_bytes() : 0);
  d.storage = memory::allocate_storage(bytes + scratch, plan.device);
  cuda::copy_to_device(plan.device.index, d.storage->data, host.data(), host.size() * sizeof(int64_t));
  auto* base = static_cast<int64_t*>(d.storage->data);
  d.sc = reinterpret_cast<const double*>(base);
  d.isc = base + scalars.size();
  d.err = base + scalars.size() + ints.size();
  if (scratch > 0) d.scratch = static_cast<char*>(d.storage->data) + bytes;
  return d;
}

// After the last kernel that can fail: one wait for the device, then the first error reported.
void check_device_errors(const Plan& plan, const DeviceScalars& d) {
  std::vector<int64_t> err(2 * plan.fallible.size());
  cuda::copy_to_host(plan.device.index, err.data(), d.err, err.size() * sizeof(int64_t));
  for (size_t i = 0; i < plan.fallible.size(); ++i)
    KILN_CHECK(err[2 * i + 1] == 0, "gather/scatter_add",
               "index {} is out of range in kernel `{}`; indices must lie in [0, size) of the indexed dimension",
               err[2 * i], plan.schedule.kernels[static_cast<size_t>(plan.fallible[i])].summary);
}

void run_plan(const Plan& plan, const PendingGraph& graph) {
  const Schedule& s = plan.schedule;
  std::vector<std::shared_ptr<Storage>> storage(s.slots.size());
  std::vector<void*> ptrs(s.slots.size(), nullptr);
  for (size_t i = 0; i < s.slots.size(); ++i)
    if (s.slots[i].external >= 0) {
      storage[i] = graph.externals[s.slots[i].external]->storage;
      ptrs[i] = storage[i]->data;
    }
  std::vector<double> scalars;
  for (int n : s.scalar_nodes) scalars.push_back(graph.nodes[n]->scalar);
  std::vector<int64_t> int_scalars;
  for (int n : s.rand_nodes) {
    int_scalars.push_back(static_cast<int64_t>(graph.nodes[n]->seed));
    int_scalars.push_back(static_cast<int64_t>(graph.nodes[n]->offset));
  }
  scalars.push_back(0);
  int_scalars.push_back(0);
  if (flags().num_threads > 0) omp_set_num_threads(flags().num_threads);
  // One arena holds every intermediate; the pool hands the same memory back run after run.
  const Device device = plan.device;
  std::shared_ptr<Storage> arena;
  if (plan.memory.arena_bytes > 0) {
    arena = memory::allocate_storage(static_cast<size_t>(plan.memory.arena_bytes), device);
    for (size_t i = 0; i < s.slots.size(); ++i)
      if (plan.offset[i] >= 0) ptrs[i] = static_cast<char*>(arena->data) + plan.offset[i];
  }
  const bool poison = flags().debug_memory;
  // Parameter updates in place, where nobody else can see the old value.
  const std::vector<size_t> keepers = plan.updates.empty() ? std::vector<size_t>{} : history_keepers(graph);
  for (auto [out, ext] : plan.updates) {
    if (!old_value_unobserved(graph, s.slots[ext].external, keepers)) continue;
    storage[out] = storage[ext];
    ptrs[out] = ptrs[ext];
  }
  // Every output is allocated before the first kernel runs, so running out of memory never
  // leaves a half-updated state behind.
  for (size_t i = 0; i < s.slots.size(); ++i) {
    if (s.slots[i].external >= 0 || plan.offset[i] >= 0 || storage[i]) continue;
    storage[i] = memory::allocate_storage(static_cast<size_t>(s.slots[i].numel) * dtype_size(s.slots[i].dtype),
                                          device);
    ptrs[i] = storage[i]->data;
  }
  DeviceScalars on_device;
  std::vector<void*> values, args;
  if (device.is_cuda()) on_device = upload_scalars(plan, scalars, int_scalars);

  for (size_t k = 0; k < s.kernels.size(); ++k) {
    const Kernel& kernel = s.kernels[k];
    auto start = std::chrono::steady_clock::now();
    int64_t error[2] = {0, 0};
    if (kernel.kind == KernelKind::Matmul) {
      run_matmul(kernel, ptrs.data(), device);
    } else if (kernel.kind == KernelKind::Conv) {
      run_conv(kernel, ptrs.data(), device);
    } else if (device.is_cuda()) {
      // cudaLaunchKernel takes a pointer to each argument: the buffers, then sc, isc, err,
      // scratch. A later phase of a row group launches nothing: its group's function ran it.
      values.clear();
      for (int slot : plan.cuda->parameter_slots(k)) values.push_back(ptrs[slot]);
      int64_t* err = on_device.err + 2 * plan.error_pair[k];
      values.insert(values.end(),
                    {const_cast<double*>(on_device.sc), const_cast<int64_t*>(on_device.isc), err, on_device.scratch});
      args.clear();
      for (void*& v : values) args.push_back(&v);
      plan.cuda->launch(k, args.data());
    } else {
      plan.fns[k](ptrs.data(), scalars.data(), int_scalars.data(), error);
    }
    stats().kernels_run++;
    if (device.is_cuda() && !plan.fallible.empty() && static_cast<int>(k) == plan.fallible.back())
      check_device_errors(plan, on_device);
    if (flags().log >= 2 || memory::tracing()) {
      if (device.is_cuda()) cuda::synchronize(device.index);  // the kernel's time, not its launch's
      double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
      if (flags().log >= 2) fmt::print(stderr, "[kiln]   {:<10} {:>9.1f} us  {}\n", kernel.name, us, kernel.summary);
      if (memory::tracing())
        memory::record_kernel({kernel.summary, memory::trace_clock_us() - us, us, memory::allocated_bytes(),
                               memory::pool_stats().reserved.current});
    }
    KILN_CHECK(error[1] == 0, "gather/scatter_add",
               "index {} is out of range in kernel `{}`; indices must lie in [0, size) of the indexed dimension",
               error[0], kernel.summary);
    if (poison)  // dead buffers read as NaN: a use after free shows up in the results
      for (auto [offset, bytes] : plan.dies_after[k]) {
        char* p = static_cast<char*>(arena->data) + offset;
        if (device.is_cuda()) cuda::fill_bytes(device.index, p, 0xff, static_cast<size_t>(bytes));
        else std::memset(p, 0xff, static_cast<size_t>(bytes));
      }
  }
  // Commit only after every kernel succeeded: a failed run leaves all tensors as they were.
  for (size_t i = 0; i < s.slots.size(); ++i) {
    if (!s.slots[i].output) continue;
    Node* node = graph.nodes[s.slots[i].node].get();
    node->storage = storage[i];
    // Autograd stops at gradient leaves, so they never need their history (an assigned
    // parameter would otherwise hold every previous training step); nor do nodes a backward
    // pass has already gone through.
    if (!node->requires_grad || node->grad_leaf || node->backward_done) node->inputs.clear();
  }
  for (const PlanAlias& alias : s.aliases) {
    Node* node = graph.nodes[alias.node].get();
    node->storage = storage[alias.slot];
    if (!node->requires_grad || node->grad_leaf || node->backward_done) node->inputs.clear();
  }
}

}  // namespace

void realize(const std::vector<NodePtr>& targets) {
  // One plan per device: targets on several devices run as one graph each.
  for (const NodePtr& t : targets)
    if (t && t->device != targets.front()->device) {
      std::vector<NodePtr> here, elsewhere;
      for (const NodePtr& u : targets) (u->device == targets.front()->device ? here : elsewhere).push_back(u);
      realize(here);
      return realize(elsewhere);
    }
  std::lock_guard<std::mutex> lock(g_mutex);
  PendingGraph graph = collect_pending(targets);
  if (graph.nodes.empty()) return;
  const Device device = graph.nodes.front()->device;
  for (const NodePtr& n : graph.nodes)
    KILN_CHECK(n->device == device, op_name(n->op), "{} on {} depends on pending work on {}; move tensors with .to() "
               "before combining them", shape_str(n->shape), n->device.str(), device.str());
  if (!flags().memory_budget.empty()) fit_memory_budget(targets, graph);
  // The same graph on another device is another plan.
  const std::string key = device.is_cpu() ? graph.key : device.str() + '\n' + graph.key;
  Plan* plan = nullptr;
  std::unique_ptr<Plan> uncached;
  bool hit = false;
  if (flags().plan_cache) {
    auto it = g_plans.find(key);
    if (it != g_plans.end()) {
      plan = it->second.get();
      hit = true;
      stats().plan_cache_hits++;
    }
  }
  if (!plan) {
    uncached = build_plan(graph, device);
    plan = uncached.get();
  }
  if (flags().log >= 1)
    fmt::print(stderr, "[kiln] realize: {} nodes, {} inputs -> {} kernels (plan cache {})\n", graph.nodes.size(),
               graph.externals.size(), plan->schedule.kernels.size(), hit ? "hit" : "miss");
  if (flags().log >= 1 && !hit)
    for (const Kernel& k : plan->schedule.kernels) fmt::print(stderr, "[kiln]   {:<10} {}\n", k.name, k.summary);
  memory::note_plan_run(plan->info);
  run_plan(*plan, graph);
  if (uncached && flags().plan_cache) g_plans.emplace(key, std::move(uncached));
}

Schedule schedule_for(const std::vector<NodePtr>& targets) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return schedule(collect_pending(targets));
}

memory::PlanLayout last_plan_memory() {
  auto layout = memory::last_plan();
  return layout ? *layout : memory::PlanLayout{};
}

void clear_plan_cache() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_plans.clear();
  g_recompute_choices.clear();
}

size_t plan_cache_size() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_plans.size();
}

}  // namespace kiln::jit

namespace kiln {

void sync(const std::vector<Tensor>& tensors) {
  flags().check_built();  // a flag of a feature not built yet, set on the field, fails here
  std::vector<NodePtr> targets;
  for (const Tensor& t : tensors)
    if (t.defined()) targets.push_back(t.node());
  jit::realize(targets);
}

}  // namespace kiln
