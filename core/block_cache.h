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

// An allocator for std::allocate_shared: single objects (the control block with the value in it)
// come from BlockCache, arrays from the heap.
template <class T>
struct PooledAllocator {
  static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__);
  using value_type = T;
  PooledAllocator() = default;
  template <class U>
  PooledAllocator(const PooledAllocator<U>&) {}
  T* allocate(size_t n) {
    return n == 1 ? static_cast<T*>(BlockCache<sizeof(T)>::take()) : std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, size_t n) {
    if (n == 1) BlockCache<sizeof(T)>::give(p);
    else std::allocator<T>().deallocate(p, n);
  }
  template <class U>
  bool operator==(const PooledAllocator<U>&) const { return true; }
};

// An allocator for short arrays, a node's inputs: up to kShort elements (what a std::vector
// reserves for one, two or three inputs) take one BlockCache block, longer arrays the heap.
// Recording an op then costs no malloc for its inputs, nor freeing it a free.
template <class T>
struct ShortArrayAllocator {
  static constexpr size_t kShort = 4;
  static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__);
  using value_type = T;
  ShortArrayAllocator() = default;
  template <class U>
  ShortArrayAllocator(const ShortArrayAllocator<U>&) {}
  T* allocate(size_t n) {
    return n <= kShort ? static_cast<T*>(BlockCache<kShort * sizeof(T)>::take()) : std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, size_t n) {
    if (n <= kShort) BlockCache<kShort * sizeof(T)>::give(p);
    else std::allocator<T>().deallocate(p, n);
  }
  template <class U>
  bool operator==(const ShortArrayAllocator<U>&) const { return true; }
};

}  // namespace kiln
