// The executor: realize(targets) = collect -> [memory budget] -> plan cache, else schedule ->
// lower -> plan -> compile (backend) -> run (backend). It binds a run's data to the plan and runs
// it through the plan's backend (jit/backend.h); everything device-specific is there.
#include "jit/executor.h"

#include <omp.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "core/flags.h"
#include "core/tensor.h"
#include "jit/backend.h"
#include "jit/collect.h"
#include "jit/collective.h"
#include "jit/lower.h"
#include "jit/plan.h"
#include "jit/schedule.h"
#include "jit/stats.h"
#include "memory/allocator.h"
#include "memory/pool.h"
#include "memory/compress.h"
#include "memory/recompute.h"

namespace kiln::jit {

namespace {

// A kernel's (or a wait's) event for memory::export_trace, `us` long, ending now.
memory::KernelEvent trace_event(const Kernel& kernel, std::string name, double us) {
  memory::KernelEvent e;
  e.name = std::move(name);
  e.label = trace_label_name(kernel.label);
  e.message = kernel.kind == KernelKind::Collective;
  e.start_us = memory::trace_clock_us() - us;
  e.duration_us = us;
  e.tensor_bytes = memory::allocated_bytes();
  e.reserved_bytes = memory::pool_stats().reserved.current;
  return e;
}

// The collectives a run has started and not yet waited for, by the plan slot they write.
class InFlight {
 public:
  bool empty() const { return pending_.empty(); }

  // All-reduce: packs the inputs into the output buffer and starts the all-reduce there, in place:
  // the inputs may die at once (the planner reuses their memory), the output lives until its
  // readers. Send: copies the input into memory the engine keeps until the message has gone.
  // Recv: starts receiving into the output buffer. On a device the bytes go through host memory
  // (the engine moves host memory): copied out when the collective starts (after the kernels
  // queued before it), and a result copied back, queued before the kernels that read it.
  void start(const Kernel& kernel, void* const* ptrs, Device device) {
    CollectiveEngine* engine = collective_engine();
    const CollectiveCall& c = kernel.collective;
    const char* what = c.kind == CollectiveKind::AllReduce ? "all_reduce" : c.kind == CollectiveKind::Send ? "send" : "recv";
    KILN_CHECK(engine != nullptr, what,
               "a plan holds a collective ({}) but no world of several processes is joined; call "
               "kiln::distributed::init() under mpirun",
               kernel.summary);
    memory::Allocator& mem = memory::device_allocator(device);  // host: memcpy
    const int out = kernel.buffers[0].slot;
    const size_t element = dtype_size(kernel.buffers[0].dtype);
    if (c.kind == CollectiveKind::Send) {
      const size_t bytes = static_cast<size_t>(c.counts[0]) * element;
      std::shared_ptr<Storage> copy = memory::allocate_storage(std::max<size_t>(bytes, 1), Device::cpu());
      if (bytes > 0) mem.copy_to_host(copy->data, ptrs[kernel.buffers[c.in_buffers[0]].slot], bytes);
      mem.fill(ptrs[out], 0, element);
      engine->start_send(copy->data, c.counts[0], kernel.buffers[0].dtype, c.peer, c.tag, copy);
      stats().messages_sent++;
      return;
    }
    const size_t out_bytes = static_cast<size_t>(kernel.out_numel) * element;
    Pending p{out, -1, &kernel, nullptr, nullptr, &mem};
    if (!device.is_cpu()) {
      p.staged = memory::allocate_storage(std::max<size_t>(out_bytes, 1), Device::cpu());
      p.device_out = ptrs[out];
    }
    void* host_out = p.staged ? p.staged->data : ptrs[out];
    if (c.kind == CollectiveKind::Recv) {
      p.handle = engine->start_recv(host_out, kernel.out_numel, kernel.buffers[0].dtype, c.peer, c.tag);
      pending_.push_back(std::move(p));
      stats().messages_received++;
      return;
    }
    char* to = static_cast<char*>(host_out);
    for (size_t i = 0; i < c.in_buffers.size(); ++i) {
      const void* from = ptrs[kernel.buffers[c.in_buffers[i]].slot];
      const size_t bytes = static_cast<size_t>(c.counts[i]) * element;
      if (from != to && bytes > 0) mem.copy_to_host(to, from, bytes);
      to += bytes;
    }
    p.handle = engine->start_all_reduce(host_out, kernel.out_numel, kernel.buffers[0].dtype, c.op, c.group);
    pending_.push_back(std::move(p));
  }

  // Waits for the collectives whose buffer `kernel` touches; lets the others advance.
  void wait_for(const Kernel& kernel) {
    for (size_t i = 0; i < pending_.size();) {
      bool touched = false;
      for (const KernelBuffer& b : kernel.buffers) touched |= b.slot == pending_[i].slot;
      if (touched) {
        finish(pending_[i]);
        pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
    if (!pending_.empty()) collective_engine()->progress();
  }

  void wait_all() {
    for (const Pending& p : pending_) finish(p);
    pending_.clear();
  }

  // After a failed kernel: the other ranks still take part in every started collective, so each
  // is waited for (bounded by the collective timeout); their errors give way to the first one.
  void abandon() noexcept {
    for (const Pending& p : pending_) {
      if (p.kernel->collective.kind == CollectiveKind::Recv) {
        collective_engine()->cancel(p.handle);  // its sender may be the rank that failed
        continue;
      }
      try {
        collective_engine()->wait(p.handle);
      } catch (...) {
      }
    }
    pending_.clear();
  }

 private:
  struct Pending {
    int slot;
    int64_t handle;
    const Kernel* kernel;
    std::shared_ptr<Storage> staged;  // on a device: the host memory the collective runs in
    void* device_out;                 // and the device buffer its result goes to
    memory::Allocator* mem;
  };
  static void finish(const Pending& p) {
    auto start = std::chrono::steady_clock::now();
    collective_engine()->wait(p.handle);
    if (p.staged)
      p.mem->copy_from_host(p.device_out, p.staged->data,
                            static_cast<size_t>(p.kernel->out_numel) * dtype_size(p.kernel->buffers[0].dtype));
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    stats().collective_wait_seconds += waited;
    if (p.kernel->collective.kind == CollectiveKind::Recv) stats().recv_wait_seconds += waited;
    const double us = waited * 1e6;
    if (flags().log >= 2) fmt::print(stderr, "[kiln]   {:<10} {:>9.1f} us  wait {}\n", p.kernel->name, us, p.kernel->summary);
    if (memory::tracing()) memory::record_kernel(trace_event(*p.kernel, "wait " + p.kernel->summary, us));
  }
  std::vector<Pending> pending_;
};

// An offloading plan found no host memory for its copies: the executor plans the graph again
// without offload (recomputing what the budget needs instead).
struct HostMemoryShort {
  int64_t bytes;
};

std::mutex g_mutex;
uint64_t g_plan_generation = 0;  // counts clear_plan_cache calls
// Never destroyed: a CUDA plan's kernels must not be unloaded after the CUDA runtime shut down.
std::unordered_map<std::string, std::unique_ptr<Plan>>& g_plans = *new std::unordered_map<std::string, std::unique_ptr<Plan>>;

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

// The pending graph behind `targets`, with saved activations recorded under compression kept
// compressed (memory/compress.h). The rewiring stays, so a graph is compressed once.
PendingGraph collect_compressed(const std::vector<NodePtr>& targets, memory::Compression* compression = nullptr) {
  PendingGraph graph = collect_pending(targets);
  if (std::none_of(graph.nodes.begin(), graph.nodes.end(), [](const NodePtr& n) { return n->compress; })) return graph;
  memory::Compression done = memory::compress_saved_activations(graph.nodes);
  if (compression) *compression = done;
  if (done.values > 0) graph = collect_pending(targets);
  return graph;
}

// What the recomputation passes of one realize chose, for the plan's figures (memory::report).
struct Recomputed {
  int values = 0;
  int64_t bytes = 0, elements = 0, flops = 0;
  std::unordered_map<const Node*, const Node*> copied_from;  // each copy made and the node it copies
};
void note_recomputed(const memory::RecomputeRewrite& rewrite, size_t values, Recomputed& sum) {
  sum.values += static_cast<int>(values);
  sum.bytes += rewrite.dropped_bytes;
  sum.elements += rewrite.copied_elements;
  sum.flops += rewrite.copied_flops;
  sum.copied_from.insert(rewrite.copied_from.begin(), rewrite.copied_from.end());
}

// KILN_RECOMPUTE's choices by graph key (made for the mode that is named).
struct CheapChoice {
  std::string mode;
  std::vector<int> dropped;
};
std::unordered_map<std::string, CheapChoice> g_cheap_choices;

// KILN_RECOMPUTE's choice for `graph` (flags().recompute not "off"), made once per graph key.
const std::vector<int>& cheap_choice(const PendingGraph& graph) {
  const std::string& mode = flags().recompute;
  auto it = g_cheap_choices.find(graph.key);
  if (it == g_cheap_choices.end() || it->second.mode != mode) {
    CheapChoice choice{mode, memory::choose_cheap_recompute(graph.nodes, mode == "elementwise")};
    if (flags().log >= 1 && !choice.dropped.empty())
      fmt::print(stderr, "[kiln] recomputing {} activations for the backward (KILN_RECOMPUTE={})\n",
                 choice.dropped.size(), mode);
    it = g_cheap_choices.insert_or_assign(graph.key, std::move(choice)).first;
  }
  return it->second.dropped;
}

// Positions as collect_pending numbered them: planning a rewired copy of the graph renumbers
// its nodes, and run_plan indexes by position (old_value_unobserved).
void renumber(const PendingGraph& graph) {
  for (size_t i = 0; i < graph.nodes.size(); ++i) graph.nodes[i]->visit_index = static_cast<int64_t>(i);
  for (size_t e = 0; e < graph.externals.size(); ++e) graph.externals[e]->visit_index = static_cast<int64_t>(e);
}

// The arena of `graph`'s plan with what KILN_RECOMPUTE recomputes, which a fraction budget is of
// (what memory::report() shows before a budget is set); with `budget`, as offload (jit/offload.h)
// plans it under that budget. A cached plan's when it recomputes nothing and offloads nothing.
int64_t arena_without_budget(const std::vector<NodePtr>& targets, const PendingGraph& graph, int64_t budget = -1) {
  static const std::vector<int> none;
  const std::vector<int>& cheap = flags().recompute == "off" ? none : cheap_choice(graph);
  if (cheap.empty()) {
    auto cached = g_plans.find(graph.key);
    return budget < 0 && cached != g_plans.end() && cached->second->info->offloaded_values == 0
               ? cached->second->memory.arena_bytes
               : planned_arena(graph, budget);
  }
  // The graph goes back as it was, also when planning throws.
  struct Restore {
    memory::RecomputeRewrite rewrite;
    const PendingGraph& graph;
    ~Restore() {
      rewrite.undo();
      renumber(graph);
    }
  } restore{memory::apply_recompute(graph.nodes, cheap), graph};
  return planned_arena(collect_pending(targets), budget);
}

// The budget pass's choices by graph key and budget: positions of the nodes to recompute, and
// why the budget is not met when it is not (the choice is then the smallest arena found).
struct BudgetChoice {
  std::vector<int> dropped, checkpoints;
  bool chain_per_value = false;
  std::string missed;
  int64_t budget = -1;  // in bytes, for the offload choice of the plan (jit/offload.h)
  bool as_without = false;  // the graph is left to KILN_RECOMPUTE, as without a budget
};
std::unordered_map<std::string, BudgetChoice> g_recompute_choices;

// Under KILN_MEMORY_BUDGET: rewires `graph` so that its plan fits (memory/recompute.h) and
// collects it again. The rewritten graph has a key of its own, so its plan is cached apart. On a
// GPU, offloading saved activations (jit/offload.h) comes first: exact and without extra work;
// recomputation does what it leaves. Returns the budget in bytes; `as_without` says whether the
// graph is left to KILN_RECOMPUTE as without a budget (its plan meets the budget, or no choice
// does better).
int64_t fit_memory_budget(const std::vector<NodePtr>& targets, PendingGraph& graph, Recomputed& recomputed,
                          bool& as_without) {
  const std::string& budget_text = flags().memory_budget;
  std::string choice_key = graph.key + '\0' + budget_text;
  auto it = g_recompute_choices.find(choice_key);
  if (it == g_recompute_choices.end()) {
    const int64_t arena = arena_without_budget(targets, graph);
    int64_t budget = memory::budget_bytes(budget_text, arena);
    memory::RecomputeChoice choice{{}, {}, arena, {}, {}};
    const auto search_start = std::chrono::steady_clock::now();
    const bool offloads = flags().offload != "off" && backend_for(graph.nodes.front()->device).offloads();
    if (arena > budget && offloads) choice.arena_bytes = arena_without_budget(targets, graph, budget);  // offloading
    if (choice.arena_bytes > budget) {
      choice = memory::choose_recompute(graph.nodes, budget, arena, budget_text,
                                        [&] { return planned_arena(collect_pending(targets), budget); });
      renumber(graph);  // (the search planned rewired copies of it)
    }
    // A budget nothing meets: run at the smallest arena found, saying so once per graph (the
    // choice is cached), or stop there under KILN_MEMORY_BUDGET_STRICT=1 (checked on every use).
    // Below what one kernel reads and writes at once, no plan could meet it: say so.
    if (!choice.missed.empty())
      if (auto layout = planned_memory(graph, budget); budget < layout->working_set && layout->working_set_kernel >= 0)
        choice.missed += fmt::format(
            ". No plan fits {}: one kernel ({}) alone reads and writes {} of intermediates at once",
            memory::format_bytes(budget), layout->kernels[layout->working_set_kernel],
            memory::format_bytes(layout->working_set));
    if (!choice.missed.empty() && !flags().memory_budget_strict)
      fmt::print(stderr, "kiln: warning: {}; running at {} (KILN_MEMORY_BUDGET_STRICT=1 makes this an error)\n",
                 choice.missed, memory::format_bytes(choice.arena_bytes));
    if (flags().log >= 1 && !choice.dropped.empty())
      fmt::print(stderr, "[kiln] memory budget {}: arena {} -> {}, recomputing {} activations ({}; chosen in {:.0f} ms)\n",
                 memory::format_bytes(budget), memory::format_bytes(arena), memory::format_bytes(choice.arena_bytes),
                 choice.dropped.size(), choice.policy,
                 std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - search_start).count());
    const bool leaves_graph = choice.dropped.empty();
    it = g_recompute_choices
             .emplace(choice_key, BudgetChoice{std::move(choice.dropped), std::move(choice.checkpoints),
                                               choice.chain_per_value, std::move(choice.missed), budget,
                                               leaves_graph})
             .first;
  }
  if (!it->second.missed.empty() && flags().memory_budget_strict) {
    const std::string missed = it->second.missed;
    if (!flags().plan_cache) g_recompute_choices.erase(it);
    KILN_FAIL("memory_budget", "{}", missed);
  }
  std::vector<int> dropped = it->second.dropped, checkpoints = it->second.checkpoints;
  const bool chain_per_value = it->second.chain_per_value;
  const int64_t budget = it->second.budget;
  as_without = it->second.as_without;
  if (!flags().plan_cache) g_recompute_choices.erase(it);  // decide again next time
  if (dropped.empty()) return budget;
  note_recomputed(memory::apply_recompute(graph.nodes, dropped, checkpoints, chain_per_value), dropped.size(),
                   recomputed);
  stats().graphs_rewired++;
  graph = collect_pending(targets);
  return budget;
}


// KILN_RECOMPUTE (cheap, elementwise): rewires `graph` so that the backward recomputes the saved
// activations elementwise work gives back from what it keeps anyway (memory/recompute.h), and
// collects it again. The choice is made once per graph key.
void recompute_cheap_activations(const std::vector<NodePtr>& targets, PendingGraph& graph,
                                 Recomputed* recomputed = nullptr, bool within_budget = false) {
  const std::string& mode = flags().recompute;
  // Under KILN_MEMORY_BUDGET its pass chooses every recomputed value, except where it leaves the
  // graph as it is (`within_budget`: the plan meets the budget, or nothing does better).
  if (mode == "off" || (!flags().memory_budget.empty() && !within_budget)) return;
  // (Read in place: this runs on every replay.)
  const std::vector<int>& dropped = cheap_choice(graph);
  if (!dropped.empty()) {
    const memory::RecomputeRewrite rewrite = memory::apply_recompute(graph.nodes, dropped);
    if (recomputed) note_recomputed(rewrite, dropped.size(), *recomputed);
  }
  const bool rewired = !dropped.empty();
  if (!flags().plan_cache) g_cheap_choices.erase(graph.key);  // decide again next time
  if (!rewired) return;
  stats().graphs_rewired++;
  graph = collect_pending(targets);
}

// Replays of graphs that the recomputation passes rewire (KILN_MEMORY_BUDGET, KILN_RECOMPUTE),
// by rewire_key of the graph as collected: the rewired graph's plan, its positions mapped back
// onto the graph as collected (plan_for_collected), so a replay runs it without rewiring the
// graph again (the passes' analysis and a second collect cost ~6% of the MLP's step). Null for
// a graph the passes leave as it is: its replays go straight to g_plans. A copy shares its base
// plan's compiled kernels, which refer to the base's kernel list: the base stays in g_plans while
// the copy lives (cleared together, copies first; never destroyed, like g_plans).
std::unordered_map<std::string, std::unique_ptr<Plan>>& g_rewired_plans =
    *new std::unordered_map<std::string, std::unique_ptr<Plan>>;

// Whether the recomputation passes may rewire a graph under the current flags.
bool passes_may_rewire() { return flags().recompute != "off" || !flags().memory_budget.empty(); }

// What decides the passes' result for `graph`: its key (structure only), the flags they read, and
// the marks of each node they read (gradient tracking, leaves, recorded by a gradient rule,
// copies, held by a user, checkpoint segments, an assign's old value still alive).
std::string rewire_key(const PendingGraph& graph) {
  std::string key = std::to_string(graph.key.size()) + ':' + graph.key;
  for (const std::string* text : {&flags().recompute, &flags().memory_budget, &flags().offload}) {
    key += *text;
    key += '\0';
  }
  key += flags().memory_budget_strict ? '1' : '0';
  const size_t at = key.size();
  key.resize(at + graph.nodes.size());
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    const Node& n = *graph.nodes[i];
    key[at + i] = static_cast<char>(n.requires_grad | n.grad_leaf << 1 | n.backward << 2 | n.recompute << 3 |
                                    n.saved_copy << 4 | (n.held > 0) << 5 | (n.segment != nullptr) << 6 |
                                    !n.replaces.expired() << 7);
  }
  return key;
}

// A graph as collect_pending numbered it, before the passes rewired it. Addresses only: owning
// references would count as readers of a parameter and keep its update from running in place.
struct Collected {
  std::string key;
  std::vector<const Node*> nodes, externals;
  explicit Collected(const PendingGraph& graph) : key(graph.key) {
    for (const NodePtr& n : graph.nodes) nodes.push_back(n.get());
    for (const NodePtr& e : graph.externals) externals.push_back(e.get());
  }
};

// `plan` of `rewired` (what the passes made of `collected`) with its node and external positions
// mapped onto `collected`: a recomputed copy to the node it copies (same scalar, same random seed
// and offset), which its kernels compute again from what they read. Externals are the same
// values in another order. Null when a position has no counterpart (not expected).
std::unique_ptr<Plan> plan_for_collected(const Plan& plan, const Collected& collected, const PendingGraph& rewired,
                                         const Recomputed& recomputed) {
  std::unordered_map<const Node*, int> node_at, external_at;
  for (size_t i = 0; i < collected.nodes.size(); ++i) node_at.emplace(collected.nodes[i], static_cast<int>(i));
  for (size_t e = 0; e < collected.externals.size(); ++e) external_at.emplace(collected.externals[e], static_cast<int>(e));
  std::vector<int> node_map(rewired.nodes.size(), -1), external_map(rewired.externals.size(), -1);
  for (size_t i = 0; i < rewired.nodes.size(); ++i) {
    const Node* n = rewired.nodes[i].get();
    if (auto copied = recomputed.copied_from.find(n); copied != recomputed.copied_from.end()) n = copied->second;
    auto at = node_at.find(n);
    if (at == node_at.end()) return nullptr;
    node_map[i] = at->second;
  }
  for (size_t e = 0; e < rewired.externals.size(); ++e) {
    auto at = external_at.find(rewired.externals[e].get());
    if (at == external_at.end()) return nullptr;
    external_map[e] = at->second;
  }
  auto replay = std::make_unique<Plan>(plan);
  Program& s = replay->program;
  for (PlanSlot& slot : s.slots) {
    if (slot.node >= 0) slot.node = node_map[slot.node];
    if (slot.external >= 0) slot.external = external_map[slot.external];
  }
  for (int& n : s.scalar_nodes) n = node_map[n];
  for (int& n : s.rand_nodes) n = node_map[n];
  for (PlanAlias& alias : s.aliases) alias.node = node_map[alias.node];
  return replay;
}

// One run's data: per slot the storage of each external (filled in before the run) and of each
// output (filled in by it), the run-time scalars, and per plan update whether its output may take
// the old value's buffer.
struct Bound {
  std::vector<std::shared_ptr<Storage>> storage;
  std::vector<double> scalars;
  std::vector<int64_t> int_scalars;
  std::vector<char> overwrite;  // per Plan::updates entry
};

// Runs `plan` on `bound`. Every output is allocated before the first kernel, and nothing is
// attached to a node here: a run that fails leaves every tensor as it was.
void run_bound(const Plan& plan, Bound& bound) {
  const Program& s = plan.program;
  const Backend& backend = *plan.backend;
  const Device device = plan.device;
  std::vector<std::shared_ptr<Storage>>& storage = bound.storage;
  std::vector<void*> ptrs(s.slots.size(), nullptr);
  for (size_t i = 0; i < s.slots.size(); ++i)
    if (s.slots[i].external >= 0) ptrs[i] = storage[i]->data;
  bound.scalars.push_back(0);
  bound.int_scalars.push_back(0);
  // Set on every run: num_threads = 0 after a count must give every core back. OpenMP's default
  // (OMP_NUM_THREADS or the cores) is read once, before kiln first changes it.
  static const int all_cores = omp_get_max_threads();
  omp_set_num_threads(flags().num_threads > 0 ? flags().num_threads : all_cores);
  // One arena holds every intermediate; the pool hands the same memory back run after run.
  std::shared_ptr<Storage> arena;
  if (plan.memory.arena_bytes > 0) {
    arena = memory::allocate_storage(static_cast<size_t>(plan.memory.arena_bytes), device);
    for (size_t i = 0; i < s.slots.size(); ++i)
      if (plan.offset[i] >= 0) ptrs[i] = static_cast<char*>(arena->data) + plan.offset[i];
  }
  // Offloaded activations' host copies (jit/offload.h), in memory the plan keeps across runs.
  if (plan.host_memory.arena_bytes > 0) {
    if (!plan.host_arena) plan.host_arena = backend.allocate_host(static_cast<size_t>(plan.host_memory.arena_bytes));
    if (!plan.host_arena) throw HostMemoryShort{plan.host_memory.arena_bytes};
    for (size_t i = 0; i < s.slots.size(); ++i)
      if (plan.host_offset[i] >= 0) ptrs[i] = static_cast<char*>(plan.host_arena.get()) + plan.host_offset[i];
  }
  std::unique_ptr<TransferQueue> transfers = plan.host_memory.arena_bytes > 0 ? backend.transfers(device) : nullptr;
  const bool poison = flags().debug_memory;
  for (size_t u = 0; u < plan.updates.size(); ++u) {
    if (!bound.overwrite[u]) continue;
    auto [out, ext] = plan.updates[u];
    storage[out] = storage[ext];
    ptrs[out] = ptrs[ext];
  }
  // Every output is allocated before the first kernel runs, so running out of memory never
  // leaves a half-updated state behind.
  for (size_t i = 0; i < s.slots.size(); ++i) {
    if (s.slots[i].external >= 0 || plan.offset[i] >= 0 || s.slots[i].host || storage[i]) continue;
    storage[i] = memory::allocate_storage(static_cast<size_t>(s.slots[i].numel) * dtype_size(s.slots[i].dtype),
                                          device);
    ptrs[i] = storage[i]->data;
  }
  std::unique_ptr<KernelRun> run = plan.kernels ? plan.kernels->start(bound.scalars, bound.int_scalars) : nullptr;

  // Collectives in flight: started where the schedule put them, waited for before the first
  // kernel that reads (or overwrites) their buffer, and all of them before the run ends.
  InFlight in_flight;
  const bool timed = flags().log >= 2 || memory::tracing();
  double kernel_us = 0, recompute_us = 0, offload_wait_us = 0;
  try {
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    const Kernel& kernel = s.kernels[k];
    if (!in_flight.empty()) in_flight.wait_for(kernel);
    auto start = std::chrono::steady_clock::now();
    if (!in_flight.empty()) stats().kernels_during_collectives++;
    if (kernel.kind == KernelKind::Collective) in_flight.start(kernel, ptrs.data(), device), stats().collectives_started++;
    else if (kernel.kind == KernelKind::Transfer) writes_output(kernel) ? transfers->start(kernel, ptrs.data()) : transfers->join(kernel);
    else if (is_library(kernel.kind)) backend.run_library(kernel, ptrs.data(), device);
    else run->launch(k, ptrs.data());
    stats().kernels_run++;
    if (static_cast<int>(k) == plan.last_fallible) run->check_errors();
    if (timed) {
      backend.synchronize(device);  // the kernel's time, not its launch's
      double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
      kernel_us += us;
      if (kernel.recompute) recompute_us += us;
      if (kernel.kind == KernelKind::Transfer && !writes_output(kernel)) offload_wait_us += us;
      if (flags().log >= 2) fmt::print(stderr, "[kiln]   {:<10} {:>9.1f} us  {}\n", kernel.name, us, kernel.summary);
      if (memory::tracing())
        memory::record_kernel(trace_event(kernel, kernel.summary, us));
    }
    if (poison)  // dead buffers read as NaN: a use after free shows up in the results
      for (auto [offset, bytes] : plan.dies_after[k])
        memory::device_allocator(device).fill(static_cast<char*>(arena->data) + offset, 0xff,
                                              static_cast<size_t>(bytes));
  }
  in_flight.wait_all();
  if (timed) {
    plan.info->kernel_us = kernel_us;
    plan.info->recompute_us = recompute_us;
    plan.info->offload_wait_us = offload_wait_us;
  }
  } catch (...) {
    in_flight.abandon();  // the other ranks finish their part; nothing here reads the results
    throw;
  }
}

// Autograd stops at gradient leaves, so they never need their history (an assigned parameter
// would otherwise hold every previous training step); nor do nodes a backward pass has already
// gone through.
void drop_history(Node& node) {
  if (!node.requires_grad || node.grad_leaf || node.backward_done) node.inputs.clear();
}

void run_plan(const Plan& plan, const PendingGraph& graph) {
  const Program& s = plan.program;
  Bound bound;
  bound.storage.resize(s.slots.size());
  for (size_t i = 0; i < s.slots.size(); ++i)
    if (s.slots[i].external >= 0) bound.storage[i] = graph.externals[s.slots[i].external]->storage;
  for (int n : s.scalar_nodes) bound.scalars.push_back(graph.nodes[n]->scalar);
  for (int n : s.rand_nodes) {
    bound.int_scalars.push_back(static_cast<int64_t>(graph.nodes[n]->seed));
    bound.int_scalars.push_back(static_cast<int64_t>(graph.nodes[n]->offset));
  }
  // Parameter updates in place, where nobody else can see the old value.
  const std::vector<size_t> keepers = plan.updates.empty() ? std::vector<size_t>{} : history_keepers(graph);
  for (auto [out, ext] : plan.updates)
    bound.overwrite.push_back(old_value_unobserved(graph, s.slots[ext].external, keepers));
  run_bound(plan, bound);
  // Commit only after every kernel succeeded: a failed run leaves all tensors as they were.
  for (size_t i = 0; i < s.slots.size(); ++i) {
    if (!s.slots[i].output) continue;
    Node* node = graph.nodes[s.slots[i].node].get();
    node->storage = bound.storage[i];
    drop_history(*node);
  }
  for (const PlanAlias& alias : s.aliases) {
    Node* node = graph.nodes[alias.node].get();
    node->storage = bound.storage[alias.slot];
    drop_history(*node);
  }
}

void realize_once(const std::vector<NodePtr>& targets) {
  // One plan per device: targets on several devices run as one graph each.
  for (const NodePtr& t : targets)
    if (t && t->device != targets.front()->device) {
      std::vector<NodePtr> here, elsewhere;
      for (const NodePtr& u : targets) (u->device == targets.front()->device ? here : elsewhere).push_back(u);
      realize_once(here);
      return realize_once(elsewhere);
    }
  std::lock_guard<std::mutex> lock(g_mutex);
  memory::Compression compression;
  PendingGraph graph = collect_compressed(targets, &compression);
  if (graph.nodes.empty()) return;
  const Device device = graph.nodes.front()->device;
  for (const NodePtr& n : graph.nodes)
    KILN_CHECK(n->device == device, op_name(n->op), "{} on {} depends on pending work on {}; move tensors with .to() "
               "before combining them", shape_str(n->shape), n->device.str(), device.str());
  // The key encodes every node's device: the same graph on another device is another plan.
  Plan* plan = nullptr;
  std::unique_ptr<Plan> uncached;
  bool hit = false;
  // A replay the recomputation passes rewired before runs the rewired plan on the graph as it is.
  std::string rewired_key;
  if (flags().plan_cache && passes_may_rewire()) {
    rewired_key = rewire_key(graph);
    if (auto it = g_rewired_plans.find(rewired_key); it != g_rewired_plans.end()) {
      if (it->second) {
        plan = it->second.get();
      } else if (auto left = g_plans.find(graph.key); left != g_plans.end()) {
        plan = left->second.get();
      }
    }
  }
  Recomputed recomputed;
  int64_t budget = -1;
  std::optional<Collected> collected;  // the graph before the passes, when they run and a replay may follow
  if (!plan) {
    if (!rewired_key.empty()) collected.emplace(graph);
    bool cheap = true;  // KILN_RECOMPUTE's choice, as without a budget
    if (!flags().memory_budget.empty()) budget = fit_memory_budget(targets, graph, recomputed, cheap);
    if (cheap) recompute_cheap_activations(targets, graph, &recomputed, true);
    if (flags().plan_cache)
      if (auto it = g_plans.find(graph.key); it != g_plans.end()) plan = it->second.get();
  }
  if (plan) {
    hit = true;
    stats().plan_cache_hits++;
  } else {
    uncached = make_plan(graph, lower(graph, schedule(graph)), device, budget);
    uncached->info->compressed_values = compression.values;
    uncached->info->compressed_from = compression.full_bytes;
    uncached->info->compressed_to = compression.kept_bytes;
    uncached->info->recomputed_values = recomputed.values;
    uncached->info->recomputed_bytes = recomputed.bytes;
    uncached->info->recomputed_elements = recomputed.elements;
    uncached->info->recomputed_flops = recomputed.flops;
    for (const NodePtr& n : graph.nodes)
      if (op_kind(n->op) != OpKind::Movement && op_kind(n->op) != OpKind::Leaf)
        uncached->info->step_flops += memory::node_flops(*n);
    memory::note_plan(uncached->info);
    uncached->kernels = uncached->backend->compile(uncached->program.kernels, device, uncached->group_start);
    stats().plans_built++;
    plan = uncached.get();
  }
  if (flags().log >= 1)
    fmt::print(stderr, "[kiln] realize: {} nodes, {} inputs -> {} kernels (plan cache {})\n", graph.nodes.size(),
               graph.externals.size(), plan->program.kernels.size(), hit ? "hit" : "miss");
  if (flags().log >= 1 && !hit)
    for (const Kernel& k : plan->program.kernels) fmt::print(stderr, "[kiln]   {:<10} {}\n", k.name, k.summary);
  memory::note_plan_run(plan->info);
  run_plan(*plan, graph);
  if (collected) {
    if (collected->key == graph.key) g_rewired_plans.emplace(std::move(rewired_key), nullptr);
    else if (auto replay = plan_for_collected(*plan, *collected, graph, recomputed))
      g_rewired_plans.emplace(std::move(rewired_key), std::move(replay));
    else if (flags().log >= 1)
      fmt::print(stderr, "[kiln] a rewired graph's plan has no counterpart in the graph as collected: its replays "
                 "rewire it again\n");
  }
  if (uncached && flags().plan_cache) g_plans.emplace(graph.key, std::move(uncached));
}

}  // namespace

namespace {
thread_local CaptureScope* t_capture = nullptr;
}  // namespace

CaptureScope::CaptureScope() {
  KILN_CHECK(!t_capture, "CaptureScope", "a capture is already open on this thread; scopes do not nest");
  t_capture = this;
}
CaptureScope::~CaptureScope() { t_capture = nullptr; }

void realize(const std::vector<NodePtr>& targets) {
  if (CaptureScope* scope = t_capture) {
    t_capture = nullptr;  // realize_captured realizes through here
    struct Reopen {
      CaptureScope* scope;
      ~Reopen() { t_capture = scope; }
    } reopen{scope};
    std::string why;
    if (std::optional<CapturedRun> run = realize_captured(targets, why)) scope->runs_.push_back(std::move(*run));
    else if (why != "nothing was pending") scope->why_not_.push_back(std::move(why));
    return;
  }
  try {
    realize_once(targets);
  } catch (const HostMemoryShort& short_of) {
    // Nothing ran: plan again without offload, recomputing what the budget needs instead.
    fmt::print(stderr, "kiln: warning: no host memory for {} of offloaded activations; KILN_OFFLOAD is off from "
               "now on (the memory budget recomputes instead)\n", memory::format_bytes(short_of.bytes));
    flags().offload = "off";
    realize_once(targets);
  }
}

std::optional<CapturedRun> realize_captured(const std::vector<NodePtr>& targets, std::string& why) {
  if (targets.empty()) {
    why = "nothing was pending";
    return std::nullopt;
  }
  const auto elsewhere = [&](const NodePtr& t) { return t && t->device != targets.front()->device; };
  if (std::any_of(targets.begin(), targets.end(), elsewhere)) {
    why = "its values are on several devices (one plan each)";
    realize(targets);
    return std::nullopt;
  }
  // The graph as this realize will collect it and the key of its replay plan, kept by address
  // (and the externals weakly): an owning reference would keep the run's updates from writing
  // over their old values.
  std::vector<const Node*> nodes;
  std::vector<std::weak_ptr<Node>> externals;
  std::string key, rewired_key;
  CapturedRun run;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    PendingGraph graph = collect_compressed(targets);
    if (flags().plan_cache && passes_may_rewire()) rewired_key = rewire_key(graph);
    key = graph.key;
    for (const NodePtr& n : graph.nodes) nodes.push_back(n.get());
    for (const NodePtr& e : graph.externals) {
      externals.push_back(e);
      run.externals.push_back({e.get(), e->storage->data, e->shape, e->dtype, e->device});
    }
  }
  // What a plan binds of each node, read before the run: it may free them.
  struct Marks {
    uint64_t id;
    double scalar;
    std::pair<uint64_t, uint64_t> key;
  };
  std::vector<Marks> before;
  for (const Node* n : nodes) before.push_back({n->id, n->scalar, {n->seed, n->offset}});
  realize(targets);
  if (nodes.empty()) {
    why = "nothing was pending";
    return std::nullopt;
  }
  if (!flags().plan_cache) {
    why = "the plan cache is off (KILN_PLAN_CACHE=0)";
    return std::nullopt;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  const Plan* plan = nullptr;
  if (auto it = g_rewired_plans.find(rewired_key); !rewired_key.empty() && it != g_rewired_plans.end())
    plan = it->second.get();
  if (!plan)
    if (auto it = g_plans.find(key); it != g_plans.end()) plan = it->second.get();
  if (!plan) {
    why = "its plan is not cached for the graph as collected";
    return std::nullopt;
  }
  run.plan = plan;
  run.generation = g_plan_generation;
  for (const std::weak_ptr<Node>& e : externals) run.held_externals.push_back(e.lock());
  for (int n : plan->program.scalar_nodes) {
    run.scalar_nodes.push_back(nodes[n]);
    run.scalar_ids.push_back(before[n].id);
    run.scalars.push_back(before[n].scalar);
  }
  for (int n : plan->program.rand_nodes) run.random.push_back(before[n].key);
  // Outputs are alive: held by the caller (its targets) or by a user's handle.
  auto add_output = [&](int position) {
    const Node& n = *nodes[position];
    run.outputs.push_back(&n);
    NodePtr copy = new_node(n);
    copy->inputs.clear();
    copy->storage.reset();
    copy->replaces.reset();
    copy->segment.reset();
    copy->held = 0;
    run.prototypes.push_back(std::move(copy));
  };
  for (const PlanSlot& slot : plan->program.slots)
    if (slot.output) add_output(slot.node);
  for (const PlanAlias& alias : plan->program.aliases) add_output(alias.node);
  return run;
}

uint64_t plan_cache_generation() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_plan_generation;
}

std::vector<NodePtr> replay(const CapturedRun& run, ReplayBindings bindings) {
  std::lock_guard<std::mutex> lock(g_mutex);
  KILN_CHECK(run.generation == g_plan_generation, "replay",
             "the captured plan was dropped (clear_plan_cache); capture the step again");
  const Plan& plan = *run.plan;
  const Program& s = plan.program;
  KILN_CHECK(bindings.externals.size() == run.externals.size() && bindings.scalars.size() == run.scalars.size() &&
                 bindings.random.size() == run.random.size(),
             "replay", "{} values, {} scalars and {} random keys bound where the captured run bound {}, {} and {}",
             bindings.externals.size(), bindings.scalars.size(), bindings.random.size(), run.externals.size(),
             run.scalars.size(), run.random.size());
  for (size_t e = 0; e < run.externals.size(); ++e) {
    const NodePtr& value = bindings.externals[e];
    const CapturedRun::Value& was = run.externals[e];
    KILN_CHECK(value && value->realized(), "replay", "value {} of the step is not realized; sync it first", e);
    KILN_CHECK(value->shape == was.shape && value->dtype == was.dtype && value->device == was.device, "replay",
               "value {} is {} {} on {} where the captured step read {} {} on {}; capture the step again for other "
               "shapes", e, dtype_name(value->dtype), shape_str(value->shape), value->device.str(),
               dtype_name(was.dtype), shape_str(was.shape), was.device.str());
  }
  Bound bound;
  bound.storage.resize(s.slots.size());
  for (size_t i = 0; i < s.slots.size(); ++i)
    if (s.slots[i].external >= 0) bound.storage[i] = bindings.externals[s.slots[i].external]->storage;
  bound.scalars = std::move(bindings.scalars);
  for (auto [seed, offset] : bindings.random) {
    bound.int_scalars.push_back(static_cast<int64_t>(seed));
    bound.int_scalars.push_back(static_cast<int64_t>(offset));
  }
  // The old value is unobserved where only `bindings` and one Var (the one the caller points at
  // the result) hold it, and its buffer only that node and the binding table.
  for (auto [out, ext] : plan.updates) {
    const NodePtr& old = bindings.externals[s.slots[ext].external];
    bound.overwrite.push_back(old->held <= 1 && old.use_count() <= 1 + old->held && old->storage.use_count() == 2);
  }
  run_bound(plan, bound);
  std::vector<NodePtr> results;
  results.reserve(run.prototypes.size());
  auto result = [&](size_t i, int slot) {
    NodePtr n = new_node(*run.prototypes[i]);
    n->id = Node::next_id();
    n->storage = bound.storage[static_cast<size_t>(slot)];
    results.push_back(std::move(n));
  };
  size_t i = 0;
  for (size_t slot = 0; slot < s.slots.size(); ++slot)
    if (s.slots[slot].output) result(i++, static_cast<int>(slot));
  for (const PlanAlias& alias : s.aliases) result(i++, alias.slot);
  return results;
}

Program lower_for(const std::vector<NodePtr>& targets) {
  std::lock_guard<std::mutex> lock(g_mutex);
  PendingGraph graph = collect_compressed(targets);
  recompute_cheap_activations(targets, graph);
  return lower(graph, schedule(graph));
}

ScheduledGraph schedule_for(const std::vector<NodePtr>& targets) {
  std::lock_guard<std::mutex> lock(g_mutex);
  ScheduledGraph out{collect_compressed(targets), {}};
  recompute_cheap_activations(targets, out.graph);
  out.schedule = schedule(out.graph);
  return out;
}

memory::PlanLayout last_plan_memory() {
  auto layout = memory::last_plan();
  return layout ? *layout : memory::PlanLayout{};
}

void clear_plan_cache() {
  std::lock_guard<std::mutex> lock(g_mutex);
  ++g_plan_generation;      // captured runs (realize_captured) refer to these plans
  g_rewired_plans.clear();  // first: its copies share the kernels of plans in g_plans
  g_plans.clear();
  g_recompute_choices.clear();
  g_cheap_choices.clear();
}

size_t plan_cache_size() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_plans.size();
}

}  // namespace kiln::jit

namespace kiln {

void sync(const std::vector<Tensor>& tensors) {
  std::vector<NodePtr> targets;
  for (const Tensor& t : tensors)
    if (t.defined()) targets.push_back(t.node());
  jit::realize(targets);
}

}  // namespace kiln
