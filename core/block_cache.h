// Recycled memory for the lazy graph's nodes and variables. A training step records and then
// frees hundreds of them at once, more than glibc's per-thread cache keeps (7 blocks per size),
// so most allocations went through malloc's slow paths; each thread here keeps up to 4096 blocks
// of each pooled type. Any thread may free any block. Sanitizer builds (and -DKILN_NO_BLOCK_CACHE,
// for Valgrind) use plain new/delete, so a node used after it was freed is still caught.
#pragma once
#include <cstddef>
#include <memory>
#include <new>

#include "core/sanitizers.h"

namespace kiln {

#if KILN_ADDRESS_SANITIZER || KILN_THREAD_SANITIZER || KILN_MEMORY_SANITIZER || defined(KILN_NO_BLOCK_CACHE)
inline constexpr bool kPoolBlocks = false;
#else
inline constexpr bool kPoolBlocks = true;
#endif

// Free blocks of `Size` bytes, per thread.
template <size_t Size>
class BlockCache {
  static_assert(Size >= sizeof(void*));

 public:
  static void* take() {
    if (!kPoolBlocks || finished()) return ::operator new(Size);
    List& list = local();
    if (list.head == nullptr) return ::operator new(Size);
    void* block = list.head;
    list.head = *static_cast<void**>(block);
    --list.count;
    return block;
  }
  static void give(void* block) {
    if (kPoolBlocks && !finished()) {
      List& list = local();
      if (list.count < kKeep) {
        *static_cast<void**>(block) = list.head;
        list.head = block;
        ++list.count;
        return;
      }
    }
    ::operator delete(block);
  }

 private:
  static constexpr size_t kKeep = 4096;
  struct List {
    void* head = nullptr;
    size_t count = 0;
    ~List() {
      finished() = true;  // blocks freed later (static objects at exit) go straight back
      while (head != nullptr) {
        void* next = *static_cast<void**>(head);
        ::operator delete(head);
        head = next;
      }
    }
  };
  static List& local() {
    thread_local List list;
    return list;
  }
  static bool& finished() {
    thread_local bool done = false;  // trivially destructible: valid after List's destructor
    return done;
  }
};

// An allocator whose arrays of up to `Short` elements take one BlockCache block (sized for
// `Short`), longer arrays the heap.
template <class T, size_t Short>
struct BlockAllocator {
  static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__);
  static constexpr size_t kShort = Short;
  using value_type = T;
  template <class U>
  struct rebind {
    using other = BlockAllocator<U, Short>;
  };
  BlockAllocator() = default;
  template <class U>
  BlockAllocator(const BlockAllocator<U, Short>&) {}
  // Sanitizer builds take every array from the heap at its exact size: an index past a node's
  // last input then reaches a redzone, as it did before the blocks.
  T* allocate(size_t n) {
    if (kPoolBlocks && n <= Short) return static_cast<T*>(BlockCache<Short * sizeof(T)>::take());
    return std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, size_t n) {
    if (kPoolBlocks && n <= Short) BlockCache<Short * sizeof(T)>::give(p);
    else std::allocator<T>().deallocate(p, n);
  }
  template <class U>
  bool operator==(const BlockAllocator<U, Short>&) const { return true; }
};

// For std::allocate_shared: single objects (the control block with the value in it).
template <class T>
using PooledAllocator = BlockAllocator<T, 1>;
// For short arrays, a node's inputs: up to four elements (what a std::vector reserves for one,
// two or three inputs) in one block. Recording an op then costs no malloc for its inputs, nor
// freeing it a free.
template <class T>
using ShortArrayAllocator = BlockAllocator<T, 4>;

}  // namespace kiln
