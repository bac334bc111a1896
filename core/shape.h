// Shapes: a vector of extents, with broadcasting, strides and axis normalization.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#include "core/sanitizers.h"

namespace kiln {

// Under AddressSanitizer (and HWASan), Shape checks its indices: extents live inside the object,
// where an out-of-range read would not reach a redzone as it did past a std::vector's exact-size
// block. -DKILN_SHAPE_CHECKED=1 checks them in any build.
#ifndef KILN_SHAPE_CHECKED
#define KILN_SHAPE_CHECKED KILN_ADDRESS_SANITIZER
#endif

// The extents of a tensor: std::vector<int64_t>'s interface, with up to kInline extents held in
// the object itself. Every op records a few shapes, and with a heap block each they were most of
// a cached step's allocations. Converts from std::vector<int64_t> implicitly, to one explicitly (no
// copy hides in a call).
class Shape {
 public:
  using value_type = int64_t;
  using size_type = size_t;
  using difference_type = std::ptrdiff_t;
  using reference = int64_t&;
  using const_reference = const int64_t&;
  using pointer = int64_t*;
  using const_pointer = const int64_t*;
  using iterator = int64_t*;
  using const_iterator = const int64_t*;
  using reverse_iterator = std::reverse_iterator<iterator>;
  using const_reverse_iterator = std::reverse_iterator<const_iterator>;
  static constexpr size_t kInline = 6;

  Shape() noexcept {}
  Shape(std::initializer_list<int64_t> extents) { assign(extents.begin(), extents.end()); }
  explicit Shape(size_t n, int64_t value = 0) { assign(n, value); }
  template <class It, class = std::enable_if_t<!std::is_integral_v<It>>>
  Shape(It first, It last) {
    assign(first, last);
  }
  Shape(const std::vector<int64_t>& v) { assign(v.begin(), v.end()); }  // NOLINT: implicit by design
  Shape(const Shape& other) { assign(other.begin(), other.end()); }
  Shape(Shape&& other) noexcept { take(other); }
  ~Shape() { release(); }

  Shape& operator=(const Shape& other) {
    if (this != &other) assign(other.begin(), other.end());
    return *this;
  }
  Shape& operator=(Shape&& other) noexcept {
    if (this != &other) {
      release();
      take(other);
    }
    return *this;
  }
  Shape& operator=(std::initializer_list<int64_t> extents) {
    assign(extents.begin(), extents.end());
    return *this;
  }
  explicit operator std::vector<int64_t>() const { return std::vector<int64_t>(begin(), end()); }  // NOLINT

  template <class It, class = std::enable_if_t<!std::is_integral_v<It>>>
  void assign(It first, It last) {
    clear();
    if constexpr (std::is_base_of_v<std::forward_iterator_tag, typename std::iterator_traits<It>::iterator_category>)
      reserve(static_cast<size_t>(std::distance(first, last)));
    for (; first != last; ++first) push_back(static_cast<int64_t>(*first));
  }
  void assign(size_t n, int64_t value) {
    clear();
    resize(n, value);
  }

  size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  size_t capacity() const noexcept { return capacity_; }
  int64_t* data() noexcept { return data_; }
  const int64_t* data() const noexcept { return data_; }

  int64_t& operator[](size_t i) {
    if (KILN_SHAPE_CHECKED && i >= size_) index_fault(i);
    return data_[i];
  }
  const int64_t& operator[](size_t i) const {
    if (KILN_SHAPE_CHECKED && i >= size_) index_fault(i);
    return data_[i];
  }
  int64_t& at(size_t i);
  const int64_t& at(size_t i) const;
  int64_t& front() { return data_[0]; }
  const int64_t& front() const { return data_[0]; }
  int64_t& back() { return data_[size_ - 1]; }
  const int64_t& back() const { return data_[size_ - 1]; }

  iterator begin() noexcept { return data_; }
  iterator end() noexcept { return data_ + size_; }
  const_iterator begin() const noexcept { return data_; }
  const_iterator end() const noexcept { return data_ + size_; }
  const_iterator cbegin() const noexcept { return data_; }
  const_iterator cend() const noexcept { return data_ + size_; }
  reverse_iterator rbegin() noexcept { return reverse_iterator(end()); }
  reverse_iterator rend() noexcept { return reverse_iterator(begin()); }
  const_reverse_iterator rbegin() const noexcept { return const_reverse_iterator(end()); }
  const_reverse_iterator rend() const noexcept { return const_reverse_iterator(begin()); }

  void reserve(size_t n) {
    if (n > capacity_) grow(n);
  }
  void clear() noexcept { size_ = 0; }
  void push_back(int64_t v) {
    if (size_ == capacity_) grow(2 * capacity_);
    data_[size_++] = v;
  }
  int64_t& emplace_back(int64_t v) {
    push_back(v);
    return back();
  }
  void pop_back() { --size_; }
  void resize(size_t n, int64_t value = 0) {
    reserve(n);
    for (size_t i = size_; i < n; ++i) data_[i] = value;
    size_ = n;
  }
  iterator insert(const_iterator pos, int64_t v) { return insert(pos, size_t{1}, v); }
  iterator insert(const_iterator pos, size_t n, int64_t v);
  iterator insert(const_iterator pos, std::initializer_list<int64_t> values) {
    return insert(pos, values.begin(), values.end());
  }
  template <class It, class = std::enable_if_t<!std::is_integral_v<It>>>
  iterator insert(const_iterator pos, It first, It last) {
    const Shape values(first, last);  // a copy: the range may be inside this shape
    const size_t at = static_cast<size_t>(pos - begin());
    open_gap(at, values.size());
    std::copy(values.begin(), values.end(), data_ + at);
    return data_ + at;
  }
  iterator erase(const_iterator pos) { return erase(pos, pos + 1); }
  iterator erase(const_iterator first, const_iterator last);

  friend bool operator==(const Shape& a, const Shape& b) {
    return a.size_ == b.size_ && std::equal(a.begin(), a.end(), b.begin());
  }
  friend bool operator!=(const Shape& a, const Shape& b) { return !(a == b); }
  friend bool operator<(const Shape& a, const Shape& b) {
    return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end());
  }
  friend bool operator>(const Shape& a, const Shape& b) { return b < a; }
  friend bool operator<=(const Shape& a, const Shape& b) { return !(b < a); }
  friend bool operator>=(const Shape& a, const Shape& b) { return !(a < b); }

 private:
  bool on_heap() const noexcept { return data_ != inline_; }
  void release() noexcept {
    if (on_heap()) delete[] data_;
    data_ = inline_;
    size_ = 0;
    capacity_ = kInline;
  }
  // Moves `other`'s extents here (this holds none) and leaves `other` empty.
  void take(Shape& other) noexcept {
    if (other.on_heap()) {
      data_ = other.data_;
      capacity_ = other.capacity_;
      other.data_ = other.inline_;
      other.capacity_ = kInline;
    } else {
      std::copy(other.inline_, other.inline_ + other.size_, inline_);
    }
    size_ = other.size_;
    other.size_ = 0;
  }
  void grow(size_t n);
  void open_gap(size_t at, size_t n);
  [[noreturn]] void index_fault(size_t i) const;  // prints both numbers and aborts (sanitizer builds)

  int64_t* data_ = inline_;
  uint32_t size_ = 0;
  uint32_t capacity_ = kInline;
  int64_t inline_[kInline];
};

int64_t numel(const Shape& s);
std::vector<int64_t> contiguous_strides(const Shape& s);  // row-major, in elements
std::string shape_str(const Shape& s);                      // "[2, 3]"
// NumPy broadcasting; throws kiln::Error naming `op` and both shapes when incompatible.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
// Maps a possibly negative axis into [0, rank); throws naming `op` when out of range.
int normalize_axis(int64_t axis, size_t rank, const char* op);

}  // namespace kiln
