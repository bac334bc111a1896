// What the library matmul tests (oneDNN on the CPU, cuBLASLt on a GPU) share: the operand layouts
// kiln's views produce, where each puts a matrix's elements, and one case of a check.
#pragma once
#include <cstdint>
#include <sstream>
#include <string>

#include "core/dtype.h"

namespace kiln::test {

// How one (rows, cols) matrix of an operand sits in memory.
enum class Layout {
  RowMajor,    // strides {., cols, 1}
  Transposed,  // strides {., 1, rows}
  Padded,      // row stride cols + 3: a slice of a wider matrix
  Strided,     // every other column: no unit stride (oneDNN's fast kernels refuse it; copied before cuBLASLt)
  Reversed,    // column stride -1: a flipped view
  Repeated,    // row stride 0: one row expanded to every row
};

inline const char* layout_name(Layout l) {
  switch (l) {
    case Layout::RowMajor: return "row-major";
    case Layout::Transposed: return "transposed";
    case Layout::Padded: return "padded";
    case Layout::Strided: return "strided";
    case Layout::Reversed: return "reversed";
    case Layout::Repeated: return "repeated";
  }
  return "?";
}

// Element strides {batch, row, col} of a (batch, rows, cols) operand, the offset of (0, 0, 0),
// and how many elements must be stored. A broadcast operand stores one matrix (batch stride 0).
struct OperandShape {
  int64_t strides[3] = {0, 0, 0};
  int64_t base = 0;
  int64_t stored = 0;
};

inline OperandShape operand_shape(int64_t batch, int64_t rows, int64_t cols, Layout layout, bool broadcast) {
  OperandShape s;
  int64_t span = rows * cols;  // elements one matrix occupies
  switch (layout) {
    case Layout::RowMajor: s.strides[1] = cols, s.strides[2] = 1; break;
    case Layout::Transposed: s.strides[1] = 1, s.strides[2] = rows; break;
    case Layout::Padded: s.strides[1] = cols + 3, s.strides[2] = 1, span = rows * (cols + 3); break;
    case Layout::Strided: s.strides[1] = 2 * cols + 1, s.strides[2] = 2, span = rows * (2 * cols + 1); break;
    case Layout::Reversed: s.strides[1] = cols, s.strides[2] = -1, s.base = cols - 1; break;
    case Layout::Repeated: s.strides[1] = 0, s.strides[2] = 1, span = cols; break;
  }
  s.strides[0] = broadcast ? 0 : span;
  s.stored = (broadcast ? 1 : batch) * span;
  return s;
}

// One matmul C (batch, M, N) = A (batch, M, K) @ B (batch, K, N). Shifts put each pointer that many
// elements past its allocation's start (less aligned than the allocator's).
struct MatmulCase {
  DType dtype = DType::Float32;
  int64_t batch = 1, M = 1, K = 1, N = 1;
  Layout a_layout = Layout::RowMajor, b_layout = Layout::RowMajor;
  bool a_broadcast = false, b_broadcast = false;
  int64_t a_shift = 0, b_shift = 0, c_shift = 0;
};

inline std::string describe(const MatmulCase& cs) {
  std::ostringstream s;
  s << dtype_name(cs.dtype) << " batch " << cs.batch << " M " << cs.M << " K " << cs.K << " N " << cs.N << " A "
    << layout_name(cs.a_layout) << (cs.a_broadcast ? " (broadcast)" : "") << " B " << layout_name(cs.b_layout)
    << (cs.b_broadcast ? " (broadcast)" : "");
  if (cs.a_shift || cs.b_shift || cs.c_shift) s << " shifts " << cs.a_shift << ", " << cs.b_shift << ", " << cs.c_shift;
  return s.str();
}

}  // namespace kiln::test
