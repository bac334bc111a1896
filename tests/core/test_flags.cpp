// Flags: defaults, environment parsing, scoped guards, printing.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <cstdlib>
#include <string>

#include "memory/recompute.h"

using namespace kiln;

TEST_CASE("flags read from the environment and reject bad values", "[flags]") {
  setenv("KILN_MEMORY_POOL", "none", 1);
  setenv("KILN_LOG", "2", 1);
  Flags f = Flags::from_environment();
  CHECK(f.memory_pool == MemoryPool::None);
  CHECK(f.log == 2);
  setenv("KILN_MEMORY_POOL", "bogus", 1);
  REQUIRE_THROWS_WITH(Flags::from_environment(), Catch::Contains("KILN_MEMORY_POOL") && Catch::Contains("bogus"));
  unsetenv("KILN_MEMORY_POOL");
  setenv("KILN_LOG", "7", 1);
  REQUIRE_THROWS_WITH(Flags::from_environment(), Catch::Contains("KILN_LOG"));
  setenv("KILN_LOG", "abc", 1);
  REQUIRE_THROWS_AS(Flags::from_environment(), Error);
  unsetenv("KILN_LOG");
  setenv("KILN_MEMORY_BUDGET", "12 parsecs", 1);
  REQUIRE_THROWS_WITH(Flags::from_environment(), Catch::Contains("memory_budget"));
  setenv("KILN_MEMORY_BUDGET", "0.5", 1);
  CHECK(Flags::from_environment().memory_budget == "0.5");
  unsetenv("KILN_MEMORY_BUDGET");
}

TEST_CASE("a FlagsGuard restores every flag", "[flags]") {
  bool lazy = flags().lazy;
  int log = flags().log;
  {
    FlagsGuard guard;
    flags().lazy = !lazy;
    flags().set("log", "3");
    CHECK(flags().log == 3);
  }
  CHECK(flags().lazy == lazy);
  CHECK(flags().log == log);
  REQUIRE_THROWS_WITH(flags().set("no_such_flag", "1"), Catch::Contains("no_such_flag"));
  REQUIRE_THROWS_AS(flags().set("lazy", "maybe"), Error);
  CHECK(flags().lazy == lazy);
}

TEST_CASE("flags print every field with its variable", "[flags]") {
  FlagsGuard guard;
  flags().seed = 42;
  std::string text = flags().to_string();
  CHECK_THAT(text, Catch::Contains("KILN_LAZY") && Catch::Contains("KILN_MEMORY_POOL") && Catch::Contains("KILN_SEED"));
  CHECK_THAT(text, Catch::Contains("42") && Catch::Contains("code"));
}

TEST_CASE("sizes parse with units", "[flags]") {
  CHECK(parse_size("512MiB", "x") == 512ll << 20);
  CHECK(parse_size("2GB", "x") == 2000000000ll);
  CHECK(parse_size("4096", "x") == 4096);
  REQUIRE_THROWS_AS(parse_size("lots", "x"), Error);
}

// Flags whose values have a grammar: a bad value fails wherever it comes from, naming the variable.
TEST_CASE("flags with a grammar refuse bad values from the environment and set()", "[flags]") {
  // From the environment (what flags() reads at first use).
  setenv("KILN_AMP", "bf16", 1);
  CHECK(Flags::from_environment().amp == AmpMode::BFloat16);
  setenv("KILN_AMP", "fp8", 1);
  REQUIRE_THROWS_WITH(Flags::from_environment(), Catch::Contains("KILN_AMP") && Catch::Contains("none, fp16 or bf16"));
  setenv("KILN_AMP", "none", 1);
  CHECK(Flags::from_environment().amp == AmpMode::None);
  unsetenv("KILN_AMP");
  setenv("KILN_QUANTIZE", "1", 1);
  setenv("KILN_QUANTIZE_BITS", "4", 1);
  CHECK(Flags::from_environment().quantize);
  CHECK(Flags::from_environment().quantize_bits == 4);
  setenv("KILN_QUANTIZE_BITS", "6", 1);  // not a width kiln quantizes to
  REQUIRE_THROWS_WITH(Flags::from_environment(), Catch::Contains("KILN_QUANTIZE_BITS") && Catch::Contains("8 or 4"));
  unsetenv("KILN_QUANTIZE_BITS");
  unsetenv("KILN_QUANTIZE");
  setenv("KILN_COMPRESS_ACTIVATIONS", "int8", 1);
  CHECK(Flags::from_environment().compress_activations == "int8");
  setenv("KILN_COMPRESS_ACTIVATIONS", "int3", 1);
  REQUIRE_THROWS_WITH(Flags::from_environment(), Catch::Contains("KILN_COMPRESS_ACTIVATIONS") && Catch::Contains("int8"));
  unsetenv("KILN_COMPRESS_ACTIVATIONS");

  // From set(): refused, and the flags are left as they were.
  REQUIRE_THROWS_WITH(flags().set("compress_activations", "int4"), Catch::Contains("KILN_COMPRESS_ACTIVATIONS"));
  CHECK(flags().compress_activations.empty());
}

// Found by tests/fuzz/fuzz_flags (tests/fuzz/regressions/flags): sizes and budgets past int64
// were converted anyway (undefined behaviour), int flags wrapped, a NUL hid the rest of a size.
TEST_CASE("sizes, budgets and int flags out of range are errors", "[flags]") {
  CHECK_THROWS_WITH(parse_size("1e300", "memory_limit"), Catch::Contains("over 2^63 bytes"));
  CHECK_THROWS_WITH(parse_size("inf", "memory_limit"), Catch::Contains("over 2^63 bytes"));
  CHECK_THROWS_WITH(parse_size("9000000TiB", "memory_limit"), Catch::Contains("over 2^63 bytes"));
  CHECK(parse_size("8000000TB", "memory_limit") == int64_t{8000000000000000000});
  CHECK_THROWS_AS(parse_size(std::string("12\0GiB", 6), "memory_limit"), Error);
  CHECK_THROWS_WITH(memory::budget_bytes("66666666666661.", 1 << 20), Catch::Contains("fraction in (0, 1]"));
  CHECK(memory::budget_bytes("0.5", 1 << 20) == 1 << 19);
  FlagsGuard guard;
  const int log = flags().log;
  CHECK_THROWS_WITH(flags().set("log", "4294967296"), Catch::Contains("an integer in [-2147483648, 2147483647]"));
  CHECK_THROWS_WITH(flags().set("compile_jobs", "-4294967295"), Catch::Contains("KILN_COMPILE_JOBS"));
  CHECK(flags().log == log);  // unchanged, not wrapped to 0
}
