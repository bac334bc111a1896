// Compiles generated C++ with the host compiler and caches the shared objects in memory and on disk.
// Disk entries are written under a unique temporary name and renamed into place, so a concurrent
// process sees either no file or a whole one; a file damaged some other way (truncated, overwritten,
// holding another key's module) is detected before or right after dlopen, deleted and rebuilt.
#include "backends/cpu/compiler.h"

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "core/flags.h"
#include "jit/disk_cache.h"
#include "jit/stats.h"

#ifndef KILN_HOST_CXX
#define KILN_HOST_CXX "c++"
#endif

namespace kiln::cpu {
namespace fs = std::filesystem;

namespace {

constexpr const char* kCompilerPath = KILN_HOST_CXX;
constexpr const char* kCompileFlags = "-O2 -march=native -fno-math-errno -fno-trapping-math -ffp-contract=off -fopenmp -shared -fPIC -std=c++17 -w";
// Every module exports this function returning its key, so a cache file can prove what it holds.
constexpr const char* kKeySymbol = "kiln_module_key";
constexpr int kMaxErrorLines = 40;

std::string shell_quote(const std::string& text) {
  std::string quoted = "'";
  for (char c : text) quoted += (c == '\'') ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

struct CommandResult {
  int exit_code;
  std::string output;  // stdout and stderr interleaved
};

CommandResult run_command(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  KILN_CHECK(pipe != nullptr, "jit", "cannot run '{}': {}", command, std::strerror(errno));
  std::string output;
  char buffer[4096];
  size_t count;
  while ((count = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) output.append(buffer, count);
  const int status = pclose(pipe);
  const int exit_code = (status != -1 && WIFEXITED(status)) ? WEXITSTATUS(status) : -1;
  return {exit_code, output};
}

std::string first_lines(const std::string& text, int max_lines) {
  std::istringstream stream(text);
  std::string line, kept;
  int total = 0;
  while (std::getline(stream, line)) {
    if (++total <= max_lines) kept += line + '\n';
  }
  if (total > max_lines) kept += fmt::format("... ({} more lines)\n", total - max_lines);
  return kept;
}

// The fields of /proc/cpuinfo's first processor that decide what -march=native emits. Code built
// for one CPU may not run on another, and a home-directory cache can be shared between machines.
std::string cpu_description() {
  static const char* const kFields[] = {"vendor_id",       "cpu family",       "model",       "model name", "flags",
                                        "CPU implementer", "CPU architecture", "CPU variant", "CPU part",   "Features"};
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, description;
  while (std::getline(cpuinfo, line) && !line.empty()) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string field = line.substr(0, colon);
    field.erase(field.find_last_not_of(" \t") + 1);
    for (const char* wanted : kFields) {
      if (field == wanted) description += line + '\n';
    }
  }
  return description;
}

// The first line of `cxx --version` plus a hash of the host CPU; computed once per process.
const std::string& toolchain_identity() {
  static const std::string identity = [] {
    const CommandResult version = run_command(shell_quote(kCompilerPath) + " --version");
    const std::string first_line = version.output.substr(0, version.output.find('\n'));
    return fmt::format("{} ({}) | cpu {}", first_line, kCompilerPath, jit::hash_hex(cpu_description()));
  }();
  return identity;
}

std::string module_key(const std::string& source) {
  std::string keyed = source;
  keyed += '\0';
  keyed += toolchain_identity();
  keyed += '\0';
  keyed += kCompileFlags;
  return jit::hash_hex(keyed);
}

// Returns "" when `path` looks like a whole native shared object, else what is wrong with it.
// dlopen maps segments without comparing them with the file size, and touching a page past the
// end of a truncated file raises SIGBUS, so truncation has to be caught here, before dlopen.
std::string elf_problem(const fs::path& path) {
  std::error_code error;
  const uint64_t size = fs::file_size(path, error);
  std::ifstream file(path, std::ios::binary);
  if (error || !file) return "cannot be read";
  ElfW(Ehdr) header{};
  if (size < sizeof header || !file.read(reinterpret_cast<char*>(&header), sizeof header)) return "shorter than an ELF header";
  if (std::memcmp(header.e_ident, ELFMAG, SELFMAG) != 0) return "not an ELF file";
  const int native_class = sizeof(void*) == 8 ? ELFCLASS64 : ELFCLASS32;
  if (header.e_ident[EI_CLASS] != native_class || header.e_type != ET_DYN) return "not a native shared object";

  auto fits = [size](uint64_t offset, uint64_t length) { return offset <= size && length <= size - offset; };
  if (header.e_phentsize != sizeof(ElfW(Phdr)) || !fits(header.e_phoff, uint64_t{header.e_phnum} * sizeof(ElfW(Phdr))))
    return "program headers are cut off";
  if (header.e_shoff != 0 && !fits(header.e_shoff, uint64_t{header.e_shnum} * header.e_shentsize))
    return "section headers are cut off (truncated)";
  file.seekg(static_cast<std::streamoff>(header.e_phoff));
  for (int i = 0; i < header.e_phnum; ++i) {
    ElfW(Phdr) segment{};
    if (!file.read(reinterpret_cast<char*>(&segment), sizeof segment)) return "program headers are unreadable";
    if (!fits(segment.p_offset, segment.p_filesz)) return fmt::format("segment {} runs past the end (truncated)", i);
  }
  return "";
}

// Loads `path` and checks that it is the module of `key`; on failure returns null and says why.
std::shared_ptr<CompiledModule> open_verified(const fs::path& path, const std::string& key, std::string* problem) {
  *problem = elf_problem(path);
  if (!problem->empty()) return nullptr;
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* message = dlerror();
    *problem = message ? message : "dlopen failed";
    return nullptr;
  }
  auto module = std::make_shared<CompiledModule>(handle, key, path.string());
  using KeyFunction = const char* (*)();
  auto module_key_function = reinterpret_cast<KeyFunction>(dlsym(handle, kKeySymbol));
  if (module_key_function == nullptr) {
    *problem = fmt::format("has no {}()", kKeySymbol);
    return nullptr;
  }
  const char* found_key = module_key_function();
  if (found_key == nullptr || key != found_key) {
    *problem = fmt::format("holds the module of another key ({})", found_key ? found_key : "null");
    return nullptr;
  }
  return module;
}

std::shared_ptr<CompiledModule> load_from_disk(const std::string& key, int kernel_count) {
  const fs::path path = fs::path(jit::cache_directory()) / (key + ".so");
  std::error_code error;
  if (!fs::exists(path, error)) return nullptr;
  std::string problem;
  if (auto module = open_verified(path, key, &problem)) {
    jit::stats().disk_cache_hits += 1;
    if (flags().log >= 1) fmt::print(stderr, "[kiln] loaded {} kernels from the disk cache (key {})\n", kernel_count, key);
    return module;
  }
  if (flags().log >= 1) fmt::print(stderr, "[kiln] cache file {} is corrupt ({}); rebuilding it\n", path.string(), problem);
  fs::remove(path, error);
  return nullptr;
}

fs::path make_temporary_directory() {
  std::string pattern = (fs::temp_directory_path() / "kiln-jit-XXXXXX").string();
  KILN_CHECK(mkdtemp(pattern.data()) != nullptr, "jit", "cannot create a directory like {}: {}", pattern,
             std::strerror(errno));
  return pattern;
}

// Runs the compiler on `full_source` and loads the result. With the disk cache on, the source and
// the shared object stay in the cache directory; with it off, both go once the module is loaded
// (the source stays if compilation fails, so the error can point at it).
std::shared_ptr<CompiledModule> build(const std::string& full_source, const std::string& key, int kernel_count) {
  const auto start = std::chrono::steady_clock::now();
  const bool keep_on_disk = flags().disk_cache;
  const fs::path directory = keep_on_disk ? fs::path(jit::cache_directory()) : make_temporary_directory();
  const fs::path source_path = directory / (key + ".cc");
  const fs::path final_path = directory / (key + ".so");
  const fs::path output_path = keep_on_disk ? directory / jit::temporary_name(key, ".tmp.so") : final_path;

  if (keep_on_disk) jit::write_file_atomically(source_path.string(), full_source);
  else jit::write_file(source_path.string(), full_source);

  const std::string command = fmt::format("{} {} -o {} {}", shell_quote(kCompilerPath), kCompileFlags,
                                          shell_quote(output_path.string()), shell_quote(source_path.string()));
  const CommandResult result = run_command(command);
  std::error_code error;
  if (result.exit_code != 0 || !fs::exists(output_path, error)) {
    fs::remove(output_path, error);
    KILN_FAIL("jit", "the host compiler failed on a module of {} kernel(s) (exit code {}); source saved at {}\n{}command: {}",
              kernel_count, result.exit_code, source_path.string(), first_lines(result.output, kMaxErrorLines), command);
  }
  if (keep_on_disk) {
    fs::rename(output_path, final_path, error);
    if (error) fs::remove(output_path, error);
    KILN_CHECK(!error, "jit", "cannot move the compiled module into {}: {}", final_path.string(), error.message());
  }

  std::string problem;
  auto module = open_verified(final_path, key, &problem);
  if (!keep_on_disk) fs::remove_all(directory, error);  // a loaded object stays mapped after unlink
  KILN_CHECK(module != nullptr, "jit", "the freshly compiled {} cannot be loaded: {}", final_path.string(), problem);

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  jit::JitStats& counters = jit::stats();
  counters.kernels_compiled += kernel_count;
  counters.modules_compiled += 1;
  counters.compile_seconds += seconds;
  if (flags().log >= 1) fmt::print(stderr, "[kiln] compiled {} kernels in {:.2f} s (key {})\n", kernel_count, seconds, key);
  return module;
}

struct MemoryCache {
  std::mutex mutex;  // also serializes compiles, so a module is never built twice at once
  std::unordered_map<std::string, std::shared_ptr<CompiledModule>> modules;
};

// Never destroyed: kernels may still run from other static destructors, and dlclose'ing OpenMP
// code at exit can race with its worker threads.
MemoryCache& memory_cache() {
  static auto* cache = new MemoryCache;
  return *cache;
}

}  // namespace

CompiledModule::CompiledModule(void* handle, std::string key, std::string path)
    : handle_(handle), key_(std::move(key)), path_(std::move(path)) {}

CompiledModule::~CompiledModule() {
  if (handle_ != nullptr) dlclose(handle_);
}

void* CompiledModule::symbol(const std::string& name) const {
  dlerror();  // clear a stale error so the one below is ours
  void* address = dlsym(handle_, name.c_str());
  KILN_CHECK(address != nullptr, "jit", "module {} ({}) has no symbol '{}'", key_, path_, name);
  return address;
}

std::shared_ptr<CompiledModule> compile_cached(const std::string& source, int kernel_count) {
  const std::string key = module_key(source);
  MemoryCache& cache = memory_cache();
  std::lock_guard lock(cache.mutex);
  if (auto found = cache.modules.find(key); found != cache.modules.end()) {
    jit::stats().memory_cache_hits += 1;
    return found->second;
  }

  const std::string full_source =
      fmt::format("{}\nextern \"C\" const char* {}() {{ return \"{}\"; }}\n", source, kKeySymbol, key);
  if (flags().log >= 3) fmt::print(stderr, "[kiln] source of module {}:\n{}\n", key, full_source);

  std::shared_ptr<CompiledModule> module;
  if (flags().disk_cache) module = load_from_disk(key, kernel_count);
  if (module == nullptr) module = build(full_source, key, kernel_count);
  cache.modules[key] = module;
  return module;
}

void clear_memory_cache() {
  MemoryCache& cache = memory_cache();
  std::lock_guard lock(cache.mutex);
  cache.modules.clear();
}

}  // namespace kiln::cpu
