// Compiles generated CUDA C++ to cubins with NVRTC and caches them in memory and on disk. Disk
// entries (<key>.cubin, with the source as <key>.cu) are written atomically (backends/cpu/compiler.h); an
// entry that is not a whole CUDA ELF file is deleted and rebuilt. A cache that cannot be written
// only costs the disk copy: the cubin stays in memory.
#include "backends/cuda/nvrtc.h"

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "core/flags.h"
#include "backends/cpu/compiler.h"
#include "jit/disk_cache.h"
#include "jit/stats.h"
#include "backends/cuda/shared_library.h"

#if KILN_WITH_CUDA
#include <nvrtc.h>
#endif

#ifndef KILN_CUDA_INCLUDE_DIR
#define KILN_CUDA_INCLUDE_DIR "/usr/local/cuda/include"
#endif

namespace kiln::cuda {
namespace fs = std::filesystem;

#if KILN_WITH_CUDA

namespace {

#define KILN_NVRTC_FUNCTIONS(X)                                                                        \
  X(nvrtcCompileProgram) X(nvrtcCreateProgram) X(nvrtcDestroyProgram) X(nvrtcGetCUBIN) X(nvrtcGetCUBINSize) \
  X(nvrtcGetErrorString) X(nvrtcGetPTX) X(nvrtcGetPTXSize) X(nvrtcGetProgramLog) X(nvrtcGetProgramLogSize)  \
  X(nvrtcVersion)

// NVRTC's functions, resolved when the first CUDA kernel is compiled (backends/cuda/shared_library.h).
KILN_SHARED_LIBRARY_TABLE(NvrtcApi, rtc, "NVRTC", KILN_NVRTC_LIBRARY, KILN_NVRTC_SONAME, KILN_NVRTC_FUNCTIONS)

// NVRTC's options besides -arch; every one is part of the cache key. Multiply-add contraction is
// off, as the host build's -ffp-contract=off, so both backends round each operation alike (Philox
// normals match bit for bit).
std::vector<std::string> compile_options() {
  return {"-std=c++17", "-default-device", "--fmad=false", std::string("-I") + KILN_CUDA_INCLUDE_DIR};
}
constexpr int kMaxLogLines = 60;

#define KILN_NVRTC_CHECK(call)                                                                   \
  do {                                                                                           \
    nvrtcResult result_ = (call);                                                                \
    KILN_CHECK(result_ == NVRTC_SUCCESS, "nvrtc", "{} failed: {}", #call, rtc().nvrtcGetErrorString(result_)); \
  } while (0)

std::string read_file(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
}

// "" when `image` looks like a whole 64-bit CUDA ELF file, else what is wrong with it.
std::string cubin_problem(const std::string& image) {
  constexpr size_t kHeaderSize = 64;
  if (image.size() < kHeaderSize) return "shorter than an ELF header";
  if (std::memcmp(image.data(), "\x7f" "ELF", 4) != 0 || image[4] != 2) return "not a 64-bit ELF file";
  uint16_t machine, section_entry, sections;
  uint64_t section_offset;
  std::memcpy(&machine, image.data() + 18, 2);
  std::memcpy(&section_offset, image.data() + 40, 8);
  std::memcpy(&section_entry, image.data() + 58, 2);
  std::memcpy(&sections, image.data() + 60, 2);
  constexpr uint16_t kMachineCuda = 190;  // EM_CUDA
  if (machine != kMachineCuda) return "not a CUDA ELF file";
  if (section_offset > image.size() || uint64_t{section_entry} * sections > image.size() - section_offset)
    return "section headers are cut off (truncated)";
  return "";
}

std::string program_log(nvrtcProgram program) {
  size_t size = 0;
  if (rtc().nvrtcGetProgramLogSize(program, &size) != NVRTC_SUCCESS || size == 0) return "";
  std::string log(size, '\0');
  rtc().nvrtcGetProgramLog(program, log.data());
  if (!log.empty() && log.back() == '\0') log.pop_back();
  return log;
}

std::string first_lines(const std::string& text, int max_lines) {
  std::string kept;
  int total = 0;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    if (++total <= max_lines) kept.append(text, start, end - start).push_back('\n');
    start = end + 1;
  }
  if (total > max_lines) kept += fmt::format("... ({} more lines)\n", total - max_lines);
  return kept;
}

std::string compile(const std::string& source, const std::string& arch, const fs::path& source_path,
                    int function_count) {
  std::vector<std::string> options = compile_options();
  options.push_back("-arch=" + arch);
  std::vector<const char*> option_pointers;
  for (const std::string& o : options) option_pointers.push_back(o.c_str());
  nvrtcProgram program;
  KILN_NVRTC_CHECK(rtc().nvrtcCreateProgram(&program, source.c_str(), source_path.filename().c_str(), 0, nullptr, nullptr));
  const nvrtcResult result = rtc().nvrtcCompileProgram(program, static_cast<int>(option_pointers.size()), option_pointers.data());
  std::string image;
  const bool ptx = arch.rfind("compute_", 0) == 0;  // a virtual architecture: PTX text
  if (result == NVRTC_SUCCESS) {
    size_t size = 0;
    ptx ? rtc().nvrtcGetPTXSize(program, &size) : rtc().nvrtcGetCUBINSize(program, &size);
    image.resize(size);
    if (size > 0) ptx ? rtc().nvrtcGetPTX(program, image.data()) : rtc().nvrtcGetCUBIN(program, image.data());
    if (ptx && !image.empty() && image.back() == '\0') image.pop_back();
  }
  const std::string log = program_log(program);
  rtc().nvrtcDestroyProgram(&program);
  KILN_CHECK(result == NVRTC_SUCCESS && !image.empty(), "nvrtc",
             "NVRTC failed on a module of {} CUDA function(s) for {} ({}); source saved at {}\n{}", function_count, arch,
             rtc().nvrtcGetErrorString(result), source_path.string(), first_lines(log, kMaxLogLines));
  return image;
}

struct CubinCache {
  std::mutex mutex;  // also serializes compiles
  std::unordered_map<std::string, std::shared_ptr<const Cubin>> cubins;
};

CubinCache& cubin_cache() {
  static auto* cache = new CubinCache;
  return *cache;
}

}  // namespace

bool nvrtc_available() { return true; }

std::string nvrtc_version() {
  int major = 0, minor = 0;
  KILN_NVRTC_CHECK(rtc().nvrtcVersion(&major, &minor));
  return fmt::format("{}.{}", major, minor);
}

std::shared_ptr<const Cubin> compile_cuda_cached(const std::string& source, const std::string& arch,
                                                 int function_count) {
  KILN_CHECK(arch.size() > 3 && arch.compare(0, 3, "sm_") == 0 &&
                 arch.find_first_not_of("0123456789abf", 3) == std::string::npos,
             "nvrtc", "'{}' is not a GPU architecture like sm_90", arch);
  std::string keyed = source + '\0' + arch + '\0' + nvrtc_version();
  for (const std::string& option : compile_options()) keyed += '\0' + option;
  const std::string key = jit::hash_hex(keyed);
  CubinCache& cache = cubin_cache();
  std::lock_guard lock(cache.mutex);
  if (auto found = cache.cubins.find(key); found != cache.cubins.end()) return found->second;

  auto cubin = std::make_shared<Cubin>();
  cubin->key = key;
  cubin->arch = arch;
  // A cache directory that cannot be created or written (full disk, read-only) costs the disk
  // cache only: the cubin is kept in memory (jit::note_cache_unwritable says so once).
  std::string unwritable;
  fs::path directory;
  try {
    directory = jit::cache_directory();
  } catch (const Error& e) {
    unwritable = e.what();
  }
  const bool usable = unwritable.empty();
  const fs::path cubin_path = directory / (key + ".cubin");
  fs::path source_path = directory / (key + ".cu");
  std::error_code error;
  if (flags().disk_cache && usable && fs::exists(cubin_path, error)) {
    std::string image = read_file(cubin_path);
    const std::string problem = cubin_problem(image);
    if (problem.empty()) {
      cubin->image = std::move(image);
      cubin->path = cubin_path.string();
      cubin->from_disk = true;
      if (flags().log >= 1) fmt::print(stderr, "[kiln] loaded {} CUDA functions from the disk cache (key {})\n", function_count, key);
    } else {
      if (flags().log >= 1) fmt::print(stderr, "[kiln] cache file {} is corrupt ({}); rebuilding it\n", cubin_path.string(), problem);
      fs::remove(cubin_path, error);
    }
  }
  if (cubin->image.empty()) {
    const auto start = std::chrono::steady_clock::now();
    if (flags().log >= 3) fmt::print(stderr, "[kiln] CUDA source of module {}:\n{}\n", key, source);
    // The source goes to the cache directory first, so an error message can point at it.
    bool source_saved = false;
    if (usable) {
      try {
        jit::write_file_atomically(source_path.string(), source);
        source_saved = true;
      } catch (const Error& e) {
        unwritable = e.what();
      }
    }
    if (!source_saved) source_path = key + ".cu (not saved: the cache directory cannot be written)";
    cubin->image = compile(source, arch, source_path, function_count);
    if (flags().disk_cache && source_saved) {
      try {
        jit::write_file_atomically(cubin_path.string(), cubin->image);
        cubin->path = cubin_path.string();
      } catch (const Error& e) {
        unwritable = e.what();
      }
    } else if (source_saved) {
      fs::remove(source_path, error);
    }
    if (flags().disk_cache && !unwritable.empty()) jit::note_cache_unwritable(unwritable);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (flags().log >= 1)
      fmt::print(stderr, "[kiln] NVRTC compiled {} CUDA functions for {} in {:.2f} s (key {})\n", function_count, arch,
                 seconds, key);
  }
  cache.cubins[key] = cubin;
  return cubin;
}

std::string cuda_ptx(const std::string& source, const std::string& virtual_arch) {
  KILN_CHECK(virtual_arch.rfind("compute_", 0) == 0, "nvrtc", "PTX is compiled for a virtual architecture such as "
             "compute_90, not {}", virtual_arch);
  return compile(source, virtual_arch, "kiln_ptx.cu (not saved)", 0);
}

void clear_cuda_memory_cache() {
  CubinCache& cache = cubin_cache();
  std::lock_guard lock(cache.mutex);
  cache.cubins.clear();
}

#else  // built without the CUDA toolkit

bool nvrtc_available() { return false; }

std::string nvrtc_version() { return ""; }

std::shared_ptr<const Cubin> compile_cuda_cached(const std::string&, const std::string& arch, int) {
  KILN_FAIL("nvrtc", "cannot compile CUDA kernels for {}: kiln was built without the CUDA toolkit", arch);
}

std::string cuda_ptx(const std::string&, const std::string& virtual_arch) {
  KILN_FAIL("nvrtc", "cannot compile CUDA kernels for {}: kiln was built without the CUDA toolkit", virtual_arch);
}

void clear_cuda_memory_cache() {}

#endif

}  // namespace kiln::cuda
