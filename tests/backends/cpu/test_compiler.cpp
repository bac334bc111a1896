// Tests of the JIT's host-compiler path: compiling and calling a function, the memory and disk
// caches, recovery from damaged cache files, compiler errors and the disk_cache=false mode.
#include <catch2/catch.hpp>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/flags.h"
#include "backends/cpu/compiler.h"
#include "jit/disk_cache.h"
#include "jit/stats.h"

namespace fs = std::filesystem;
using kiln::cpu::compile_cached;
using kiln::jit::stats;

namespace {

const std::string kAdd1Source = R"(extern "C" int add1(int x) { return x + 1; })";
const std::string kTimes2Source = R"(extern "C" int times2(int x) { return x * 2; })";

int call(const kiln::cpu::CompiledModule& module, const char* name, int argument) {
  using IntFunction = int (*)(int);
  return reinterpret_cast<IntFunction>(module.symbol(name))(argument);
}

// A fresh cache directory and no modules in memory, as a new process with an empty cache sees it.
// Restores the flags and removes the directory afterwards.
struct FreshJit {
  kiln::FlagsGuard flags_guard;
  fs::path cache_dir;

  FreshJit() {
    cache_dir = make_directory();
    kiln::flags().cache_dir = cache_dir.string();
    kiln::flags().disk_cache = true;
    kiln::flags().log = 0;
    kiln::cpu::clear_memory_cache();
    kiln::jit::reset_stats();
  }
  ~FreshJit() {
    kiln::cpu::clear_memory_cache();  // unloads the modules before their files go
    std::error_code error;
    fs::remove_all(cache_dir, error);
  }

  static fs::path make_directory() {
    char pattern[] = "/tmp/kiln-test-jit-XXXXXX";
    REQUIRE(mkdtemp(pattern) != nullptr);
    return pattern;
  }
};

std::vector<std::string> file_names(const fs::path& directory) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(directory)) names.push_back(entry.path().filename().string());
  return names;
}

std::string read_bytes(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}

// Replaces the file through a new inode, as another process would, so no live mapping is touched.
void replace_file(const fs::path& path, const std::string& bytes) {
  const fs::path temporary = path.string() + ".replacement";
  std::ofstream(temporary, std::ios::binary) << bytes;
  fs::rename(temporary, path);
}

// A source the compiler rejects, and the message of the Error a compile throws (empty: none).
const std::string kBrokenSource = R"(extern "C" int broken_kernel(int x) { return x + ; })";
template <class Compile>
std::string compile_error(Compile&& compile) {
  try {
    compile();
  } catch (const kiln::Error& error) {
    return error.what();
  }
  return "";
}

}  // namespace

TEST_CASE("jit compiles a function that can be called", "[jit]") {
  FreshJit jit;
  auto module = compile_cached(kAdd1Source, 1);
  CHECK(call(*module, "add1", 41) == 42);
  CHECK(module->key().size() == 16);
  CHECK(stats().modules_compiled == 1);
  CHECK(stats().kernels_compiled == 1);
  CHECK(stats().compile_seconds > 0);
  CHECK(stats().disk_cache_hits == 0);
  CHECK(stats().memory_cache_hits == 0);

  CHECK(fs::path(module->path()) == jit.cache_dir / (module->key() + ".so"));
  CHECK(fs::exists(jit.cache_dir / (module->key() + ".so")));
  CHECK(fs::exists(jit.cache_dir / (module->key() + ".cc")));
  for (const std::string& name : file_names(jit.cache_dir)) CHECK(name.find(".tmp.") == std::string::npos);

  CHECK_THROWS_AS(module->symbol("no_such_kernel"), kiln::Error);
}

TEST_CASE("jit reuses a module from memory", "[jit]") {
  FreshJit jit;
  auto first = compile_cached(kAdd1Source, 1);
  auto second = compile_cached(kAdd1Source, 1);
  CHECK(first == second);
  CHECK(stats().memory_cache_hits == 1);
  CHECK(stats().modules_compiled == 1);

  auto other = compile_cached(kTimes2Source, 1);
  CHECK(other != first);
  CHECK(call(*other, "times2", 21) == 42);
  CHECK(stats().modules_compiled == 2);
}

TEST_CASE("jit reuses a module from disk in a fresh process", "[jit]") {
  FreshJit jit;
  std::string key = compile_cached(kAdd1Source, 1)->key();
  kiln::cpu::clear_memory_cache();

  auto reloaded = compile_cached(kAdd1Source, 1);
  CHECK(reloaded->key() == key);
  CHECK(call(*reloaded, "add1", 1) == 2);
  CHECK(stats().disk_cache_hits == 1);
  CHECK(stats().modules_compiled == 1);

  SECTION("a different cache directory compiles again") {
    FreshJit other_process;
    auto rebuilt = compile_cached(kAdd1Source, 1);
    CHECK(stats().modules_compiled == 1);
    CHECK(stats().disk_cache_hits == 0);
    CHECK(fs::exists(other_process.cache_dir / (key + ".so")));
    CHECK(call(*rebuilt, "add1", 2) == 3);
  }
}

TEST_CASE("jit rebuilds a damaged cache file", "[jit]") {
  FreshJit jit;
  auto module = compile_cached(kAdd1Source, 1);
  const fs::path so_path = jit.cache_dir / (module->key() + ".so");
  const std::string good_bytes = read_bytes(so_path);
  REQUIRE(good_bytes.size() > 1000);
  module.reset();
  kiln::cpu::clear_memory_cache();  // the module is now unloaded, as in a new process

  SECTION("garbage") { replace_file(so_path, "this is not a shared object\n"); }
  SECTION("truncated to half its size") { replace_file(so_path, good_bytes.substr(0, good_bytes.size() / 2)); }
  SECTION("empty") { replace_file(so_path, ""); }
  SECTION("a valid module of another key") {
    const std::string other_path = compile_cached(kTimes2Source, 1)->path();
    kiln::cpu::clear_memory_cache();
    replace_file(so_path, read_bytes(other_path));
  }

  const int64_t compiled_before = stats().modules_compiled;
  auto rebuilt = compile_cached(kAdd1Source, 1);
  CHECK(call(*rebuilt, "add1", 9) == 10);
  CHECK(stats().modules_compiled == compiled_before + 1);
  CHECK(stats().disk_cache_hits == 0);

  // The rebuilt file is whole again: a fresh process loads it from disk.
  rebuilt.reset();
  kiln::cpu::clear_memory_cache();
  auto reloaded = compile_cached(kAdd1Source, 1);
  CHECK(call(*reloaded, "add1", 0) == 1);
  CHECK(stats().disk_cache_hits == 1);
}

TEST_CASE("jit reports the compiler's output on a syntax error", "[jit]") {
  FreshJit jit;
  const std::string message = compile_error([] { compile_cached(kBrokenSource, 1); });
  REQUIRE_FALSE(message.empty());
  CHECK(message.find("error") != std::string::npos);
  CHECK(message.find("broken_kernel") != std::string::npos);  // the compiler quotes the bad line
  CHECK(message.find(jit.cache_dir.string()) != std::string::npos);
  CHECK(message.find(".cc") != std::string::npos);
  CHECK(stats().modules_compiled == 0);

  CHECK_THROWS_AS(compile_cached(kBrokenSource, 1), kiln::Error);  // a failure is not cached
  for (const std::string& name : file_names(jit.cache_dir)) CHECK(name.find(".so") == std::string::npos);
}

TEST_CASE("jit with disk_cache off leaves no shared object behind", "[jit]") {
  FreshJit jit;
  kiln::flags().disk_cache = false;
  auto module = compile_cached(kAdd1Source, 1);
  CHECK(call(*module, "add1", 4) == 5);
  CHECK_FALSE(fs::exists(module->path()));
  CHECK(file_names(jit.cache_dir).empty());
  CHECK(stats().modules_compiled == 1);

  CHECK(compile_cached(kAdd1Source, 1) == module);  // the memory cache still works
  CHECK(stats().memory_cache_hits == 1);
}

TEST_CASE("jit compiles once when threads ask for the same module", "[jit]") {
  FreshJit jit;
  constexpr int kThreads = 8;
  std::vector<std::shared_ptr<kiln::cpu::CompiledModule>> modules(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back([&modules, i] { modules[i] = compile_cached(kTimes2Source, 1); });
  for (auto& thread : threads) thread.join();
  for (const auto& module : modules) CHECK(module == modules[0]);
  CHECK(stats().modules_compiled == 1);
  CHECK(stats().memory_cache_hits == kThreads - 1);
}

TEST_CASE("hash_hex is 64-bit FNV-1a in 16 hex digits", "[jit]") {
  CHECK(kiln::jit::hash_hex("") == "cbf29ce484222325");
  CHECK(kiln::jit::hash_hex("a") == "af63dc4c8601ec8c");
  CHECK(kiln::jit::hash_hex("kernel a") != kiln::jit::hash_hex("kernel b"));
  CHECK(kiln::jit::hash_hex(std::string_view("a\0b", 3)) != kiln::jit::hash_hex("ab"));
}

TEST_CASE("jit compiles a module's units at once and caches every part", "[jit]") {
  FreshJit jit;
  const std::vector<std::string> units = {kAdd1Source, kTimes2Source};
  auto module = compile_cached(units, 2, 2);
  CHECK(call(*module, "add1", 1) == 2);
  CHECK(call(*module, "times2", 3) == 6);
  REQUIRE(module->paths().size() == 2);
  CHECK(stats().modules_compiled == 1);
  CHECK(stats().functions_compiled == 2);
  CHECK_THROWS_AS(module->symbol("no_such_kernel"), kiln::Error);

  kiln::cpu::clear_memory_cache();  // a new process: every part from the disk cache
  auto reloaded = compile_cached(units, 2, 2);
  CHECK(stats().modules_compiled == 1);
  CHECK(stats().disk_cache_hits == 1);
  CHECK(call(*reloaded, "times2", 4) == 8);

  // A changed unit, or the same code as one unit, is another module.
  const std::string times3 = R"(extern "C" int times2(int x) { return x * 3; })";
  auto changed = compile_cached(std::vector<std::string>{kAdd1Source, times3}, 2, 2);
  CHECK(changed->key() != module->key());
  CHECK(call(*changed, "times2", 4) == 12);
  CHECK(compile_cached(kAdd1Source + "\n" + kTimes2Source, 2)->key() != module->key());
  CHECK(stats().modules_compiled == 3);

  // A damaged part, then a missing one: the module is rebuilt, not half loaded.
  kiln::cpu::clear_memory_cache();
  replace_file(module->paths()[1], "not an ELF file");
  CHECK(call(*compile_cached(units, 2, 2), "times2", 5) == 10);
  CHECK(stats().modules_compiled == 4);
  kiln::cpu::clear_memory_cache();
  fs::remove(module->paths()[0]);
  CHECK(call(*compile_cached(units, 2, 2), "add1", 5) == 6);
  CHECK(stats().modules_compiled == 5);
  CHECK(stats().disk_cache_hits == 1);
}

TEST_CASE("jit reports the unit the compiler failed on and keeps no part", "[jit]") {
  FreshJit jit;
  const std::string message =
      compile_error([] { compile_cached(std::vector<std::string>{kAdd1Source, kBrokenSource}, 2, 2); });
  CHECK(message.find("broken_kernel") != std::string::npos);
  CHECK(message.find("-1.cc") != std::string::npos);  // the second unit's saved source
  CHECK(stats().modules_compiled == 0);
  for (const std::string& name : file_names(jit.cache_dir)) CHECK(name.find(".so") == std::string::npos);
}

TEST_CASE("jit keys modules by their code, leaving out note lines", "[jit]") {
  FreshJit jit;
  const std::string body = "extern \"C\" int add1(int x) { return x + 1; }\n";
  auto first = compile_cached(std::string(kiln::cpu::kNotePrefix) + "Add [384] (kernels: k0)\n" + body, 1);
  auto second = compile_cached(std::string(kiln::cpu::kNotePrefix) + "Add [12, 10] (kernels: k0)\n" + body, 1);
  CHECK(first == second);
  CHECK(stats().modules_compiled == 1);
  CHECK(call(*second, "add1", 41) == 42);
  // A plain comment is part of the key; so is a note that a backslash continues, or that
  // continues a line (it would splice the following lines otherwise).
  auto commented = compile_cached("// Add [384]\n" + body, 1);
  CHECK(commented != first);
  auto spliced = compile_cached("#define ONE 1 \\\n" + std::string(kiln::cpu::kNotePrefix) + "note\n" + body, 1);
  CHECK(spliced->key() != first->key());
  CHECK(call(*spliced, "add1", 1) == 2);
  CHECK(stats().modules_compiled == 3);
}
