// core/block_cache.h: nodes, variables and nodes' inputs live in recycled blocks. A freed block is
// handed out again (most recently freed first), blocks freed by another thread than the one that
// took them are safe, a short array's vector keeps its elements as it grows past the block and
// shrinks back, and graphs built after many others were freed compute what they should.
#include <catch2/catch.hpp>

#include <cmath>
#include <thread>
#include <vector>

#include "core/block_cache.h"
#include "core/node.h"
#include "ops/ops.h"

using kiln::Tensor;

TEST_CASE("a freed block is the next one taken", "[core][block-cache]") {
  if (!kiln::kPoolBlocks) {
    WARN("SKIPPED: a sanitizer build, where blocks come from plain new and delete");
    return;
  }
  // More blocks than glibc's own per-thread cache keeps (7 per size), so only this cache gives
  // them back in exactly the reverse order.
  using Cache = kiln::BlockCache<136>;
  std::vector<void*> blocks;
  for (int i = 0; i < 64; ++i) blocks.push_back(Cache::take());
  for (void* b : blocks) Cache::give(b);
  for (auto b = blocks.rbegin(); b != blocks.rend(); ++b) CHECK(Cache::take() == *b);
  for (void* b : blocks) Cache::give(b);
}

TEST_CASE("short arrays take one recycled block, longer ones the heap", "[core][block-cache]") {
  using Inputs = kiln::NodeInputs;  // std::vector<NodePtr, ShortArrayAllocator<NodePtr>>
  constexpr size_t kShort = kiln::ShortArrayAllocator<kiln::NodePtr>::kShort;
  std::vector<kiln::NodePtr> made;
  for (int i = 0; i < 9; ++i) {
    made.push_back(kiln::new_node());
    made.back()->scalar = i;
  }
  // Growing one element at a time crosses from the block to the heap; every element survives
  // each move, and copies and moves between the two kinds of storage keep them.
  Inputs grown;
  for (size_t i = 0; i < made.size(); ++i) {
    grown.push_back(made[i]);
    for (size_t j = 0; j <= i; ++j) REQUIRE(grown[j] == made[j]);
  }
  CHECK(made[0].use_count() == 2);
  Inputs short_copy(made.begin(), made.begin() + kShort), long_copy = grown;
  CHECK(long_copy.size() == made.size());
  Inputs moved = std::move(short_copy);
  REQUIRE(moved.size() == kShort);
  for (size_t j = 0; j < kShort; ++j) CHECK(moved[j]->scalar == static_cast<double>(j));
  moved = long_copy;  // a short array's block given back for a heap array
  CHECK(moved.size() == made.size());
  long_copy = Inputs{made[3]};  // and the other way
  REQUIRE(long_copy.size() == 1);
  CHECK(long_copy[0] == made[3]);
  grown.clear();
  grown.shrink_to_fit();
  moved = {};
  long_copy = {};
  for (const kiln::NodePtr& n : made) CHECK(n.use_count() == 1);  // every reference released
  if (!kiln::kPoolBlocks) return;
  // The block of a one-input array is the next one a short array takes.
  using Cache = kiln::BlockCache<kShort * sizeof(kiln::NodePtr)>;
  Inputs one{made[0]};
  const void* block = one.data();
  one = {};
  one.shrink_to_fit();
  void* again = Cache::take();
  CHECK(again == block);
  Cache::give(again);
}

TEST_CASE("graph nodes freed by other threads and reused compute the right values", "[core][block-cache]") {
  // Each thread builds graphs on tensors made here and hands them back; this thread frees them,
  // so its cache fills with blocks the workers took, and the graphs built after reuse them.
  Tensor x = kiln::from_vector<float>({1, 2, 3, 4}, {4});
  for (int round = 0; round < 3; ++round) {
    std::vector<std::vector<Tensor>> made(4);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&, t] {
        for (int i = 0; i < 200; ++i) made[static_cast<size_t>(t)].push_back(x * static_cast<double>(t + i) + 1.0);
      });
    for (std::thread& th : threads) th.join();
    for (int t = 0; t < 4; ++t) {
      const std::vector<float> v = made[static_cast<size_t>(t)][7].to_vector<float>();
      CHECK(v == std::vector<float>{1.0f + (t + 7), 1.0f + 2 * (t + 7), 1.0f + 3 * (t + 7), 1.0f + 4 * (t + 7)});
    }
    made.clear();  // thousands of nodes back to this thread's cache
    Tensor y = kiln::tanh(x * 0.5 - 1.0).sum();
    CHECK(y.item() == Approx(std::tanh(-0.5) + std::tanh(0.0) + std::tanh(0.5) + std::tanh(1.0)).epsilon(1e-6));
  }
}
