// Global typed flags. Every flag is declared once below (type, name, default, doc); each can be
// set in code (`kiln::flags().lazy = false`), from the environment (`KILN_LAZY=0`), or for a scope:
//
//   { kiln::FlagsGuard guard;             // restores every flag when it goes out of scope
//     kiln::flags().memory_pool = kiln::MemoryPool::None;
//     ... }
//   kiln::flags().print();                // lists every flag, its value and where it came from
#pragma once
#include <cstdint>
#include <string>

namespace kiln {

enum class MemoryPool : uint8_t { None, Pool };
enum class AmpMode : uint8_t { None, Float16, BFloat16 };

// X(type, name, default, doc). Env var is KILN_<NAME upper-cased>.
#define KILN_FLAG_LIST(X)                                                                         \
  X(bool, lazy, true, "record ops lazily and run them when a value is needed; 0 = eager mode")     \
  X(bool, use_cuda, false, "create new tensors on the first CUDA device")                          \
  X(bool, cuda_emulator, false, "no GPU: run CUDA on the host emulator (tests; slow, exact)")        \
  X(bool, tf32, false, "CUDA float32 matmul and conv may round inputs to TF32 (tensor cores)")     \
  X(bool, deterministic, false, "CUDA: scatter-adds without atomics, cuDNN's deterministic algorithms only (same bits run to run; slower)") \
  X(int, log, 0, "0 quiet; 1 schedule summary and cache hits; 2 a line per kernel; 3 source")      \
  X(std::string, cache_dir, "", "kernel cache directory (default ~/.cache/kiln)")                  \
  X(std::string, data_dir, "", "datasets folder (DIR/fashion-mnist or DIR); default /usr/share/datasets") \
  X(bool, plan_cache, true, "reuse the schedule and kernels of a structurally identical graph")   \
  X(bool, disk_cache, true, "keep compiled kernels on disk across processes")                     \
  X(bool, share_functions, true, "compile kernels that differ only in the buffers they touch once")  \
  X(int, compile_jobs, 2, "host compiler processes one big module of kernels is split across")      \
  X(int64_t, seed, 0, "seed of the counter-based random generator")                                \
  X(int, num_threads, 0, "CPU threads for kernels and oneDNN (0 = all cores)")                     \
  X(MemoryPool, memory_pool, MemoryPool::Pool, "none|pool: caching allocator or plain malloc")     \
  X(std::string, memory_budget, "", "plan memory budget: a size (512MiB) or a fraction (0.5)")     \
  X(bool, memory_budget_strict, false, "a budget no recomputation meets is an Error (default: warn, run at the smallest arena found)") \
  X(std::string, offload, "auto", "auto|off|all: saved activations copied to host memory between forward and backward on a GPU (jit/offload.h)") \
  X(std::string, recompute, "cheap", "cheap|elementwise|off: activations the backward recomputes by elementwise work") \
  X(std::string, memory_limit, "", "cap on total allocated bytes (e.g. 2GiB); empty = none")       \
  X(bool, debug_memory, false, "fill every freed buffer with NaN to catch use-after-free")         \
  X(AmpMode, amp, AmpMode::None, "none|fp16|bf16: autocast ops to this type (ops/autocast.h)")   \
  X(double, bucket_mb, 25.0, "data parallel: MiB of gradients per all-reduce (first bucket 1 MiB)") \
  X(double, collective_timeout, 300.0, "seconds a collective waits for the other ranks, then throws") \
  X(bool, quantize, false, "nn::Linear runs quantized when no gradient is recorded (nn/quantize.h)") \
  X(int, quantize_bits, 8, "quantized weight width: 8 (int8 matmul) or 4 (weight-only int4)")    \
  X(std::string, compress_activations, "", "int8: keep activations saved for the backward as int8 (memory/compress.h)") \
  X(int64_t, stream_bytes, -1, "CPU: a flat kernel writes an output of at least this many bytes with non-temporal stores (-1: the last-level cache's size; 0: never)") \
  X(bool, tiled_updates, true, "a weight gradient read only by its update, or a large product by one elementwise kernel, is made tile by tile inside it, and an operand made for one weight gradient alone inside that (jit/tile_matmul.h)") \
  X(bool, fused_attention, true, "scaled_dot_product_attention runs as one kernel (no (T, T) matrix); 0 = composite")

struct Flags {
#define KILN_DECLARE_FLAG(type, name, def, doc) type name = def;
  KILN_FLAG_LIST(KILN_DECLARE_FLAG)
#undef KILN_DECLARE_FLAG

  // Prints every flag with its value, its environment variable and its source.
  void print() const;
  std::string to_string() const;
  // Flags as the environment sets them (defaults for unset variables); throws kiln::Error on a
  // bad value, naming the variable.
  static Flags from_environment();
  // Sets a flag from text, as the environment does; throws kiln::Error on unknown names/values.
  void set(const std::string& name, const std::string& value);
};

// The process-wide flags, read from KILN_* environment variables on first use.
Flags& flags();

// Restores all flags to their values at construction when destroyed.
class FlagsGuard {
 public:
  FlagsGuard();
  ~FlagsGuard();
  FlagsGuard(const FlagsGuard&) = delete;
  FlagsGuard& operator=(const FlagsGuard&) = delete;

 private:
  Flags saved_;
};

// Parses "512MiB", "2GB", "1048576" into bytes; throws kiln::Error naming `what`.
int64_t parse_size(const std::string& text, const char* what);

}  // namespace kiln
