// The host-compiler half of kiln's JIT: turns generated C++ into a loaded shared object, reusing
// one from memory or from the on-disk cache when the source, compiler and flags are unchanged.
//
//   auto module = kiln::cpu::compile_cached(source, /*kernel_count=*/2);
//   using Kernel = void (*)(const float*, float*, int64_t);
//   auto kernel = reinterpret_cast<Kernel>(module->symbol("kernel_0"));
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace kiln::cpu {

// A dlopen'ed shared object, closed when the last reference goes away. Made by compile_cached.
class CompiledModule {
 public:
  // Takes ownership of `handle`, a dlopen handle of the file at `path`.
  CompiledModule(void* handle, std::string key, std::string path);
  ~CompiledModule();
  CompiledModule(const CompiledModule&) = delete;
  CompiledModule& operator=(const CompiledModule&) = delete;

  // The address of an extern "C" symbol; throws kiln::Error if the module lacks it.
  void* symbol(const std::string& name) const;
  // The cache key: a hash of the source, the compiler, the host CPU and the compile flags.
  const std::string& key() const { return key_; }
  // The file it was loaded from (already deleted when flags().disk_cache is off).
  const std::string& path() const { return path_; }

 private:
  void* handle_;
  std::string key_;
  std::string path_;
};

// Compiles `source`, one translation unit holding `kernel_count` kernels, into a shared object,
// or reuses it from the in-memory cache or the on-disk cache. Thread-safe; throws kiln::Error with
// the compiler's output when compilation fails.
std::shared_ptr<CompiledModule> compile_cached(const std::string& source, int kernel_count);

// Forgets every module kept in memory (modules still referenced elsewhere stay loaded); the next
// compile_cached behaves as in a fresh process. For tests.
void clear_memory_cache();

}  // namespace kiln::cpu
