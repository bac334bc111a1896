#include "core/error.h"

#include <cstring>

namespace kiln::detail {

void throw_error(const char* file, int line, std::string_view op, const std::string& message) {
  const char* base = std::strrchr(file, '/');
  throw Error(fmt::format("kiln::{}: {} [{}:{}]", op, message, base ? base + 1 : file, line));
}

}  // namespace kiln::detail
