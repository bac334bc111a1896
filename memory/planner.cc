#include "memory/planner.h"

#include <algorithm>
#include <functional>
#include <numeric>

namespace kiln::memory {

namespace {
constexpr int64_t kAlign = 64;

int64_t aligned(int64_t bytes) { return (std::max<int64_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign; }

// Buffers merged by in-place reuse share one placement.
struct Group {
  int64_t bytes = 0;
  int first = 0, last = 0;
  int64_t offset = -1;
};
}  // namespace

MemoryPlan plan_memory(const std::vector<BufferRequest>& requests) {
  const size_t n = requests.size();
  MemoryPlan plan;
  plan.offsets.assign(n, 0);
  std::vector<int> group_of(n, -1);
  std::vector<bool>& handed_on = plan.handed_on;
  handed_on.assign(n, false);
  std::vector<Group> groups;
  for (size_t i = 0; i < n; ++i) {
    const BufferRequest& r = requests[i];
    int prev = r.in_place_of;
    if (prev >= 0 && prev < static_cast<int>(i) && group_of[prev] >= 0 && !handed_on[prev]) {
      Group& g = groups[group_of[prev]];
      // Only the buffer that ends the group can hand its memory on, once, exactly where it dies.
      if (g.last == r.first && requests[prev].last == r.first && requests[prev].first < r.first) {
        handed_on[prev] = true;
        group_of[i] = group_of[prev];
        g.bytes = std::max(g.bytes, aligned(r.bytes));
        g.last = std::max(g.last, r.last);
        plan.in_place++;
        continue;
      }
    }
    group_of[i] = static_cast<int>(groups.size());
    groups.push_back({aligned(r.bytes), r.first, r.last});
  }

  // Lower bound: the most bytes live during one kernel (in-place pairs count once).
  int horizon = 0;
  for (const Group& g : groups) horizon = std::max(horizon, g.last + 1);
  std::vector<int64_t> live(horizon + 1, 0);
  for (const Group& g : groups) {
    live[g.first] += g.bytes;
    live[g.last + 1] -= g.bytes;
  }
  int64_t running = 0;
  for (int t = 0; t < horizon; ++t) plan.lower_bound = std::max(plan.lower_bound, running += live[t]);

  // Greedy placement misses the bound on some plans (a large late buffer finds the gaps of
  // earlier ones too narrow): a few orders are tried and the smallest arena kept, the first one
  // that reaches the bound ending the search.
  const std::vector<std::function<bool(const Group&, const Group&)>> orders = {
      [](const Group& a, const Group& b) { return a.bytes > b.bytes; },
      [](const Group& a, const Group& b) {
        return a.bytes * (a.last - a.first + 1) > b.bytes * (b.last - b.first + 1);
      },
      [](const Group& a, const Group& b) {
        return a.last - a.first != b.last - b.first ? a.last - a.first > b.last - b.first : a.bytes > b.bytes;
      },
  };
  std::vector<int64_t> best_offsets;
  plan.arena_bytes = INT64_MAX;
  std::vector<int> order(groups.size()), placed;
  std::vector<const Group*> conflicts;
  for (const auto& before : orders) {
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      if (before(groups[a], groups[b])) return true;
      if (before(groups[b], groups[a])) return false;
      return groups[a].first < groups[b].first;
    });
    for (Group& g : groups) g.offset = -1;
    placed.clear();
    int64_t arena = 0;
    for (int gi : order) {
      Group& g = groups[gi];
      // Placed buffers alive at the same time as g, by address.
      conflicts.clear();
      for (int pi : placed) {
        const Group& p = groups[pi];
        if (p.first <= g.last && g.first <= p.last) conflicts.push_back(&p);
      }
      std::sort(conflicts.begin(), conflicts.end(), [](const Group* a, const Group* b) { return a->offset < b->offset; });
      int64_t best = -1, best_gap = INT64_MAX, cursor = 0;
      for (const Group* c : conflicts) {
        int64_t gap = c->offset - cursor;
        if (gap >= g.bytes && gap < best_gap) {
          best = cursor;
          best_gap = gap;
        }
        cursor = std::max(cursor, c->offset + c->bytes);
      }
      g.offset = best >= 0 ? best : cursor;
      arena = std::max(arena, g.offset + g.bytes);
      placed.push_back(gi);
    }
    if (arena < plan.arena_bytes) {
      plan.arena_bytes = arena;
      best_offsets.clear();
      for (const Group& g : groups) best_offsets.push_back(g.offset);
    }
    if (plan.arena_bytes <= plan.lower_bound) break;
  }
  for (size_t g = 0; g < groups.size(); ++g) groups[g].offset = best_offsets[g];
  for (size_t i = 0; i < n; ++i) plan.offsets[i] = groups[group_of[i]].offset;
  return plan;
}

}  // namespace kiln::memory
