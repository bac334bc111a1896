// Pool tests: random alloc/free against a model, best fit / split / coalesce by hand, retry and
// OOM (own allocator and KILN_MEMORY_LIMIT), the MemoryPool::None path, debug fill, threads, and
// memory reuse across two realizes of one graph.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "memory/allocator.h"
#include "memory/pool.h"

using namespace kiln;
using memory::Pool;
using memory::PoolStats;

namespace {

constexpr size_t KiB = 1024, MiB = 1024 * 1024;

// Host memory with its own cap, counting what is out; refuses (nullptr) past the cap.
struct CappedAllocator : memory::Allocator {
  size_t cap;
  size_t in_use = 0;
  int64_t refusals = 0;
  explicit CappedAllocator(size_t c = SIZE_MAX) : cap(c) {}
  void* allocate(size_t bytes) override {
    if (in_use + bytes > cap) {
      ++refusals;
      return nullptr;
    }
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (p) in_use += bytes;
    return p;
  }
  void release(void* p, size_t bytes) override {
    in_use -= bytes;
    std::free(p);
  }
  const char* name() const override { return "capped test"; }
};

// A pattern derived from the block id over the whole block: 8-byte words, then a byte tail.
uint64_t word_of(uint64_t id, size_t i) { return (id + 1) * 0x9E3779B97F4A7C15ull ^ (i * 0xBF58476D1CE4E5B9ull); }
void fill(void* p, size_t bytes, uint64_t id) {
  auto* w = static_cast<uint64_t*>(p);
  size_t words = bytes / 8;
  for (size_t i = 0; i < words; ++i) w[i] = word_of(id, i);
  auto* b = static_cast<unsigned char*>(p);
  for (size_t i = words * 8; i < bytes; ++i) b[i] = static_cast<unsigned char>(id + i);
}
bool intact(const void* p, size_t bytes, uint64_t id) {
  const auto* w = static_cast<const uint64_t*>(p);
  size_t words = bytes / 8;
  uint64_t diff = 0;
  for (size_t i = 0; i < words; ++i) diff |= w[i] ^ word_of(id, i);
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = words * 8; i < bytes; ++i) diff |= b[i] ^ static_cast<unsigned char>(id + i);
  return diff == 0;
}

size_t rounded(size_t bytes) { return (std::max<size_t>(bytes, 1) + 511) / 512 * 512; }

std::vector<float> ramp(int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = 0.01f * static_cast<float>((i * 37) % 101) - 0.5f;
  return v;
}

}  // namespace

TEST_CASE("pool: random alloc/free sequences agree with a simple model", "[pool][memory]") {
  CappedAllocator under;
  Pool pool(under);
  std::mt19937_64 rng(20240611);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const double log_max = std::log(64.0 * MiB);
  struct Live {
    uint64_t id;
    size_t bytes;
  };
  std::map<uintptr_t, Live> live;  // address -> block
  int64_t requested = 0, allocated = 0, total_requested = 0, max_requested = 0, allocations = 0;
  uint64_t next_id = 0;
  const int64_t live_cap = 384 * MiB;

  auto check_stats = [&] {
    PoolStats s = pool.stats();
    REQUIRE(s.requested.current == requested);
    REQUIRE(s.allocated.current == allocated);
    REQUIRE(s.allocations.current == static_cast<int64_t>(live.size()));
    REQUIRE(s.active.current >= s.allocated.current);
    REQUIRE(s.reserved.current >= s.active.current);
    REQUIRE(s.reserved.current == static_cast<int64_t>(under.in_use));
    REQUIRE(s.largest_free_block <= s.reserved.current - s.active.current);
    REQUIRE(s.requested.peak >= max_requested);
  };
  auto free_block = [&](std::map<uintptr_t, Live>::iterator it) {
    REQUIRE(intact(reinterpret_cast<void*>(it->first), it->second.bytes, it->second.id));
    pool.release(reinterpret_cast<void*>(it->first));
    requested -= static_cast<int64_t>(it->second.bytes);
    allocated -= static_cast<int64_t>(rounded(it->second.bytes));
    live.erase(it);
  };

  for (int op = 0; op < 3000; ++op) {
    size_t bytes = std::clamp<size_t>(static_cast<size_t>(std::exp(unit(rng) * log_max)), 1, 64 * MiB);
    bool alloc = live.empty() || (rng() % 100 < 55 && requested + static_cast<int64_t>(bytes) <= live_cap);
    if (alloc) {
      auto* p = static_cast<char*>(pool.allocate(bytes));
      auto a = reinterpret_cast<uintptr_t>(p);
      REQUIRE(p != nullptr);
      REQUIRE(a % 64 == 0);  // segments are 64-byte aligned, blocks 512-byte multiples into them
      // No live block overlaps [a, a + bytes).
      auto after = live.lower_bound(a);
      if (after != live.end()) REQUIRE(after->first >= a + bytes);
      if (after != live.begin()) {
        auto before = std::prev(after);
        REQUIRE(before->first + before->second.bytes <= a);
      }
      uint64_t id = next_id++;
      fill(p, bytes, id);
      live.emplace(a, Live{id, bytes});
      requested += static_cast<int64_t>(bytes);
      allocated += static_cast<int64_t>(rounded(bytes));
      total_requested += static_cast<int64_t>(bytes);
      max_requested = std::max(max_requested, requested);
      ++allocations;
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      free_block(it);
    }
    check_stats();
  }
  while (!live.empty()) free_block(live.begin());
  check_stats();

  PoolStats s = pool.stats();
  CHECK(s.requested.current == 0);
  CHECK(s.allocated.current == 0);
  CHECK(s.active.current == 0);
  CHECK(s.allocations.current == 0);
  CHECK(s.requested.total == total_requested);
  CHECK(s.allocations.total == allocations);
  CHECK(s.reserved.current > 0);
  CHECK(s.segments.total < allocations / 4);  // most requests were served from the cache
  // Every segment coalesced back into one free block: the largest is a whole segment.
  CHECK(s.largest_free_block > 0);
  CHECK(s.fragmentation() == 1.0);
  pool.empty_cache();
  s = pool.stats();
  CHECK(s.reserved.current == 0);
  CHECK(s.segments.current == 0);
  CHECK(s.largest_free_block == 0);
  CHECK(under.in_use == 0);
}

TEST_CASE("pool: best fit, splitting and coalescing in the small pool", "[pool][memory]") {
  CappedAllocator under;
  Pool pool(under);
  char* a = static_cast<char*>(pool.allocate(1000));  // rounds to 1024
  char* b = static_cast<char*>(pool.allocate(512));
  char* c = static_cast<char*>(pool.allocate(4096));
  // Carved one after another from a single 2 MiB segment.
  CHECK(b == a + 1024);
  CHECK(c == b + 512);
  PoolStats s = pool.stats();
  CHECK(s.segments.current == 1);
  CHECK(s.reserved.current == 2 * MiB);
  CHECK(s.requested.current == 1000 + 512 + 4096);
  CHECK(s.allocated.current == 1024 + 512 + 4096);
  CHECK(s.largest_free_block == static_cast<int64_t>(2 * MiB - 1024 - 512 - 4096));

  // Best fit: the 512 B hole left by b, not the big tail after c.
  pool.release(b);
  char* b2 = static_cast<char*>(pool.allocate(300));
  CHECK(b2 == b);
  // A 1536 B request fits neither hole until a and b2 coalesce into one.
  pool.release(a);
  char* d = static_cast<char*>(pool.allocate(1536));
  CHECK(d == c + 4096);  // from the tail: the 1024 B hole is too small
  pool.release(b2);      // merges with the free 1024 B before it
  char* e = static_cast<char*>(pool.allocate(1536));
  CHECK(e == a);
  // Freeing everything merges the segment back into one block, which empty_cache returns.
  for (void* p : {c, d, e}) pool.release(p);
  s = pool.stats();
  CHECK(s.largest_free_block == static_cast<int64_t>(2 * MiB));
  CHECK(s.allocated.current == 0);
  CHECK(s.allocations.total == 6);
  CHECK(s.segments.total == 1);
  pool.empty_cache();
  CHECK(pool.stats().reserved.current == 0);
  CHECK(under.in_use == 0);
}

TEST_CASE("pool: large segments, best fit and the 1 MiB split rule", "[pool][memory]") {
  CappedAllocator under;
  Pool pool(under);
  // 3.5 MiB: a 4 MiB segment; the 0.5 MiB rest is too small to split off and stays attached.
  void* p = pool.allocate(3 * MiB + 512 * KiB);
  PoolStats s = pool.stats();
  CHECK(s.reserved.current == 4 * MiB);
  CHECK(s.allocated.current == static_cast<int64_t>(3 * MiB + 512 * KiB));
  CHECK(s.active.current == static_cast<int64_t>(4 * MiB));
  CHECK(s.largest_free_block == 0);
  CHECK(s.fragmentation() == Approx(0.125));
  pool.release(p);
  // 5 MiB: a 6 MiB segment; the 1 MiB rest is split off.
  void* q = pool.allocate(5 * MiB);
  s = pool.stats();
  CHECK(s.reserved.current == 10 * MiB);
  CHECK(s.active.current == static_cast<int64_t>(5 * MiB));
  CHECK(s.largest_free_block == static_cast<int64_t>(4 * MiB));
  pool.release(q);

  // Best fit among free segments of 8 and 16 MiB: a 7 MiB request takes the 8 MiB one.
  void* eight = pool.allocate(8 * MiB);
  void* sixteen = pool.allocate(16 * MiB);
  pool.release(eight);
  pool.release(sixteen);
  int64_t segments = pool.stats().segments.total;
  void* seven = pool.allocate(7 * MiB);
  CHECK(seven == eight);
  CHECK(pool.stats().segments.total == segments);  // no new segment
  CHECK(pool.stats().active.current == static_cast<int64_t>(7 * MiB));  // 1 MiB rest split off
  // Small requests never come from large segments, and the reverse.
  void* tiny = pool.allocate(100);
  CHECK(pool.stats().segments.total == segments + 1);
  pool.release(tiny);
  pool.release(seven);
  pool.empty_cache();
  CHECK(pool.stats().reserved.current == 0);
  CHECK(under.in_use == 0);
}

TEST_CASE("pool: a refused allocation empties the cache, retries once, then throws a report", "[pool][memory]") {
  CappedAllocator under(64 * MiB);
  Pool pool(under);
  void* a = pool.allocate(40 * MiB);
  pool.release(a);  // cached: 40 MiB reserved
  CHECK(pool.stats().reserved.current == static_cast<int64_t>(40 * MiB));
  void* b = pool.allocate(48 * MiB);  // 40 + 48 > 64: empty the cache, retry, succeed
  PoolStats s = pool.stats();
  CHECK(s.alloc_retries == 1);
  CHECK(s.ooms == 0);
  CHECK(s.reserved.current == static_cast<int64_t>(48 * MiB));
  REQUIRE_THROWS_AS(pool.allocate(30 * MiB), Error);
  s = pool.stats();
  CHECK(s.alloc_retries == 2);
  CHECK(s.ooms == 1);
  CHECK(s.allocated.current == static_cast<int64_t>(48 * MiB));  // the failure changed nothing
  // Still usable: small requests fit beside b, and after freeing b a big one fits too.
  void* c = pool.allocate(1 * MiB);
  pool.release(c);
  pool.release(b);
  void* d = pool.allocate(60 * MiB);
  CHECK(pool.stats().ooms == 1);
  pool.release(d);
  pool.empty_cache();
  CHECK(under.in_use == 0);
}

TEST_CASE("pool: KILN_MEMORY_LIMIT makes the pool throw kiln::Error with the memory report", "[pool][memory]") {
  FlagsGuard guard;
  flags().memory_pool = MemoryPool::Pool;
  kiln::empty_cache();
  flags().memory_limit = "64MiB";
  PoolStats before = memory::pool_stats();
  {
    auto kept = memory::allocate_storage(8 * MiB, Device::cpu());
    REQUIRE_THROWS_WITH(memory::allocate_storage(100 * MiB, Device::cpu()),
                        Catch::Contains("out of memory") && Catch::Contains("100.0 MiB") &&
                            Catch::Contains("allocated") && Catch::Contains("reserved") &&
                            Catch::Contains("largest free block") && Catch::Contains("KILN_MEMORY_LIMIT=64MiB") &&
                            Catch::Contains("KILN_MEMORY_BUDGET") && Catch::Contains("checkpoint") &&
                            Catch::Contains("smaller batch") && Catch::Contains("kiln::empty_cache()"));
    REQUIRE_THROWS_AS(memory::allocate_storage(100 * MiB, Device::cpu()), Error);
    PoolStats after = memory::pool_stats();
    CHECK(after.ooms == before.ooms + 2);
    CHECK(after.alloc_retries == before.alloc_retries + 2);
    // Still usable under the limit.
    auto more = memory::allocate_storage(16 * MiB, Device::cpu());
    std::memset(more->data, 1, 16 * MiB);
    CHECK(memory::pool_stats().ooms == after.ooms);
  }
  // The plain path honours the limit too.
  flags().memory_pool = MemoryPool::None;
  REQUIRE_THROWS_WITH(memory::allocate_storage(100 * MiB, Device::cpu()),
                      Catch::Contains("out of memory") && Catch::Contains("KILN_MEMORY_LIMIT=64MiB"));
  kiln::empty_cache();
}

TEST_CASE("pool: MemoryPool::None allocates and frees directly", "[pool][memory]") {
  FlagsGuard guard;
  flags().memory_pool = MemoryPool::None;
  PoolStats before = memory::pool_stats();
  int64_t host_before = memory::host_allocator().bytes_in_use();
  int64_t tensors_before = memory::allocated_bytes();
  {
    auto s = memory::allocate_storage(3 * MiB + 5, Device::cpu());
    REQUIRE(s->data != nullptr);
    CHECK(reinterpret_cast<uintptr_t>(s->data) % 64 == 0);
    std::memset(s->data, 7, 3 * MiB + 5);
    CHECK(memory::host_allocator().bytes_in_use() == host_before + static_cast<int64_t>(3 * MiB + 64));
    CHECK(memory::allocated_bytes() == tensors_before + static_cast<int64_t>(3 * MiB + 5));
    PoolStats during = memory::pool_stats();
    CHECK(during.reserved.current == before.reserved.current);
    CHECK(during.allocations.total == before.allocations.total);
  }
  CHECK(memory::host_allocator().bytes_in_use() == host_before);
  CHECK(memory::allocated_bytes() == tensors_before);

  // A Storage goes back to the allocator that made it, whatever the flag says by then.
  flags().memory_pool = MemoryPool::Pool;
  auto pooled = memory::allocate_storage(1000, Device::cpu());
  flags().memory_pool = MemoryPool::None;
  auto direct = memory::allocate_storage(1000, Device::cpu());
  int64_t live = memory::pool_stats().allocations.current;
  flags().memory_pool = MemoryPool::Pool;
  direct.reset();
  CHECK(memory::pool_stats().allocations.current == live);
  CHECK(memory::host_allocator().bytes_in_use() <= host_before + static_cast<int64_t>(2 * MiB));
  flags().memory_pool = MemoryPool::None;
  pooled.reset();
  CHECK(memory::pool_stats().allocations.current == live - 1);
  CHECK(memory::allocated_bytes() == tensors_before);
}

TEST_CASE("pool: debug_memory fills freed blocks with NaN bytes", "[pool][memory]") {
  FlagsGuard guard;
  CappedAllocator under;
  Pool pool(under);
  auto* p = static_cast<float*>(pool.allocate(4096));
  void* keep = pool.allocate(512);  // keeps the segment in use while p is free
  for (int i = 0; i < 1024; ++i) p[i] = 1.0f;
  flags().debug_memory = true;
  pool.release(p);
  // The block stays in the pool's segment, so reading it is safe here (not for users).
  const auto* bytes = reinterpret_cast<const unsigned char*>(p);
  CHECK(std::all_of(bytes, bytes + 4096, [](unsigned char b) { return b == 0xFF; }));
  CHECK(std::isnan(p[0]));
  CHECK(std::isnan(p[1023]));
  pool.release(keep);
}

TEST_CASE("pool: concurrent alloc/free from several threads balances", "[pool][memory]") {
  CappedAllocator under;
  {
    Pool pool(under);
    // CappedAllocator is not thread-safe itself, but the pool only calls it under its mutex.
    // Catch2 assertions are not thread-safe: workers report through atomics.
    std::atomic<int64_t> allocations{0}, corrupted{0};
    auto worker = [&](int t) {
      std::mt19937 rng(t);
      std::vector<std::pair<void*, size_t>> mine;
      for (int op = 0; op < 4000; ++op) {
        if (mine.empty() || rng() % 2) {
          size_t bytes = 1 + rng() % (256 * KiB);
          void* p = pool.allocate(bytes);
          std::memset(p, t, bytes);
          mine.emplace_back(p, bytes);
          ++allocations;
        } else {
          size_t i = rng() % mine.size();
          auto [p, bytes] = mine[i];
          const auto* c = static_cast<const unsigned char*>(p);
          if (c[0] != t || c[bytes / 2] != t || c[bytes - 1] != t) ++corrupted;
          pool.release(p);
          mine[i] = mine.back();
          mine.pop_back();
        }
      }
      for (auto [p, bytes] : mine) pool.release(p);
    };
    std::vector<std::thread> team;
    for (int t = 0; t < 4; ++t) team.emplace_back(worker, t + 1);
    for (auto& th : team) th.join();
    CHECK(corrupted == 0);
    PoolStats s = pool.stats();
    CHECK(s.allocated.current == 0);
    CHECK(s.requested.current == 0);
    CHECK(s.active.current == 0);
    CHECK(s.allocations.total == allocations);
    pool.empty_cache();
    CHECK(pool.stats().reserved.current == 0);
  }
  CHECK(under.in_use == 0);
}

TEST_CASE("pool: stats peaks reset and the summary reads", "[pool][memory]") {
  CappedAllocator under;
  Pool pool(under);
  void* a = pool.allocate(3 * MiB);
  pool.release(a);
  PoolStats s = pool.stats();
  CHECK(s.allocated.peak == static_cast<int64_t>(3 * MiB));
  CHECK(s.allocated.total == static_cast<int64_t>(3 * MiB));
  pool.reset_peak_stats();
  s = pool.stats();
  CHECK(s.allocated.peak == 0);
  CHECK(s.reserved.peak == static_cast<int64_t>(4 * MiB));  // still reserved
  CHECK(s.allocated.total == static_cast<int64_t>(3 * MiB));
  std::string table = pool.summary();
  CHECK_THAT(table, Catch::Contains("reserved") && Catch::Contains("4.0 MiB") && Catch::Contains("fragmentation"));
  CHECK_THAT(memory::memory_summary(), Catch::Contains("[cpu]") && Catch::Contains("tensor storage"));
  CHECK(memory::format_bytes(512) == "512 B");
  CHECK(memory::format_bytes(1536) == "1.5 KiB");
  CHECK(memory::format_bytes(3 * 1024ll * MiB) == "3.0 GiB");
}

TEST_CASE("pool: realizing the same graph twice reuses pooled memory", "[pool][memory][jit]") {
  FlagsGuard guard;
  auto run = [] {
    Tensor x = from_vector<float>(ramp(1 << 20), {1024, 1024});  // 4 MiB, large pool
    Tensor y = exp(x * 2.0 + 1.0) * 0.5;
    Tensor z = sum(y * y, {1}) + y.sum();  // several kernels, intermediates freed in between
    z.realize();
    return z.to_vector<float>();
  };
  flags().memory_pool = MemoryPool::None;
  std::vector<float> reference = run();

  flags().memory_pool = MemoryPool::Pool;
  std::vector<float> first = run();
  PoolStats after_first = memory::pool_stats();
  std::vector<float> second = run();
  PoolStats after_second = memory::pool_stats();
  CHECK(first == reference);
  CHECK(second == reference);
  CHECK(after_second.reserved.current == after_first.reserved.current);
  CHECK(after_second.segments.total == after_first.segments.total);  // every block came from the cache
  CHECK(after_second.allocations.total > after_first.allocations.total);
  CHECK(after_second.allocations.current == after_first.allocations.current);

  // With freed blocks filled with NaN, results do not change: nothing reads freed memory.
  flags().debug_memory = true;
  CHECK(run() == reference);
}
