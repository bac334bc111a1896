// The host-compiler half of kiln's JIT: turns generated C++ into a loaded shared object, reusing
// one from memory or from the on-disk cache when the source, compiler and flags are unchanged.
//
//   auto module = kiln::cpu::compile_cached(source, /*kernel_count=*/2);
//   using Kernel = void (*)(const float*, float*, int64_t);
//   auto kernel = reinterpret_cast<Kernel>(module->symbol("kernel_0"));
//   auto both = kiln::cpu::compile_cached({first_half, second_half}, 40, 40);  // two compilers at once
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::cpu {

// One or more dlopen'ed shared objects (the parts of a module compiled as several translation
// units), closed when the last reference goes away. Made by compile_cached.
class CompiledModule {
 public:
  explicit CompiledModule(std::string key);
  ~CompiledModule();
  CompiledModule(const CompiledModule&) = delete;
  CompiledModule& operator=(const CompiledModule&) = delete;

  // Takes ownership of `handle`, a dlopen handle of the file at `path`.
  void add_part(void* handle, std::string path);
  // The address of an extern "C" symbol of any part; throws kiln::Error if no part has it.
  void* symbol(const std::string& name) const;
  // The cache key: a hash of the source, the compiler, the host CPU and the compile flags.
  const std::string& key() const { return key_; }
  // The file the (first) part was loaded from (already deleted when flags().disk_cache is off).
  const std::string& path() const { return paths_.front(); }
  const std::vector<std::string>& paths() const { return paths_; }

 private:
  std::string key_;
  std::vector<void*> handles_;
  std::vector<std::string> paths_;
};

// Lines that start with this are notes for readers (render_cpp puts a kernel's shape and plan
// kernels there): the module key leaves them out, so modules that differ only in notes are one
// module. Kept in the key after a line that a backslash continues, or when one ends in a backslash.
inline constexpr std::string_view kNotePrefix = "//~ ";

// Compiles `source`, one translation unit holding `kernel_count` kernels, into a shared object,
// or reuses it from the in-memory cache or the on-disk cache. Thread-safe; throws kiln::Error with
// the compiler's output when compilation fails.
std::shared_ptr<CompiledModule> compile_cached(const std::string& source, int kernel_count);

// The same for a module split into `units`, translation units compiled concurrently (a compiler
// process each) into a shared object each and loaded as one module; keyed by every unit, so a
// change to any of them, or another split, is another module. `function_count`: the distinct
// functions the `kernel_count` kernels run (jit::stats, logs).
std::shared_ptr<CompiledModule> compile_cached(const std::vector<std::string>& units, int kernel_count,
                                               int function_count);

// Forgets every module kept in memory (modules still referenced elsewhere stay loaded); the next
// compile_cached behaves as in a fresh process. For tests.
void clear_memory_cache();

}  // namespace kiln::cpu
