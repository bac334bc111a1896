// LastingCache makes each value once, even when threads ask for the same key together, keeps
// references valid while it grows, and stores nothing when the factory throws.
#include <catch2/catch.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/lasting_cache.h"

using kiln::LastingCache;

namespace {

struct Pinned {  // neither copyable nor movable, like a library plan holding a mutex
  explicit Pinned(int v) : value(v) {}
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  int value;
  std::mutex mutex;
};

}  // namespace

TEST_CASE("LastingCache makes a value once and keeps references valid", "[core][cache]") {
  LastingCache<int, int> cache;
  int made = 0;
  int& first = cache.get_or_create(1, [&] { return ++made * 10; });
  CHECK(first == 10);
  for (int k = 2; k < 200; ++k) cache.get_or_create(k, [&] { return ++made; });
  CHECK(&cache.get_or_create(1, [&] { return ++made; }) == &first);
  CHECK(first == 10);
  CHECK(made == 199);
}

TEST_CASE("LastingCache takes values a factory returns by unique_ptr", "[core][cache]") {
  LastingCache<int, Pinned> cache;
  Pinned& p = cache.get_or_create(7, [] { return std::make_unique<Pinned>(42); });
  CHECK(p.value == 42);
  CHECK(&cache.get_or_create(7, [] { return std::make_unique<Pinned>(0); }) == &p);
}

TEST_CASE("LastingCache stores nothing when the factory throws", "[core][cache]") {
  LastingCache<int, int> cache;
  CHECK_THROWS_AS(cache.get_or_create(3, []() -> int { throw std::runtime_error("refused"); }), std::runtime_error);
  CHECK(cache.get_or_create(3, [] { return 5; }) == 5);
}

TEST_CASE("LastingCache makes a value once when threads race for it", "[core][cache]") {
  LastingCache<int, int> cache;
  std::atomic<int> made{0};
  std::vector<int*> seen(8);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < seen.size(); ++i)
    threads.emplace_back([&, i] { seen[i] = &cache.get_or_create(0, [&] { return ++made; }); });
  for (std::thread& t : threads) t.join();
  CHECK(made == 1);
  for (int* p : seen) CHECK(p == seen[0]);
}
