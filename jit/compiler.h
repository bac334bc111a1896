// The host-compiler half of kiln's JIT: turns generated C++ into a loaded shared object, reusing
// one from memory or from the on-disk cache when the source, compiler and flags are unchanged.
//
//   auto module = kiln::jit::compile_cached(source, /*kernel_count=*/2);
//   using Kernel = void (*)(const float*, float*, int64_t);
//   auto kernel = reinterpret_cast<Kernel>(module->symbol("kernel_0"));
//   kiln::jit::stats().kernels_compiled;   // counters read by tests and KILN_LOG
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace kiln::jit {

// Process-wide JIT counters. This file counts compiles and cache hits; the executor counts
// kernels_run, plan_cache_hits and plans_built.
struct JitStats {
  int64_t kernels_run = 0;
  int64_t kernels_compiled = 0;
  int64_t modules_compiled = 0;
  int64_t disk_cache_hits = 0;
  int64_t memory_cache_hits = 0;
  int64_t plan_cache_hits = 0;
  int64_t plans_built = 0;
  double compile_seconds = 0;
};

JitStats& stats();
void reset_stats();

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

// flags().cache_dir, else $HOME/.cache/kiln, else /tmp/kiln-cache; created if missing. Absolute.
std::string cache_directory();

// Writes `contents` to `path` under a unique temporary name in the same directory and renames it
// into place, so a concurrent reader sees no file or a whole one. Throws kiln::Error on failure.
void write_file_atomically(const std::string& path, const std::string& contents);

// 64-bit FNV-1a of `text` as 16 lower-case hex digits.
std::string hash_hex(std::string_view text);

}  // namespace kiln::jit
