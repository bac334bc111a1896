// core/shape.h: Shape keeps up to kInline extents in itself and more on the heap, with
// std::vector<int64_t>'s behaviour either way. Every operation is checked against a
// std::vector doing the same, across the inline/heap boundary; ASan checks the storage.
#include <catch2/catch.hpp>

#include <random>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/shape.h"

using kiln::Shape;
using Model = std::vector<int64_t>;

namespace {

void check_same(const Shape& s, const Model& m) {
  REQUIRE(s.size() == m.size());
  CHECK(s.empty() == m.empty());
  CHECK(Model(s) == m);
  CHECK(Model(s.rbegin(), s.rend()) == Model(m.rbegin(), m.rend()));
  CHECK(s.capacity() >= s.size());
}

}  // namespace

TEST_CASE("Shape behaves as std::vector<int64_t> on both sides of its inline capacity", "[core][shape]") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    Shape s;
    Model m;
    for (int step = 0; step < 40; ++step) {
      const int64_t v = static_cast<int64_t>(rng() % 1000) - 500;
      const size_t at = m.empty() ? 0 : rng() % (m.size() + 1);
      switch (rng() % 9) {
        case 0: case 1: s.push_back(v); m.push_back(v); break;
        case 2: if (!m.empty()) { s.pop_back(); m.pop_back(); } break;
        case 3: s.insert(s.begin() + at, v); m.insert(m.begin() + at, v); break;
        case 4: if (at < m.size()) { s.erase(s.begin() + at); m.erase(m.begin() + at); } break;
        case 5: { const size_t n = rng() % 12; s.resize(n, v); m.resize(n, v); break; }
        case 6: {  // a range of itself, inserted into itself (may reallocate under the range)
          const size_t b = m.empty() ? 0 : rng() % m.size(), e = m.empty() ? 0 : b + rng() % (m.size() - b + 1);
          const Model piece(m.begin() + b, m.begin() + e);
          s.insert(s.begin() + at, s.begin() + b, s.begin() + e);
          m.insert(m.begin() + at, piece.begin(), piece.end());
          break;
        }
        case 7: {  // copies and moves keep the values and leave independent storage
          Shape copy = s, moved;
          moved = std::move(copy);
          CHECK(copy.empty());
          Shape constructed(std::move(moved));
          CHECK(moved.empty());
          s = constructed;
          if (!m.empty()) {
            constructed[0] += 1;
            CHECK(s[0] == m[0]);
          }
          break;
        }
        default: s.clear(); m.clear(); break;
      }
      check_same(s, m);
    }
  }
}

TEST_CASE("Shape converts from and to std::vector and compares like one", "[core][shape]") {
  const Model wide = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  Shape from_vector = wide;  // implicit: APIs taking a Shape accept a vector
  CHECK(from_vector.size() == 9);
  CHECK(static_cast<Model>(from_vector) == wide);
  CHECK(from_vector == Shape(wide.begin(), wide.end()));
  CHECK(Shape{2, 3} < Shape{2, 4});
  CHECK(Shape{2} < Shape{2, 0});
  CHECK(Shape{2, 3} != Shape{3, 2});
  CHECK(Shape(3, 7) == Shape{7, 7, 7});
  CHECK(kiln::shape_str(Shape{}) == "[]");
  CHECK(kiln::shape_str(from_vector) == "[1, 2, 3, 4, 5, 6, 7, 8, 9]");
  CHECK(kiln::numel(from_vector) == 362880);
  CHECK_THROWS_AS(from_vector.at(9), kiln::Error);
  Shape self = {4, 5};
  self = self;  // NOLINT: self-assignment keeps the values
  CHECK(self == Shape{4, 5});
  Shape big = wide, small = {1};
  std::swap(big, small);  // through the moves, heap and inline storage trade places
  CHECK(small == Shape(wide.begin(), wide.end()));
  CHECK(big == Shape{1});
}
