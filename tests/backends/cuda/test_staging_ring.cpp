// The staging ring never hands out bytes that a copy still in flight uses: random copies of
// random sizes, finishing in order at random times, against a model of the bytes in use.
#include <catch2/catch.hpp>

#include <random>
#include <vector>

#include "core/error.h"
#include "backends/cuda/staging_ring.h"

using kiln::cuda::StagingRing;

namespace {

void* token(size_t i) { return reinterpret_cast<void*>(i + 1); }
size_t index_of(void* t) { return reinterpret_cast<size_t>(t) - 1; }

}  // namespace

TEST_CASE("the staging ring reuses a region only after its copy was waited for", "[memory][staging]") {
  constexpr size_t kCapacity = 1000;
  StagingRing ring(kCapacity);
  std::mt19937 rng(7);
  struct Copy {
    size_t begin, end;
    bool finished = false;
  };
  std::vector<Copy> copies;
  std::vector<int> owner(kCapacity, -1);  // the unfinished copy using each byte
  size_t finished = 0, waits = 0, wraps = 0, last = 0;
  auto finish = [&](void* t) {
    Copy& c = copies[index_of(t)];
    REQUIRE(!c.finished);
    REQUIRE(index_of(t) == finished);  // oldest first
    c.finished = true;
    finished++;
    for (size_t b = c.begin; b < c.end; ++b) owner[b] = -1;
  };
  for (int step = 0; step < 20000; ++step) {
    // The device finishes some copies on its own; the host notices some of them.
    if (rng() % 3 == 0) ring.reclaim([&](void* t) { return rng() % 2 == 0 ? (finish(t), true) : false; });
    const size_t bytes = rng() % 10 == 0 ? kCapacity - rng() % 50 : 1 + rng() % 300;
    const size_t at = ring.reserve(bytes, [&](void* t) { waits++, finish(t); });
    REQUIRE(at + bytes <= kCapacity);
    wraps += at < last;
    for (size_t b = at; b < at + bytes; ++b) {
      if (owner[b] != -1) FAIL("step " << step << ": [" << at << ", " << at + bytes << ") overlaps copy " << owner[b] << " in flight");
      owner[b] = static_cast<int>(copies.size());
    }
    copies.push_back({at, at + bytes});
    ring.commit(at, bytes, token(copies.size() - 1));
    last = at;
  }
  CHECK(waits > 1000);
  CHECK(wraps > 1000);
  CHECK(ring.regions_in_use() == copies.size() - finished);
}

TEST_CASE("a staging request larger than the ring is an error", "[memory][staging][errors]") {
  StagingRing ring(64);
  CHECK_THROWS_AS(ring.reserve(65, [](void*) {}), kiln::Error);
  CHECK_THROWS_AS(ring.reserve(0, [](void*) {}), kiln::Error);
  CHECK(ring.reserve(64, [](void*) {}) == 0);
}
