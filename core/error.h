// kiln::Error and the one check macro every user-facing validation goes through.
// A failed check names the op, the shapes involved and a hint, and throws; it never aborts.
#pragma once
#include <fmt/format.h>
#include <stdexcept>
#include <string>

namespace kiln {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
[[noreturn]] void throw_error(const char* file, int line, std::string_view op, const std::string& message);
}  // namespace detail

}  // namespace kiln

// KILN_CHECK(cond, "op", "format {}", args...): throws kiln::Error "op: message (file:line)".
#define KILN_CHECK(cond, op, ...)                                                          \
  do {                                                                                     \
    if (!(cond)) ::kiln::detail::throw_error(__FILE__, __LINE__, op, fmt::format(__VA_ARGS__)); \
  } while (0)

#define KILN_FAIL(op, ...) ::kiln::detail::throw_error(__FILE__, __LINE__, op, fmt::format(__VA_ARGS__))
