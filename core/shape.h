// Shapes: a vector of extents, with broadcasting, strides and axis normalization.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

using Shape = std::vector<int64_t>;

int64_t numel(const Shape& s);
std::vector<int64_t> contiguous_strides(const Shape& s);  // row-major, in elements
std::string shape_str(const Shape& s);                      // "[2, 3]"
// NumPy broadcasting; throws kiln::Error naming `op` and both shapes when incompatible.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
// Maps a possibly negative axis into [0, rank); throws naming `op` when out of range.
int normalize_axis(int64_t axis, size_t rank, const char* op);

}  // namespace kiln
