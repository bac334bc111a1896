#include "memory/pool.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/flags.h"

namespace kiln::memory {

namespace {

void add(Stat& s, int64_t n) {
  s.current += n;
  s.total += n;
  s.peak = std::max(s.peak, s.current);
}
void sub(Stat& s, int64_t n) { s.current -= n; }
void reset_peak(Stat& s) { s.peak = s.current; }

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// A piece of one segment: free (in a free set) or allocated (in the live map). Blocks of a
// segment form a list in address order; a segment is one block with no neighbours.
struct Block {
  char* ptr = nullptr;
  size_t size = 0;       // bytes of the block
  size_t requested = 0;  // bytes asked for (allocated blocks)
  bool small = false;    // which pool the segment belongs to
  bool allocated = false;
  Block* prev = nullptr;
  Block* next = nullptr;
};

struct BySizeThenAddress {
  bool operator()(const Block* a, const Block* b) const {
    return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
  }
};
using FreeSet = std::set<Block*, BySizeThenAddress>;

}  // namespace

double PoolStats::fragmentation() const {
  return reserved.current > 0 ? 1.0 - static_cast<double>(allocated.current) / reserved.current : 0.0;
}

struct Pool::State {
  Allocator& underlying;
  mutable std::mutex mutex;
  FreeSet small_free, large_free;
  std::unordered_map<void*, Block*> live;
  PoolStats stats;

  explicit State(Allocator& a) : underlying(a) {}

  FreeSet& free_set(bool small) { return small ? small_free : large_free; }

  int64_t largest_free_block() const {
    int64_t largest = 0;
    if (!small_free.empty()) largest = static_cast<int64_t>((*small_free.rbegin())->size);
    if (!large_free.empty()) largest = std::max(largest, static_cast<int64_t>((*large_free.rbegin())->size));
    return largest;
  }

  // The smallest free block of at least `size` in its pool, taken out of the free set.
  Block* take_best_fit(size_t size, bool small) {
    FreeSet& set = free_set(small);
    Block key;
    key.size = size;
    auto it = set.lower_bound(&key);  // ptr nullptr sorts first among equal sizes
    if (it == set.end()) return nullptr;
    Block* b = *it;
    set.erase(it);
    return b;
  }

  Block* new_segment(size_t size, bool small) {
    void* p = underlying.allocate(size);
    if (!p) return nullptr;
    auto* b = new Block;
    b->ptr = static_cast<char*>(p);
    b->size = size;
    b->small = small;
    add(stats.reserved, static_cast<int64_t>(size));
    add(stats.segments, 1);
    return b;
  }

  void release_free_segments() {
    for (FreeSet* set : {&small_free, &large_free})
      for (auto it = set->begin(); it != set->end();) {
        Block* b = *it;
        if (b->prev || b->next) {
          ++it;
          continue;
        }
        it = set->erase(it);
        underlying.release(b->ptr, b->size);
        sub(stats.reserved, static_cast<int64_t>(b->size));
        sub(stats.segments, 1);
        delete b;
      }
  }

  // Cuts `b` down to `size` when the rest is worth a block of its own; the rest becomes free.
  void maybe_split(Block* b, size_t size) {
    size_t rest = b->size - size;
    bool split = b->small ? rest >= kRound : rest >= kMinLargeSplit;
    if (!split) return;
    auto* tail = new Block;
    tail->ptr = b->ptr + size;
    tail->size = rest;
    tail->small = b->small;
    tail->prev = b;
    tail->next = b->next;
    if (b->next) b->next->prev = tail;
    b->next = tail;
    b->size = size;
    free_set(tail->small).insert(tail);
  }

  // Merges free `b` with its free neighbours (which leave the free set); returns the result.
  Block* coalesce(Block* b) {
    if (Block* prev = b->prev; prev && !prev->allocated) {
      free_set(prev->small).erase(prev);
      prev->size += b->size;
      prev->next = b->next;
      if (b->next) b->next->prev = prev;
      delete b;
      b = prev;
    }
    if (Block* next = b->next; next && !next->allocated) {
      free_set(next->small).erase(next);
      b->size += next->size;
      b->next = next->next;
      if (next->next) next->next->prev = b;
      delete next;
    }
    return b;
  }

  [[noreturn]] void throw_oom(size_t requested, size_t segment) {
    std::string limit = flags().memory_limit.empty()
                            ? std::string("no KILN_MEMORY_LIMIT set")
                            : fmt::format("KILN_MEMORY_LIMIT={} ({})", flags().memory_limit,
                                          format_bytes(memory_limit_bytes()));
    KILN_FAIL("memory",
              "out of memory: cannot allocate {} (a new {} segment) from the {} allocator, even after "
              "emptying the cache.\n"
              "  pool: {} allocated, {} reserved, largest free block {}, OOM count {}; {}.\n"
              "  try: KILN_MEMORY_BUDGET (e.g. 0.5) so plans recompute activations instead of keeping "
              "them; kiln::checkpoint around layers; a smaller batch; kiln::empty_cache() to return "
              "memory cached by other pools",
              format_bytes(static_cast<int64_t>(requested)), format_bytes(static_cast<int64_t>(segment)),
              underlying.name(), format_bytes(stats.allocated.current), format_bytes(stats.reserved.current),
              format_bytes(largest_free_block()), stats.ooms, limit);
  }
};

Pool::Pool(Allocator& underlying) : state_(std::make_unique<State>(underlying)) {}

Pool::~Pool() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->release_free_segments();
  // Blocks of segments still in use are leaked with their segments.
}

Allocator& Pool::underlying() const { return state_->underlying; }

void* Pool::allocate(size_t bytes) {
  State& s = *state_;
  const size_t size = round_up(std::max<size_t>(bytes, 1), kRound);
  const bool small = size <= kSmallRequest;
  std::lock_guard<std::mutex> lock(s.mutex);
  Block* b = s.take_best_fit(size, small);
  if (!b) {
    size_t segment = small ? kSmallSegment : round_up(size, kLargeSegmentRound);
    b = s.new_segment(segment, small);
    if (!b) {
      s.stats.alloc_retries++;
      s.release_free_segments();
      b = s.new_segment(segment, small);
    }
    if (!b) {
      s.stats.ooms++;
      s.throw_oom(bytes, segment);
    }
  }
  s.maybe_split(b, size);
  b->allocated = true;
  b->requested = bytes;
  s.live.emplace(b->ptr, b);
  add(s.stats.requested, static_cast<int64_t>(bytes));
  add(s.stats.allocated, static_cast<int64_t>(size));
  add(s.stats.active, static_cast<int64_t>(b->size));
  add(s.stats.allocations, 1);
  return b->ptr;
}

void Pool::release(void* p) {
  if (!p) return;
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.live.find(p);
  if (it == s.live.end()) {
    // Called from Storage destructors: no exception can leave, and going on would corrupt the pool.
    std::fprintf(stderr, "kiln: memory pool: release of %p, which this pool did not allocate\n", p);
    std::abort();
  }
  Block* b = it->second;
  s.live.erase(it);
  if (flags().debug_memory) s.underlying.fill(b->ptr, 0xFF, b->size);  // NaN as float, bf16 and fp16
  sub(s.stats.requested, static_cast<int64_t>(b->requested));
  sub(s.stats.allocated, static_cast<int64_t>(round_up(std::max<size_t>(b->requested, 1), kRound)));
  sub(s.stats.active, static_cast<int64_t>(b->size));
  sub(s.stats.allocations, 1);
  b->allocated = false;
  b->requested = 0;
  b = s.coalesce(b);
  s.free_set(b->small).insert(b);
}

void Pool::empty_cache() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->release_free_segments();
}

PoolStats Pool::stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  PoolStats out = state_->stats;
  out.largest_free_block = state_->largest_free_block();
  return out;
}

void Pool::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  PoolStats& s = state_->stats;
  for (Stat* stat : {&s.requested, &s.allocated, &s.active, &s.reserved, &s.segments, &s.allocations})
    reset_peak(*stat);
}

std::string Pool::summary() const {
  PoolStats s = stats();
  std::string out = fmt::format("{:<30} {:>11} {:>11} {:>11}\n", fmt::format("memory pool ({})", underlying().name()),
                                "current", "peak", "total");
  auto bytes_row = [&](const char* name, const Stat& st) {
    out += fmt::format("  {:<28} {:>11} {:>11} {:>11}\n", name, format_bytes(st.current), format_bytes(st.peak),
                       format_bytes(st.total));
  };
  auto count_row = [&](const char* name, const Stat& st) {
    out += fmt::format("  {:<28} {:>11} {:>11} {:>11}\n", name, st.current, st.peak, st.total);
  };
  bytes_row("requested", s.requested);
  bytes_row("allocated (512 B rounded)", s.allocated);
  bytes_row("active (whole blocks)", s.active);
  bytes_row("reserved (segments)", s.reserved);
  count_row("segments", s.segments);
  count_row("allocations", s.allocations);
  out += fmt::format("  largest free block {}, fragmentation {:.1f}%, alloc retries {}, OOMs {}\n",
                     format_bytes(s.largest_free_block), 100.0 * s.fragmentation(), s.alloc_retries, s.ooms);
  return out;
}

namespace {

struct Registry {
  std::mutex mutex;
  std::vector<std::pair<Device, Pool*>> pools;
};

Registry& registry() {
  static auto* r = new Registry;  // never destroyed: storages may be freed during exit
  return *r;
}

Pool& find_or_create_pool(Device device) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto& [d, pool] : r.pools)
    if (d == device) return *pool;
  Pool* pool = new Pool(device_allocator(device));
  r.pools.emplace_back(device, pool);
  return *pool;
}

std::vector<std::pair<Device, Pool*>> all_pools() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.pools;
}

}  // namespace

Pool& device_pool(Device device) {
  if (device.is_cpu()) {
    static Pool& host = find_or_create_pool(Device::cpu());
    return host;
  }
  return find_or_create_pool(device);
}

PoolStats pool_stats(Device device) { return device_pool(device).stats(); }

void reset_peak_stats() {
  for (auto& [device, pool] : all_pools()) pool->reset_peak_stats();
  reset_peak_allocated_bytes();
}

std::string memory_summary() {
  device_pool(Device::cpu());  // the host pool is always listed
  std::string out;
  for (auto& [device, pool] : all_pools()) out += fmt::format("[{}] {}", device.str(), pool->summary());
  out += fmt::format("tensor storage: {} allocated, {} peak; memory limit: {}\n", format_bytes(allocated_bytes()),
                     format_bytes(peak_allocated_bytes()),
                     flags().memory_limit.empty() ? std::string("none") : format_bytes(memory_limit_bytes()));
  return out;
}

}  // namespace kiln::memory

namespace kiln {

void empty_cache() {
  for (auto& [device, pool] : memory::all_pools()) pool->empty_cache();
}

}  // namespace kiln
