#include "jit/offload.h"

#include <algorithm>

#include "core/error.h"
#include "memory/allocator.h"

namespace kiln::jit {

namespace {

// How many kernels a copy may overlap before it is joined: beyond a few, the buffer held for it
// costs more memory than waiting would cost time.
constexpr int kMaxLead = 8;

// Whether a transfer may go before kernel `k` (or at the end): not inside a row group.
bool boundary(const std::vector<int>& group_start, size_t kernels, int k) {
  return group_start.empty() || k >= static_cast<int>(kernels) || group_start[static_cast<size_t>(k)] == k;
}

int next_boundary(const std::vector<int>& group_start, size_t kernels, int k) {
  while (!boundary(group_start, kernels, k)) ++k;
  return k;
}

int previous_boundary(const std::vector<int>& group_start, size_t kernels, int k) {
  while (!boundary(group_start, kernels, k)) --k;
  return k;
}

int64_t slot_bytes(const Program& p, int slot) {
  return p.slots[slot].numel * static_cast<int64_t>(dtype_size(p.slots[slot].dtype));
}

Kernel transfer_kernel(TransferStage stage, int id, const PlanSlot& slot, int64_t bytes, std::vector<KernelBuffer> buffers,
                       const Kernel& near) {
  static const char* const kNames[] = {"offload", "offload_join", "fetch", "fetch_join"};
  Kernel k;
  k.kind = KernelKind::Transfer;
  k.transfer = {stage, id, bytes};
  k.buffers = std::move(buffers);
  k.out_numel = slot.numel;
  k.name = fmt::format("kiln_{}{}", kNames[static_cast<int>(stage)], id);
  const char* what = stage == TransferStage::OffloadStart ? "to host"
                     : stage == TransferStage::FetchStart ? "from host"
                                                          : "wait";
  k.summary = fmt::format("{} #{} {} {} ({})", stage <= TransferStage::OffloadJoin ? "Offload" : "Fetch", id, what,
                          memory::format_bytes(bytes), dtype_name(slot.dtype));
  k.label = near.label;
  k.backward = stage >= TransferStage::FetchStart;
  return k;
}

}  // namespace

double estimated_seconds(const Program& program, const Kernel& k, const DeviceModel& model) {
  double bytes = 0;
  for (const KernelBuffer& b : k.buffers) bytes += static_cast<double>(slot_bytes(program, b.slot));
  double flops = 0;
  if (k.kind == KernelKind::Matmul) {
    const MatmulCall& m = k.matmul;
    flops = 2.0 * static_cast<double>(m.batch) * static_cast<double>(m.M) * static_cast<double>(m.K) * static_cast<double>(m.N);
  } else if (k.kind == KernelKind::Conv) {
    const ConvGeometry& g = k.conv.geometry;
    flops = 2.0 * static_cast<double>(g.N * g.OC * g.OH * g.OW) * static_cast<double>(g.C / std::max<int64_t>(g.groups, 1) * g.KH * g.KW);
  } else if (k.kind == KernelKind::Attention) {
    const AttentionCall& a = k.attention;
    flops = (a.backward ? 10.0 : 4.0) * static_cast<double>(a.B * a.H) * static_cast<double>(a.Tq * a.Tk) * static_cast<double>(a.D);
  }
  return std::max(bytes / model.memory_bytes_per_s, flops / model.flops_per_s) + model.launch_s;
}

std::vector<OffloadCandidate> offload_candidates(const Program& program, const std::vector<int>& group_start,
                                                 const DeviceModel& model) {
  const std::vector<Kernel>& kernels = program.kernels;
  const size_t n = program.slots.size();
  std::vector<int> writer(n, -1), last_forward(n, -1), first_backward(n, -1);
  std::vector<char> excluded(n, 0);
  for (size_t k = 0; k < kernels.size(); ++k) {
    const Kernel& kernel = kernels[k];
    const int at = static_cast<int>(k);
    // A tile's scratch lives inside its kernel; a transfer's buffers are offloaded already.
    if (kernel.tiles.buffer >= 0) excluded[kernel.buffers[kernel.tiles.buffer].slot] = 1;
    for (const KernelBuffer& b : kernel.buffers) {
      if (kernel.kind == KernelKind::Transfer) excluded[b.slot] = 1;
      if (b.written) {
        if (writer[b.slot] < 0) writer[b.slot] = at;
        else if (writer[b.slot] != at) excluded[b.slot] = 1;  // written twice: not one saved value
        if (kernel.backward) excluded[b.slot] = 1;
        continue;
      }
      if (kernel.backward) {
        if (first_backward[b.slot] < 0) first_backward[b.slot] = at;
      } else if (first_backward[b.slot] >= 0) {
        excluded[b.slot] = 1;  // read by the forward (or an update) after the backward: no single gap
      } else {
        last_forward[b.slot] = at;
      }
    }
  }
  std::vector<double> seconds(kernels.size());
  for (size_t k = 0; k < kernels.size(); ++k) seconds[k] = estimated_seconds(program, kernels[k], model);
  std::vector<OffloadCandidate> out;
  for (size_t s = 0; s < n; ++s) {
    const PlanSlot& slot = program.slots[s];
    if (excluded[s] || slot.external >= 0 || slot.keep || slot.host || writer[s] < 0 || first_backward[s] < 0) continue;
    OffloadCandidate c;
    c.slot = static_cast<int>(s);
    c.last_forward = std::max(last_forward[s], writer[s]);
    c.first_backward = first_backward[s];
    c.begin = next_boundary(group_start, kernels.size(), c.last_forward + 1);
    c.end = previous_boundary(group_start, kernels.size(), c.first_backward);
    // The wait for the copy out and the fetch's start go between: a kernel on each side.
    if (c.end <= c.begin || next_boundary(group_start, kernels.size(), c.begin + 1) >= c.end) continue;
    c.bytes = slot_bytes(program, c.slot);
    if (c.bytes == 0) continue;
    c.copy_s = static_cast<double>(c.bytes) / model.copy_bytes_per_s;
    for (int k = c.last_forward + 1; k < c.first_backward; ++k) c.gap_s += seconds[static_cast<size_t>(k)];
    out.push_back(c);
  }
  std::stable_sort(out.begin(), out.end(), [](const OffloadCandidate& a, const OffloadCandidate& b) { return a.bytes > b.bytes; });
  return out;
}

void insert_offloads(Program& program, const std::vector<OffloadCandidate>& chosen, const std::vector<int>& group_start,
                     const DeviceModel& model) {
  if (chosen.empty()) return;
  const std::vector<Kernel>& kernels = program.kernels;
  std::vector<double> seconds(kernels.size());
  for (size_t k = 0; k < kernels.size(); ++k) seconds[k] = estimated_seconds(program, kernels[k], model);
  // Insertions before original kernel `before`; at one place, joins (which free) before starts.
  struct Insertion {
    int before;
    TransferStage stage;
    int id;
    Kernel kernel;
  };
  std::vector<Insertion> insertions;
  std::vector<int> renamed(program.slots.size(), -1), renamed_from(program.slots.size(), -1);
  for (size_t id = 0; id < chosen.size(); ++id) {
    const OffloadCandidate& c = chosen[id];
    const int i = static_cast<int>(id);
    const PlanSlot source = program.slots[c.slot];
    KILN_CHECK(c.slot < static_cast<int>(renamed.size()) && renamed[c.slot] < 0 && c.begin < c.end, "offload",
               "internal: candidate {} is not one of this program's", c.slot);
    PlanSlot host = source;
    host.node = -1;
    host.host = true;
    PlanSlot fetched = source;
    fetched.node = -1;
    const int h = static_cast<int>(program.slots.size());
    program.slots.push_back(host);
    const int f = static_cast<int>(program.slots.size());
    program.slots.push_back(fetched);
    renamed.resize(program.slots.size(), -1);
    renamed_from.resize(program.slots.size(), -1);
    renamed[c.slot] = f;
    renamed_from[c.slot] = c.end;
    // Joined once the kernels since the start have taken as long as the copy (at least one of
    // them, at most about kMaxLead); the fetch starts as far ahead of the backward's read, not
    // before that join; both outside row groups.
    const size_t n = kernels.size();
    int join = c.begin;
    for (double t = 0; join < c.end && (join == c.begin || (t < c.copy_s && join < c.begin + kMaxLead));) {
      const int later = next_boundary(group_start, n, join + 1);
      for (int k = join; k < later; ++k) t += seconds[static_cast<size_t>(k)];
      join = later;
    }
    join = std::min(join, previous_boundary(group_start, n, c.end - 1));
    int fetch = previous_boundary(group_start, n, c.end - 1);
    double ahead = 0;
    for (int k = fetch; k < c.end; ++k) ahead += seconds[static_cast<size_t>(k)];
    while (ahead < c.copy_s && fetch > join && fetch > c.end - kMaxLead) {
      const int earlier = std::max(join, previous_boundary(group_start, n, fetch - 1));
      for (int k = earlier; k < fetch; ++k) ahead += seconds[static_cast<size_t>(k)];
      fetch = earlier;
    }
    const Kernel& near = kernels[static_cast<size_t>(c.last_forward)];
    const DType dtype = source.dtype;
    insertions.push_back({c.begin, TransferStage::OffloadStart, i,
                          transfer_kernel(TransferStage::OffloadStart, i, source, c.bytes, {{h, dtype, true}, {c.slot, dtype, false}}, near)});
    insertions.push_back({join, TransferStage::OffloadJoin, i,
                          transfer_kernel(TransferStage::OffloadJoin, i, source, c.bytes, {{c.slot, dtype, false}}, near)});
    const Kernel& reader = kernels[static_cast<size_t>(c.first_backward)];
    insertions.push_back({fetch, TransferStage::FetchStart, i,
                          transfer_kernel(TransferStage::FetchStart, i, source, c.bytes, {{f, dtype, true}, {h, dtype, false}}, reader)});
    insertions.push_back({c.end, TransferStage::FetchJoin, i,
                          transfer_kernel(TransferStage::FetchJoin, i, source, c.bytes, {{f, dtype, false}}, reader)});
  }
  auto rank = [](TransferStage s) {
    return s == TransferStage::OffloadJoin ? 0 : s == TransferStage::FetchJoin ? 1 : s == TransferStage::OffloadStart ? 2 : 3;
  };
  std::stable_sort(insertions.begin(), insertions.end(), [&](const Insertion& a, const Insertion& b) {
    return a.before != b.before ? a.before < b.before : rank(a.stage) < rank(b.stage);
  });
  std::vector<Kernel> out;
  out.reserve(kernels.size() + insertions.size());
  size_t next = 0;
  for (size_t k = 0; k <= kernels.size(); ++k) {
    for (; next < insertions.size() && insertions[next].before == static_cast<int>(k); ++next)
      out.push_back(std::move(insertions[next].kernel));
    if (k == kernels.size()) break;
    Kernel kernel = std::move(program.kernels[k]);
    // The backward reads the fetched copy.
    for (KernelBuffer& b : kernel.buffers)
      if (!b.written && renamed[b.slot] >= 0 && static_cast<int>(k) >= renamed_from[b.slot]) b.slot = renamed[b.slot];
    out.push_back(std::move(kernel));
  }
  program.kernels = std::move(out);
}

}  // namespace kiln::jit
