// The kernel cache under faults: a cache directory that cannot be created or written (a full
// disk) costs the disk copy only, with one warning; two processes filling one empty cache
// directory at the same moment both succeed, and a third finds everything they compiled.
// The processes are this test binary again, running the hidden case "jit cache child".
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <kiln/kiln.h>

#include "backends/cpu/compiler.h"
#include "jit/disk_cache.h"
#include "tests/support/child_process.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

// Graph "s" both racers compute (the same module, written by both at once), and "a" and "b",
// one each. Each is checked against plain double arithmetic.
void run_graph(char which) {
  std::vector<double> values(300);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.01 * static_cast<double>(i) - 1.0;
  Tensor x = from_doubles(values, {20, 15}, DType::Float64);
  Tensor got;
  std::vector<double> want;
  switch (which) {
    case 's':
      got = x * x + 2.0;
      for (double v : values) want.push_back(v * v + 2.0);
      break;
    case 'a':
      got = sum(sin(x) * 3.0 + 1.0, {1});
      for (int r = 0; r < 20; ++r) {
        double s = 0;
        for (int c = 0; c < 15; ++c) s += std::sin(values[r * 15 + c]) * 3.0 + 1.0;
        want.push_back(s);
      }
      break;
    default:
      got = exp(x * 0.5) - x;
      for (double v : values) want.push_back(std::exp(v * 0.5) - v);
  }
  std::vector<double> result = got.to_doubles();
  REQUIRE(result.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) REQUIRE(result[i] == Approx(want[i]).epsilon(1e-12));
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

std::vector<std::string> names_in(const fs::path& directory) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(directory)) names.push_back(entry.path().filename().string());
  return names;
}

fs::path fresh_directory(const char* name) {
  std::string pattern = (fs::temp_directory_path() / (std::string(name) + "-XXXXXX")).string();
  REQUIRE(mkdtemp(pattern.data()) != nullptr);
  return pattern;
}

}  // namespace

// Computes the graphs named in KILN_TEST_GRAPHS (after reading descriptor 3 to its end, when
// KILN_TEST_WAIT is set: a start line for racers), then checks what KILN_TEST_EXPECT says:
// "race" (every module compiled here or found on disk, where the other racer put it first), "hit"
// (every module from the disk cache) or "unwritable" (every module compiled in a temporary
// directory).
TEST_CASE("jit cache child", "[.][fault-child]") {
  const char* graphs = std::getenv("KILN_TEST_GRAPHS");
  const char* expect = std::getenv("KILN_TEST_EXPECT");
  if (graphs == nullptr || expect == nullptr) return;  // run by hand: nothing to do
  if (std::getenv("KILN_TEST_WAIT") != nullptr) {
    char byte;
    while (::read(3, &byte, 1) > 0) {
    }
  }
  for (const char* g = graphs; *g != '\0'; ++g) run_graph(*g);
  const jit::JitStats& s = jit::stats();
  const int64_t modules = static_cast<int64_t>(std::string(graphs).size());
  INFO("compiled " << s.modules_compiled << ", disk hits " << s.disk_cache_hits << ", unwritable "
                   << s.cache_write_failures);
  if (std::string(expect) == "race") {
    CHECK(s.modules_compiled + s.disk_cache_hits == modules);
    CHECK(s.modules_compiled >= 1);  // its own module at least
    CHECK(s.cache_write_failures == 0);
  } else if (std::string(expect) == "hit") {
    CHECK(s.modules_compiled == 0);
    CHECK(s.disk_cache_hits == modules);
  } else {
    CHECK(s.modules_compiled == modules);
    CHECK(s.cache_write_failures == modules);
  }
}

TEST_CASE("a kernel cache directory that cannot be created costs the disk cache only, with one warning",
          "[jit][cache][faults]") {
  // Under a regular file no directory can be made, for root either (permission bits would not
  // stop root).
  const fs::path scratch = fresh_directory("kiln-unwritable");
  { std::ofstream(scratch / "a-file") << "not a directory"; }
  const std::string log = (scratch / "child.log").string();
  pid_t child = testing::spawn_test_child(
      "jit cache child",
      {"KILN_USE_CUDA=0", "KILN_CACHE_DIR=" + (scratch / "a-file" / "cache").string(), "KILN_TEST_GRAPHS=sab",
       "KILN_TEST_EXPECT=unwritable"},
      -1, log);
  REQUIRE(child > 0);
  const int status = testing::wait_child(child);
  const std::string output = read_text(log);
  INFO(output);
  CHECK(status == 0);
  CHECK(count(output, "warning: the kernel cache cannot be written") == 1);  // three modules, one warning
  CHECK(count(output, "a-file/cache") >= 1);                                  // naming the directory
  fs::remove_all(scratch);
}

TEST_CASE("a full disk during a kernel-cache write falls back to a module in memory", "[jit][cache][faults]") {
  const fs::path directory = fresh_directory("kiln-full-disk");
  {
    FlagsGuard guard;
    flags().use_cuda = false;
    flags().cache_dir = directory.string();
    cpu::clear_memory_cache();
    jit::clear_plan_cache();
    const int64_t failures = jit::stats().cache_write_failures, compiled = jit::stats().modules_compiled;
    {
      jit::SimulateFullCacheDisk full;
      run_graph('a');
    }
    CHECK(jit::stats().cache_write_failures == failures + 1);
    CHECK(jit::stats().modules_compiled == compiled + 1);
    CHECK(names_in(directory).empty());  // no half-written entry, no temporary left
    // Space again: the next module goes to the disk as usual.
    run_graph('b');
    CHECK(jit::stats().cache_write_failures == failures + 1);
    bool written = false;
    for (const std::string& name : names_in(directory)) {
      CHECK(name.find(".tmp") == std::string::npos);
      written = written || name.ends_with(".so");
    }
    CHECK(written);
    cpu::clear_memory_cache();
    jit::clear_plan_cache();
  }
  fs::remove_all(directory);
}

TEST_CASE("two processes filling one empty cache directory both succeed, and a third hits for both",
          "[jit][cache][faults]") {
  const fs::path directory = fresh_directory("kiln-race");
  const std::string cache = "KILN_CACHE_DIR=" + directory.string();
  // Both racers wait at a start line (a pipe that closes), then compile "s" (the same module, so
  // both write the same entry at once) and a module of their own.
  int start[2];
  REQUIRE(::pipe2(start, O_CLOEXEC) == 0);
  testing::ChildGuard first{testing::spawn_test_child(
      "jit cache child", {"KILN_USE_CUDA=0", cache, "KILN_TEST_GRAPHS=sa", "KILN_TEST_EXPECT=race", "KILN_TEST_WAIT=1"},
      start[0])};
  testing::ChildGuard second{testing::spawn_test_child(
      "jit cache child", {"KILN_USE_CUDA=0", cache, "KILN_TEST_GRAPHS=sb", "KILN_TEST_EXPECT=race", "KILN_TEST_WAIT=1"},
      start[0])};
  ::close(start[0]);
  REQUIRE(first.pid > 0);
  REQUIRE(second.pid > 0);
  ::close(start[1]);  // go
  CHECK(testing::wait_child(first.pid) == 0);
  CHECK(testing::wait_child(second.pid) == 0);
  first.pid = second.pid = -1;
  for (const std::string& name : names_in(directory)) CHECK(name.find(".tmp") == std::string::npos);
  // A third process compiles nothing: every module either racer made is on disk, whole.
  testing::ChildGuard third{
      testing::spawn_test_child("jit cache child", {"KILN_USE_CUDA=0", cache, "KILN_TEST_GRAPHS=sab", "KILN_TEST_EXPECT=hit"})};
  REQUIRE(third.pid > 0);
  CHECK(testing::wait_child(third.pid) == 0);
  third.pid = -1;
  fs::remove_all(directory);
}
