#include "core/shape.h"

#include <cstdio>
#include <cstdlib>

#include "core/error.h"

namespace kiln {

int64_t& Shape::at(size_t i) {
  KILN_CHECK(i < size_, "shape", "index {} is out of range for {} (rank {})", i, shape_str(*this), size_);
  return data_[i];
}
const int64_t& Shape::at(size_t i) const { return const_cast<Shape*>(this)->at(i); }

void Shape::index_fault(size_t i) const {
  std::fprintf(stderr, "kiln: Shape index %zu out of range for rank %u\n", i, size_);
  std::abort();
}

void Shape::grow(size_t n) {
  KILN_CHECK(n <= UINT32_MAX, "shape", "{} extents are more than a shape holds", n);
  n = std::max<size_t>(n, kInline);
  auto* bigger = new int64_t[n];
  std::copy(begin(), end(), bigger);
  if (on_heap()) delete[] data_;
  data_ = bigger;
  capacity_ = static_cast<uint32_t>(n);
}

void Shape::open_gap(size_t at, size_t n) {
  reserve(size_ + n);
  std::copy_backward(data_ + at, data_ + size_, data_ + size_ + n);
  size_ += static_cast<uint32_t>(n);
}

Shape::iterator Shape::insert(const_iterator pos, size_t n, int64_t v) {
  const size_t at = static_cast<size_t>(pos - begin());
  open_gap(at, n);
  std::fill(data_ + at, data_ + at + n, v);
  return data_ + at;
}

Shape::iterator Shape::erase(const_iterator first, const_iterator last) {
  const size_t at = static_cast<size_t>(first - begin()), n = static_cast<size_t>(last - first);
  std::copy(data_ + at + n, data_ + size_, data_ + at);
  size_ -= static_cast<uint32_t>(n);
  return data_ + at;
}

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s)
    KILN_CHECK(!__builtin_mul_overflow(n, d, &n), "shape", "{} has more elements than an int64 holds", shape_str(s));
  return n;
}

std::vector<int64_t> contiguous_strides(const Shape& s) {
  std::vector<int64_t> st(s.size());
  int64_t acc = 1;
  for (size_t i = s.size(); i-- > 0;) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  size_t r = std::max(a.size(), b.size());
  Shape out(r);
  for (size_t i = 0; i < r; ++i) {
    int64_t da = i < r - a.size() ? 1 : a[i - (r - a.size())];
    int64_t db = i < r - b.size() ? 1 : b[i - (r - b.size())];
    KILN_CHECK(da == db || da == 1 || db == 1, op,
               "shapes {} and {} cannot be broadcast together (dimension {}: {} vs {}); "
               "make the sizes equal or 1, e.g. with reshape or unsqueeze",
               shape_str(a), shape_str(b), i, da, db);
    out[i] = da == 1 ? db : da;
  }
  return out;
}

int normalize_axis(int64_t axis, size_t rank, const char* op) {
  int64_t r = static_cast<int64_t>(rank);
  // Callers index the shape with the result, so a 0-d tensor has no valid axis (reductions of
  // 0-d tensors handle their axes themselves).
  KILN_CHECK(r > 0, op, "axis {} is out of range for a 0-d tensor, which has no axes; reshape it to [1] first", axis);
  KILN_CHECK(axis >= -r && axis < r, op, "axis {} is out of range for a tensor of rank {} (valid: {}..{})", axis,
             rank, -r, r - 1);
  return static_cast<int>(axis < 0 ? axis + r : axis);
}

}  // namespace kiln
