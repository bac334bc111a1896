// Compiles generated C++ with the host compiler and caches the shared objects in memory and on disk.
// Disk entries are written under a unique temporary name and renamed into place, so a concurrent
// process sees either no file or a whole one; a file damaged some other way (truncated, overwritten,
// holding another key's module) is detected before or right after dlopen, deleted and rebuilt.
// A module split into several translation units is one file per unit (<key>-<unit>.so), compiled
// by as many compiler processes at once; it is a hit only when every part is there and whole.
// A cache directory that cannot be written (full disk, read-only) is not an error: the module is
// compiled in a temporary directory and kept in memory, with one warning per process.
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
#include <optional>
#include <sstream>
#include <unordered_map>

#include <fmt/ranges.h>

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

// Starts `command` with its output going to a pipe; finish_command collects it. Several started
// before any is finished run concurrently.
FILE* start_command(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  KILN_CHECK(pipe != nullptr, "jit", "cannot run '{}': {}", command, std::strerror(errno));
  return pipe;
}

CommandResult finish_command(FILE* pipe) {
  std::string output;
  char buffer[4096];
  size_t count;
  while ((count = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) output.append(buffer, count);
  const int status = pclose(pipe);
  const int exit_code = (status != -1 && WIFEXITED(status)) ? WEXITSTATUS(status) : -1;
  return {exit_code, output};
}

CommandResult run_command(const std::string& command) { return finish_command(start_command(command)); }

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

// Whether `line` ends in a backslash, which continues it onto the next line (GCC allows blanks
// after the backslash).
bool continues(std::string_view line) {
  const size_t last = line.find_last_not_of(" \t\r");
  return last != std::string_view::npos && line[last] == '\\';
}

// `text` without its note lines (kNotePrefix), which name a kernel's shape: plans of the same code
// (size-free flat kernels of other shapes, e.g. parameter initializations) then share a key, a
// compiled module and a disk cache file.
std::string code_of(std::string_view text) {
  std::string code;
  code.reserve(text.size());
  bool continued = false;  // the previous line ends in a backslash
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(at, end - at);
    const bool note = !continued && line.substr(0, kNotePrefix.size()) == kNotePrefix && !continues(line);
    if (!note) code.append(line).push_back('\n');
    continued = continues(line);
    at = end + 1;
  }
  return code;
}

std::string module_key(const std::vector<std::string>& units) {
  std::string keyed;
  for (const std::string& unit : units) {
    keyed += code_of(unit);
    keyed += '\0';
  }
  keyed += toolchain_identity();
  keyed += '\0';
  keyed += kCompileFlags;
  return jit::hash_hex(keyed);
}

// What part `part` of a module of `parts` translation units is called on disk and in its key
// symbol: the module's key alone when it is whole.
std::string part_key(const std::string& key, size_t part, size_t parts) {
  return parts == 1 ? key : fmt::format("{}-{}", key, part);
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

// Loads `path` and checks that it holds the part keyed `key`; on failure returns null and says why.
void* open_verified(const fs::path& path, const std::string& key, std::string* problem) {
  *problem = elf_problem(path);
  if (!problem->empty()) return nullptr;
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* message = dlerror();
    *problem = message ? message : "dlopen failed";
    return nullptr;
  }
  using KeyFunction = const char* (*)();
  auto module_key_function = reinterpret_cast<KeyFunction>(dlsym(handle, kKeySymbol));
  const char* found_key = module_key_function ? module_key_function() : nullptr;
  if (module_key_function == nullptr) *problem = fmt::format("has no {}()", kKeySymbol);
  else if (found_key == nullptr || key != found_key)
    *problem = fmt::format("holds the module of another key ({})", found_key ? found_key : "null");
  if (problem->empty()) return handle;
  dlclose(handle);
  return nullptr;
}

// The module of `key` in `parts` files from the cache directory, or null: when a part is missing
// (maybe still being written by another process), or damaged (then every part is deleted).
std::shared_ptr<CompiledModule> load_from_disk(const fs::path& directory, const std::string& key, size_t parts,
                                               int kernel_count) {
  std::vector<fs::path> paths;
  std::error_code error;
  for (size_t part = 0; part < parts; ++part) {
    paths.push_back(directory / (part_key(key, part, parts) + ".so"));
    if (!fs::exists(paths.back(), error)) return nullptr;
  }
  auto module = std::make_shared<CompiledModule>(key);
  for (size_t part = 0; part < parts; ++part) {
    std::string problem;
    void* handle = open_verified(paths[part], part_key(key, part, parts), &problem);
    if (handle == nullptr) {
      if (flags().log >= 1)
        fmt::print(stderr, "[kiln] cache file {} is corrupt ({}); rebuilding it\n", paths[part].string(), problem);
      for (const fs::path& path : paths) fs::remove(path, error);
      return nullptr;
    }
    module->add_part(handle, paths[part].string());
  }
  jit::stats().disk_cache_hits += 1;
  if (flags().log >= 1) fmt::print(stderr, "[kiln] loaded {} kernels from the disk cache (key {})\n", kernel_count, key);
  return module;
}

fs::path make_temporary_directory() {
  std::string pattern = (fs::temp_directory_path() / "kiln-jit-XXXXXX").string();
  KILN_CHECK(mkdtemp(pattern.data()) != nullptr, "jit", "cannot create a directory like {}: {}", pattern,
             std::strerror(errno));
  return pattern;
}

// The cache directory, or nullopt with the reason in `why` when it cannot be created.
std::optional<fs::path> usable_cache_directory(std::string* why) {
  try {
    return fs::path(jit::cache_directory());
  } catch (const Error& e) {
    *why = e.what();
    return std::nullopt;
  }
}

// What a compiler says when it cannot write its output: the disk, not the source, is at fault.
bool output_unwritable(const std::string& compiler_output) {
  for (const char* message : {"No space left on device", "File too large", "Disk quota exceeded", "Read-only file system"})
    if (compiler_output.find(message) != std::string::npos) return true;
  return false;
}

// Runs the compiler on every part's source at once and loads the results. In the cache directory
// (`cache` given), the sources and the shared objects stay there; returns null with the reason in
// `unwritable` when a file cannot be written there, so the caller can build elsewhere. Without
// `cache`, in a temporary directory that goes once the module is loaded (the sources stay if
// compilation fails, so the error can point at them).
std::shared_ptr<CompiledModule> build(const std::vector<std::string>& full_sources, const std::string& key,
                                      int kernel_count, int function_count, const fs::path* cache,
                                      std::string* unwritable) {
  const auto start = std::chrono::steady_clock::now();
  const bool keep_on_disk = cache != nullptr;
  const fs::path directory = keep_on_disk ? *cache : make_temporary_directory();
  const size_t parts = full_sources.size();

  struct Part {
    fs::path source_path, final_path, output_path;
    std::string command;
    FILE* pipe = nullptr;
  };
  std::vector<Part> built(parts);
  for (size_t i = 0; i < parts; ++i) {
    Part& part = built[i];
    const std::string name = part_key(key, i, parts);
    part.source_path = directory / (name + ".cc");
    part.final_path = directory / (name + ".so");
    part.output_path = keep_on_disk ? directory / jit::temporary_name(name, ".tmp.so") : part.final_path;
    if (keep_on_disk) {
      try {
        jit::write_file_atomically(part.source_path.string(), full_sources[i]);
      } catch (const Error& e) {
        *unwritable = e.what();
        return nullptr;
      }
    } else {
      jit::write_file(part.source_path.string(), full_sources[i]);
    }
    part.command = fmt::format("{} {} -o {} {}", shell_quote(kCompilerPath), kCompileFlags,
                               shell_quote(part.output_path.string()), shell_quote(part.source_path.string()));
  }
  for (Part& part : built) part.pipe = start_command(part.command);
  std::vector<CommandResult> results;
  for (Part& part : built) results.push_back(finish_command(part.pipe));  // every compiler is waited for

  std::error_code error;
  for (size_t i = 0; i < parts; ++i) {
    if (results[i].exit_code == 0 && fs::exists(built[i].output_path, error)) continue;
    for (const Part& part : built) fs::remove(part.output_path, error);
    if (keep_on_disk && output_unwritable(results[i].output)) {
      *unwritable = fmt::format("the compiler cannot write {}: {}", built[i].output_path.string(),
                                first_lines(results[i].output, 3));
      return nullptr;
    }
    KILN_FAIL("jit", "the host compiler failed on a module of {} kernel(s) (exit code {}); source saved at {}\n{}command: {}",
              kernel_count, results[i].exit_code, built[i].source_path.string(),
              first_lines(results[i].output, kMaxErrorLines), built[i].command);
  }
  if (keep_on_disk) {
    for (const Part& part : built) {
      fs::rename(part.output_path, part.final_path, error);
      if (!error) continue;
      *unwritable = fmt::format("cannot move the compiled module into {}: {}", part.final_path.string(), error.message());
      for (const Part& other : built) fs::remove(other.output_path, error);
      return nullptr;
    }
  }

  auto module = std::make_shared<CompiledModule>(key);
  std::string problem;
  for (size_t i = 0; i < parts && problem.empty(); ++i) {
    void* handle = open_verified(built[i].final_path, part_key(key, i, parts), &problem);
    if (handle != nullptr) module->add_part(handle, built[i].final_path.string());
    else problem = fmt::format("{}: {}", built[i].final_path.string(), problem);
  }
  if (!keep_on_disk) fs::remove_all(directory, error);  // a loaded object stays mapped after unlink
  KILN_CHECK(problem.empty(), "jit", "the freshly compiled module cannot be loaded: {}", problem);

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  jit::JitStats& counters = jit::stats();
  counters.kernels_compiled += kernel_count;
  counters.functions_compiled += function_count;
  counters.modules_compiled += 1;
  counters.compile_seconds += seconds;
  if (flags().log >= 1)
    fmt::print(stderr, "[kiln] compiled {} kernels ({} functions, {} unit{}) in {:.2f} s (key {})\n", kernel_count,
               function_count, parts, parts == 1 ? "" : "s", seconds, key);
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

CompiledModule::CompiledModule(std::string key) : key_(std::move(key)) {}

CompiledModule::~CompiledModule() {
  for (void* handle : handles_) dlclose(handle);
}

void CompiledModule::add_part(void* handle, std::string path) {
  handles_.push_back(handle);
  paths_.push_back(std::move(path));
}

void* CompiledModule::symbol(const std::string& name) const {
  for (void* handle : handles_) {
    dlerror();  // clear a stale error
    if (void* address = dlsym(handle, name.c_str())) return address;
  }
  KILN_FAIL("jit", "module {} ({}) has no symbol '{}'", key_, fmt::join(paths_, ", "), name);
}

std::shared_ptr<CompiledModule> compile_cached(const std::string& source, int kernel_count) {
  return compile_cached(std::vector<std::string>{source}, kernel_count, kernel_count);
}

std::shared_ptr<CompiledModule> compile_cached(const std::vector<std::string>& units, int kernel_count,
                                               int function_count) {
  KILN_CHECK(!units.empty(), "jit", "a module needs at least one translation unit");
  const std::string key = module_key(units);
  MemoryCache& cache = memory_cache();
  std::lock_guard lock(cache.mutex);
  if (auto found = cache.modules.find(key); found != cache.modules.end()) {
    jit::stats().memory_cache_hits += 1;
    return found->second;
  }

  std::vector<std::string> full_sources;
  for (size_t part = 0; part < units.size(); ++part) {
    full_sources.push_back(fmt::format("{}\nextern \"C\" const char* {}() {{ return \"{}\"; }}\n", units[part],
                                       kKeySymbol, part_key(key, part, units.size())));
    if (flags().log >= 3) fmt::print(stderr, "[kiln] source of module {} (unit {}):\n{}\n", key, part, full_sources.back());
  }

  // A cache directory that cannot be written (full disk, read-only, not creatable) costs the disk
  // cache, not the compile: the module is built in a temporary directory and kept in memory.
  std::shared_ptr<CompiledModule> module;
  std::string unwritable;
  if (flags().disk_cache) {
    if (std::optional<fs::path> directory = usable_cache_directory(&unwritable)) {
      module = load_from_disk(*directory, key, units.size(), kernel_count);
      if (module == nullptr) module = build(full_sources, key, kernel_count, function_count, &*directory, &unwritable);
    }
    if (module == nullptr) jit::note_cache_unwritable(unwritable);
  }
  if (module == nullptr) module = build(full_sources, key, kernel_count, function_count, nullptr, nullptr);
  cache.modules[key] = module;
  return module;
}

void clear_memory_cache() {
  MemoryCache& cache = memory_cache();
  std::lock_guard lock(cache.mutex);
  cache.modules.clear();
}

}  // namespace kiln::cpu
