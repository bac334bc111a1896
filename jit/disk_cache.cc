#include "jit/disk_cache.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>

#include <fmt/format.h>

#include "core/error.h"
#include "core/flags.h"
#include "jit/stats.h"

namespace kiln::jit {
namespace fs = std::filesystem;

namespace {
std::atomic<int> g_full_disk{0};  // SimulateFullCacheDisk guards alive
}  // namespace

SimulateFullCacheDisk::SimulateFullCacheDisk() { g_full_disk++; }
SimulateFullCacheDisk::~SimulateFullCacheDisk() { g_full_disk--; }

void note_cache_unwritable(const std::string& why) {
  static std::once_flag warned;
  std::call_once(warned, [&] {
    fmt::print(stderr,
               "[kiln] warning: the kernel cache cannot be written ({}); compiling into a temporary directory, "
               "kernels are kept in memory for this process only. Free space or set KILN_CACHE_DIR to a writable "
               "directory.\n",
               why);
  });
  stats().cache_write_failures++;
}

std::string temporary_name(const std::string& key, const char* suffix) {
  static std::atomic<uint64_t> counter{0};
  return fmt::format("{}.{}.{}{}", key, getpid(), counter++, suffix);
}

void write_file(const std::string& path, const std::string& contents) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file << contents;
  file.close();
  KILN_CHECK(file.good(), "jit", "cannot write {}", path);
}

std::string cache_directory() {
  auto ensure_directory = [](const fs::path& directory) {
    std::error_code error;
    fs::create_directories(directory, error);
    return fs::is_directory(directory, error);
  };
  std::error_code error;
  if (!flags().cache_dir.empty()) {
    const fs::path directory = fs::absolute(flags().cache_dir, error);
    KILN_CHECK(!error && ensure_directory(directory), "jit", "cannot create the kernel cache directory '{}' (KILN_CACHE_DIR)",
               flags().cache_dir);
    return directory.string();
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    const fs::path directory = fs::path(home) / ".cache" / "kiln";
    if (ensure_directory(directory)) return directory.string();
  }
  const fs::path fallback = "/tmp/kiln-cache";
  KILN_CHECK(ensure_directory(fallback), "jit", "cannot create the kernel cache directory {}; set KILN_CACHE_DIR",
             fallback.string());
  return fallback.string();
}

void write_file_atomically(const std::string& path, const std::string& contents) {
  const fs::path target(path);
  const fs::path temporary =
      target.parent_path() / temporary_name(target.stem().string(), (".tmp" + target.extension().string()).c_str());
  KILN_CHECK(g_full_disk == 0, "jit", "cannot write {}: No space left on device (simulated)", temporary.string());
  write_file(temporary.string(), contents);
  std::error_code error;
  fs::rename(temporary, target, error);
  if (error) fs::remove(temporary, error);
  KILN_CHECK(!error, "jit", "cannot write {}: {}", path, error.message());
}

std::string hash_hex(std::string_view text) {
  uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a offset basis and prime
  for (unsigned char byte : text) {
    hash ^= byte;
    hash *= 0x100000001b3ull;
  }
  return fmt::format("{:016x}", hash);
}

}  // namespace kiln::jit
