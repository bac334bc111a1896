#include "jit/plan.h"

#include <algorithm>
#include <functional>
#include <string>
#include <utility>

#include <fmt/core.h>

#include "core/flags.h"
#include "jit/offload.h"
#include "jit/tile_matmul.h"

namespace kiln::jit {

namespace {

// Whether kernel `k` may write its output over input buffer `b`: an elementwise kernel that
// reads that buffer only at the element it writes (so each element is read before it is written).
bool reads_only_in_place(const Kernel& k, int b) {
  if (k.kind != KernelKind::Elementwise) return false;
  // A tile's matmul reads whole rows and columns of its operands, other tiles' elements too; a
  // kernel making an operand block by block writes every block over the same scratch.
  if (k.tiles.buffer >= 0 && (k.tiles.operand || b == k.matmul.a_buffer || b == k.matmul.b_buffer)) return false;
  return reads_at_store_index(k, b);
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
  const Program& s = plan.program;
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    if (!in_row_group(plan, k)) continue;
    size_t end = k;
    while (end + 1 < s.kernels.size() && plan.group_start[end + 1] == plan.group_start[k]) ++end;
    for (const KernelBuffer& b : s.kernels[k].buffers)
      plan.last_use[b.slot] = std::max(plan.last_use[b.slot], static_cast<int>(end));
  }
}

// Where a collective's input lives inside its output buffer: the slot of that output and the byte
// offset, or {-1, 0}.
struct PackedPlace {
  int into = -1;
  int64_t at = 0;
};

// A bucket's gradients written straight into their place in the all-reduce's buffer, so the
// collective packs nothing: an input qualifies when it is an intermediate of exactly its part's
// size, written by an earlier kernel outside row groups, and read by nothing after the collective.
std::vector<PackedPlace> pack_collective_inputs(const Plan& plan, const std::vector<int>& writer,
                                                const std::vector<char>& side_output,
                                                const std::function<bool(int)>& intermediate) {
  const Program& s = plan.program;
  std::vector<PackedPlace> place(s.slots.size());
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    const Kernel& kernel = s.kernels[k];
    if (kernel.kind != KernelKind::Collective || kernel.collective.kind != CollectiveKind::AllReduce ||
        in_row_group(plan, k))
      continue;
    const int out = kernel.buffers[0].slot;
    if (!intermediate(out)) continue;
    const int64_t element = static_cast<int64_t>(dtype_size(kernel.buffers[0].dtype));
    int64_t at = 0;
    for (size_t i = 0; i < kernel.collective.in_buffers.size(); ++i) {
      const int slot = kernel.buffers[kernel.collective.in_buffers[i]].slot;
      const int64_t bytes = kernel.collective.counts[i] * element;
      const bool once = std::count_if(kernel.collective.in_buffers.begin(), kernel.collective.in_buffers.end(),
                                      [&](int b) { return kernel.buffers[b].slot == slot; }) == 1;
      if (once && intermediate(slot) && !side_output[slot] && plan.last_use[slot] == static_cast<int>(k) &&
          writer[slot] >= 0 && writer[slot] < static_cast<int>(k) && !in_row_group(plan, static_cast<size_t>(writer[slot])) &&
          s.slots[slot].numel * element == bytes && s.slots[slot].dtype == kernel.buffers[0].dtype)
        place[slot] = {out, at};
      at += bytes;
    }
  }
  return place;
}

// Intermediates get offsets in one arena; outputs and externals live in their own storage.
void plan_buffers(Plan& plan) {
  const Program& s = plan.program;
  auto bytes_of = [&](int slot) { return s.slots[slot].numel * static_cast<int64_t>(dtype_size(s.slots[slot].dtype)); };
  std::function<bool(int)> intermediate = [&](int slot) {
    return s.slots[slot].external < 0 && !s.slots[slot].keep && !s.slots[slot].host;
  };
  std::vector<int> writer(s.slots.size(), -1);
  std::vector<char> side_output(s.slots.size(), 0);
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    for (const SideStore& side : s.kernels[k].side_stores) side_output[s.kernels[k].buffers[side.buffer].slot] = 1;
    if (writer[s.kernels[k].buffers[0].slot] < 0) writer[s.kernels[k].buffers[0].slot] = static_cast<int>(k);
    // (The product of a kernel making its operand block by block: a gradient its bucket may take.)
    if (s.kernels[k].tiles.operand) writer[s.kernels[k].buffers[s.kernels[k].tiles.buffer].slot] = static_cast<int>(k);
  }
  const std::vector<PackedPlace> packed = pack_collective_inputs(plan, writer, side_output, intermediate);
  // A collective's buffer is live from its first packed input's kernel on.
  std::vector<int> first_write(s.slots.size(), -1);
  for (size_t slot = 0; slot < s.slots.size(); ++slot)
    if (packed[slot].into >= 0) {
      int& f = first_write[packed[slot].into];
      f = f < 0 ? writer[slot] : std::min(f, writer[slot]);
    }
  std::vector<memory::BufferRequest> requests, host_requests;
  std::vector<int> request_of(s.slots.size(), -1), slot_of_request, host_slot_of_request;
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    const Kernel& kernel = s.kernels[k];
    const bool grouped = in_row_group(plan, k);
    const int first = grouped ? plan.group_start[k] : static_cast<int>(k);
    for (const SideStore& side : kernel.side_stores) {
      int slot = kernel.buffers[side.buffer].slot;
      if (!intermediate(slot)) {
        plan.output_bytes += bytes_of(slot);
        continue;
      }
      request_of[slot] = static_cast<int>(requests.size());
      slot_of_request.push_back(slot);
      requests.push_back({bytes_of(slot), first, plan.last_use[slot], -1});
    }
    // A tiled matmul's scratch (jit/tile_matmul.h) lives while its reader runs; the product of a
    // kernel that makes its operand block by block lives on like any output.
    if (kernel.tiles.buffer >= 0) {
      const int slot = kernel.buffers[kernel.tiles.buffer].slot;
      const bool lives_on = kernel.tiles.operand;
      if (lives_on && !intermediate(slot)) {
        plan.output_bytes += bytes_of(slot);
      } else if (!lives_on || packed[slot].into < 0) {  // (a packed one is placed in its collective's buffer, below)
        request_of[slot] = static_cast<int>(requests.size());
        slot_of_request.push_back(slot);
        requests.push_back({bytes_of(slot), first, lives_on ? plan.last_use[slot] : static_cast<int>(k), -1});
      }
    }
    if (!writes_output(kernel)) continue;  // a transfer's join
    int out = kernel.buffers[0].slot;
    if (s.slots[out].host) {  // an offloaded copy: lives in the host arena until its fetch is joined
      host_slot_of_request.push_back(out);
      host_requests.push_back({bytes_of(out), first, plan.last_use[out], -1});
      continue;
    }
    if (!intermediate(out)) {
      plan.output_bytes += bytes_of(out);
      continue;
    }
    if (packed[out].into >= 0) continue;  // placed inside its collective's buffer, below
    memory::BufferRequest r{bytes_of(out), first_write[out] >= 0 ? std::min(first, first_write[out]) : first,
                            plan.last_use[out], -1};
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
  // What one kernel reads and writes of the arena at once (with its tile scratch; an output
  // written over its input counted once): no schedule or recomputation of these kernels needs less.
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    int64_t bytes = 0;
    std::vector<int> seen;
    for (const KernelBuffer& b : s.kernels[k].buffers)
      if (intermediate(b.slot) && request_of[b.slot] >= 0 && std::find(seen.begin(), seen.end(), b.slot) == seen.end()) {
        seen.push_back(b.slot);
        if (!(b.slot == s.kernels[k].buffers[0].slot && requests[request_of[b.slot]].in_place_of >= 0))
          bytes += bytes_of(b.slot);
      }
    if (bytes > plan.info->working_set) {
      plan.info->working_set = bytes;
      plan.info->working_set_kernel = static_cast<int>(k);
    }
  }
  plan.offset.assign(s.slots.size(), -1);
  plan.dies_after.assign(s.kernels.size(), {});
  for (size_t i = 0; i < requests.size(); ++i) {
    plan.offset[slot_of_request[i]] = plan.memory.offsets[i];
    if (!plan.memory.handed_on[i]) plan.dies_after[requests[i].last].push_back({plan.memory.offsets[i], requests[i].bytes});
  }
  for (size_t slot = 0; slot < s.slots.size(); ++slot)
    if (packed[slot].into >= 0) plan.offset[slot] = plan.offset[packed[slot].into] + packed[slot].at;
  plan.host_offset.assign(s.slots.size(), -1);
  plan.host_memory = memory::plan_memory(host_requests);
  for (size_t i = 0; i < host_requests.size(); ++i) plan.host_offset[host_slot_of_request[i]] = plan.host_memory.offsets[i];
  plan.info->host_arena_bytes = plan.host_memory.arena_bytes;
}

// An update `p.assign(f(p, ...))` can write straight into p's buffer when its kernel reads p only
// at the element it writes, no later kernel reads p, and no later kernel can fail (a failed run
// must leave every tensor as it was).
void find_in_place_updates(Plan& plan, const PendingGraph& graph) {
  const Program& s = plan.program;
  std::vector<int> output_index(graph.nodes.size(), -1);
  for (size_t i = 0; i < graph.outputs.size(); ++i) output_index[graph.outputs[i]] = static_cast<int>(i);
  std::vector<int> external_slot(graph.externals.size(), -1);
  for (size_t i = 0; i < s.slots.size(); ++i)
    if (s.slots[i].external >= 0) external_slot[s.slots[i].external] = static_cast<int>(i);
  const int last_fallible = plan.last_fallible;
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    const Kernel& kernel = s.kernels[k];
    if (kernel.kind != KernelKind::Elementwise || in_row_group(plan, k)) continue;  // (a group's other rows may still read the old value)
    // The kernel's output and its side stores (Adam's m and v in one kernel) are stored alike.
    std::vector<int> outs = {kernel.buffers[0].slot};
    for (const SideStore& side : kernel.side_stores) outs.push_back(kernel.buffers[side.buffer].slot);
    for (int out : outs) {
      if (s.slots[out].node < 0 || !s.slots[out].output) continue;
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
}

void note_liveness(Plan& plan) {
  const Program& s = plan.program;
  plan.last_use.assign(s.slots.size(), -1);
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    for (const KernelBuffer& b : s.kernels[k].buffers) plan.last_use[b.slot] = static_cast<int>(k);
    if (may_fail(s.kernels[k])) plan.last_fallible = static_cast<int>(k);
  }
}

// KILN_OFFLOAD (jit/offload.h): rewrites plan.program with the transfers of the saved activations
// chosen, on a backend whose memory is not the host's. Under auto only to meet `budget` (arena
// bytes; -1: none): the fewest of the candidates whose copies hide, largest first.
void offload_activations(Plan& plan, const Backend& backend, int64_t budget) {
  const std::string& mode = flags().offload;
  const bool all = mode == "all";
  if (mode == "off" || (!all && budget < 0)) return;
  if (!backend.offloads()) {
    static bool said = false;  // once, and only for a plan that had saved activations to offload
    if (all && !said && !offload_candidates(plan.program).empty() && !std::exchange(said, true))
      fmt::print(stderr, "kiln: note: KILN_OFFLOAD=all does nothing on the {} backend: its saved activations are "
                 "in host memory already\n", backend.name());
    return;
  }
  const std::vector<int> groups = backend.row_groups(plan.program.kernels);
  std::vector<OffloadCandidate> chosen = offload_candidates(plan.program, groups);
  if (!all) {
    chosen.erase(std::remove_if(chosen.begin(), chosen.end(), [](const OffloadCandidate& c) { return !c.hides(); }),
                 chosen.end());
    auto arena_with = [&](size_t count) {
      Plan trial;
      trial.program = plan.program;
      insert_offloads(trial.program, {chosen.begin(), chosen.begin() + static_cast<std::ptrdiff_t>(count)}, groups);
      note_liveness(trial);
      plan_buffers(trial);
      return trial.memory.arena_bytes;
    };
    if (chosen.empty() || arena_with(0) <= budget) return;
    // The arena shrinks (nearly always) as more values go: the fewest that fit, else all of them.
    size_t lo = 1, hi = chosen.size();
    if (arena_with(hi) <= budget)
      while (lo < hi) {
        const size_t mid = (lo + hi) / 2;
        if (arena_with(mid) <= budget) hi = mid;
        else lo = mid + 1;
      }
    chosen.resize(hi);
  }
  insert_offloads(plan.program, chosen, groups);
  plan.info->offloaded_values = static_cast<int>(chosen.size());
  for (const OffloadCandidate& c : chosen) plan.info->offloaded_bytes += c.bytes;
}

}  // namespace

std::unique_ptr<Plan> make_plan(const PendingGraph& graph, Program program, Device device, int64_t budget) {
  auto plan = std::make_unique<Plan>();
  plan->device = device;
  plan->backend = &backend_for(device);
  plan->program = std::move(program);
  if (flags().tiled_updates && plan->backend->runs_matmul_tiles()) tile_matmuls(plan->program);
  offload_activations(*plan, *plan->backend, budget);
  note_liveness(*plan);
  plan->group_start = plan->backend->row_groups(plan->program.kernels);
  if (!plan->group_start.empty()) extend_lifetimes_over_groups(*plan);
  plan_buffers(*plan);
  find_in_place_updates(*plan, graph);
  plan->info->output_bytes = plan->output_bytes;
  return plan;
}

std::shared_ptr<memory::PlanLayout> planned_memory(const PendingGraph& graph, int64_t budget) {
  Plan plan;
  plan.program = lower(graph, schedule(graph));
  if (!graph.nodes.empty()) {
    const Backend& backend = backend_for(graph.nodes.front()->device);
    if (flags().tiled_updates && backend.runs_matmul_tiles()) tile_matmuls(plan.program);
    offload_activations(plan, backend, budget);
  }
  note_liveness(plan);
  plan_buffers(plan);
  return plan.info;
}

}  // namespace kiln::jit
