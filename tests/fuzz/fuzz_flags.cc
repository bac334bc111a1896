// libFuzzer target: the text of kiln's flags. The input is "name=value" (the name up to the
// first '='), applied three ways: Flags::set, the environment (KILN_<NAME> read by
// Flags::from_environment), and, for the whole input, the size and budget parsers
// (parse_size, memory::budget_bytes) that KILN_MEMORY_LIMIT and KILN_MEMORY_BUDGET go through.
// Seeds: corpus/flags.
#include <kiln/kiln.h>

#include <algorithm>
#include <cctype>
#include <string>

#include "memory/recompute.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln;
  const std::string text(reinterpret_cast<const char*>(data), size);
  const size_t eq = text.find('=');
  const std::string name = text.substr(0, eq);
  const std::string value = eq == std::string::npos ? "" : text.substr(eq + 1);

  fuzz::expect_only_kiln_errors([&] {
    FlagsGuard guard;
    flags().set(name, value);
  });
  // Through the environment for the flags' own names only: glibc keeps every string setenv was
  // given, and random names would grow the process without bound. A value with a NUL is not
  // something a shell can set.
#define KILN_FUZZ_FLAG_NAME(type, flag, def, doc) #flag,
  static const std::string kNames[] = {KILN_FLAG_LIST(KILN_FUZZ_FLAG_NAME)};
#undef KILN_FUZZ_FLAG_NAME
  if (std::find(std::begin(kNames), std::end(kNames), name) != std::end(kNames) &&
      value.find('\0') == std::string::npos) {
    std::string variable = "KILN_";
    for (char c : name) variable += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    ::setenv(variable.c_str(), value.c_str(), 1);
    fuzz::expect_only_kiln_errors([&] { Flags::from_environment(); });
    ::unsetenv(variable.c_str());
  }
  fuzz::expect_only_kiln_errors([&] {
    if (parse_size(text, "fuzz") < 0) {
      std::fprintf(stderr, "fuzz: parse_size gave a negative size\n");
      std::abort();
    }
  });
  fuzz::expect_only_kiln_errors([&] {
    for (int64_t arena : {int64_t{1}, int64_t{1} << 40})
      if (memory::budget_bytes(text, arena) < 0) {
        std::fprintf(stderr, "fuzz: budget_bytes gave a negative budget\n");
        std::abort();
      }
  });
  return 0;
}
