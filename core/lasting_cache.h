// A thread-safe map from keys to objects that are costly to make and cheap to reuse (oneDNN
// primitives, cuBLASLt and cuDNN plans, library handles per device), filled on first use and never
// emptied: a training loop asks for the same few shapes every step and pays for each once.
//
//   LastingCache<Key, Plan>& plan_cache() {
//     static auto& cache = *new LastingCache<Key, Plan>;  // never destroyed, see below
//     return cache;
//   }
//   const Plan& plan = plan_cache().get_or_create(key, [&] { return make_plan(...); });
//
// Made with `new` as a function-local static, the cache is never destroyed, so nothing in it is
// torn down at exit after the library it came from (the CUDA runtime, oneDNN) has shut down, nor
// while another static's destructor may still use it.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>

namespace kiln {

template <class Key, class Value>
class LastingCache {
 public:
  LastingCache() = default;
  LastingCache(const LastingCache&) = delete;
  LastingCache& operator=(const LastingCache&) = delete;

  // The value for key; on first use made by make(), which returns a Value or a
  // std::unique_ptr<Value>. make runs under the cache's lock, so each value is made once; if it
  // throws, nothing is stored and the next call tries again. The reference stays valid for the
  // life of the cache; using the value from several threads at once is the value's business.
  template <class Make>
  Value& get_or_create(const Key& key, Make&& make) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = values_.find(key);
    if (it == values_.end()) it = values_.emplace(key, owned(std::forward<Make>(make)())).first;
    return *it->second;
  }

 private:
  static std::unique_ptr<Value> owned(std::unique_ptr<Value> made) { return made; }
  template <class Made>
    requires std::is_constructible_v<Value, Made&&>
  static std::unique_ptr<Value> owned(Made&& made) {
    return std::make_unique<Value>(std::forward<Made>(made));
  }

  std::mutex mutex_;
  std::map<Key, std::unique_ptr<Value>> values_;  // by pointer: references survive insertions
};

}  // namespace kiln
