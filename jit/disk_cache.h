// Files of the on-disk kernel cache, shared by the host compiler and NVRTC: hashing keys, and
// writing entries so that a concurrent process sees no file or a whole one.
#pragma once
#include <string>
#include <string_view>

namespace kiln::jit {

// A file name unique within the machine for a temporary next to an entry: key.pid.counter+suffix.
std::string temporary_name(const std::string& key, const char* suffix);

// Writes `contents` to `path` (truncating); throws kiln::Error on failure.
void write_file(const std::string& path, const std::string& contents);

// Writes `contents` to `path` under a unique temporary name in the same directory and renames it
// into place, so a concurrent reader sees no file or a whole one. Throws kiln::Error on failure.
void write_file_atomically(const std::string& path, const std::string& contents);

// Says once per process, on stderr, that the kernel cache cannot be written (`why`) and that
// modules are compiled into a temporary directory instead, kept in memory for this process only;
// counts every such module in stats().cache_write_failures.
void note_cache_unwritable(const std::string& why);

// For tests: while a guard lives, every write into the kernel cache directory fails as on a full
// disk (ENOSPC), which a test cannot make happen for root without mounting a file system.
struct SimulateFullCacheDisk {
  SimulateFullCacheDisk();
  ~SimulateFullCacheDisk();
  SimulateFullCacheDisk(const SimulateFullCacheDisk&) = delete;
  SimulateFullCacheDisk& operator=(const SimulateFullCacheDisk&) = delete;
};

// 64-bit FNV-1a of `text` as 16 lower-case hex digits.
std::string hash_hex(std::string_view text);

}  // namespace kiln::jit
