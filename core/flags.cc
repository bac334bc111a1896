#include "core/flags.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>

#include "core/error.h"

namespace kiln {

namespace {

std::string env_name(std::string_view name) {
  std::string s = "KILN_";
  for (char c : name) s += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

[[noreturn]] void bad_value(std::string_view name, const std::string& value, std::string_view expected) {
  KILN_FAIL("flags", "bad value '{}' for flag {} ({}); expected {}", value, name, env_name(name), expected);
}

void parse_into(bool& out, std::string_view name, const std::string& v) {
  if (v == "1" || v == "true" || v == "on" || v == "yes") out = true;
  else if (v == "0" || v == "false" || v == "off" || v == "no") out = false;
  else bad_value(name, v, "one of 1/0, true/false, on/off, yes/no");
}
template <typename Int>
void parse_int(Int& out, std::string_view name, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0) bad_value(name, v, "an integer");
  // An int flag given 4294967296 would otherwise wrap to 0 without a word.
  if (x < std::numeric_limits<Int>::min() || x > std::numeric_limits<Int>::max())
    bad_value(name, v, fmt::format("an integer in [{}, {}]", std::numeric_limits<Int>::min(),
                                   std::numeric_limits<Int>::max()));
  out = static_cast<Int>(x);
}
void parse_into(int& out, std::string_view name, const std::string& v) { parse_int(out, name, v); }
void parse_into(int64_t& out, std::string_view name, const std::string& v) { parse_int(out, name, v); }
void parse_into(double& out, std::string_view name, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || errno != 0) bad_value(name, v, "a number");
  out = x;
}
void parse_into(std::string& out, std::string_view, const std::string& v) { out = v; }
void parse_into(MemoryPool& out, std::string_view name, const std::string& v) {
  if (v == "none") out = MemoryPool::None;
  else if (v == "pool") out = MemoryPool::Pool;
  else bad_value(name, v, "none or pool");
}
void parse_into(AmpMode& out, std::string_view name, const std::string& v) {
  if (v == "none" || v == "0" || v == "off") out = AmpMode::None;
  else if (v == "fp16" || v == "float16") out = AmpMode::Float16;
  else if (v == "bf16" || v == "bfloat16") out = AmpMode::BFloat16;
  else bad_value(name, v, "none, fp16 or bf16");
}

std::string show(bool v) { return v ? "1" : "0"; }
std::string show(int v) { return std::to_string(v); }
std::string show(int64_t v) { return std::to_string(v); }
std::string show(double v) { return fmt::format("{}", v); }
std::string show(const std::string& v) { return v.empty() ? "\"\"" : v; }
std::string show(MemoryPool v) { return v == MemoryPool::None ? "none" : "pool"; }
std::string show(AmpMode v) { return v == AmpMode::None ? "none" : v == AmpMode::Float16 ? "fp16" : "bf16"; }

// Checks values that have a grammar beyond their C++ type.
void validate(const Flags& f) {
  if (f.log < 0 || f.log > 3) bad_value("log", std::to_string(f.log), "0..3");
  if (f.num_threads < 0) bad_value("num_threads", std::to_string(f.num_threads), "a count >= 0");
  if (f.compile_jobs < 1) bad_value("compile_jobs", std::to_string(f.compile_jobs), "a count >= 1");
  if (f.quantize_bits != 8 && f.quantize_bits != 4)
    bad_value("quantize_bits", std::to_string(f.quantize_bits), "8 or 4");
  if (!f.compress_activations.empty() && f.compress_activations != "int8")
    bad_value("compress_activations", f.compress_activations, "int8 (or unset)");
  if (f.offload != "auto" && f.offload != "off" && f.offload != "all")
    bad_value("offload", f.offload, "auto (offload what a memory budget needs, on a GPU), off or all");
  if (f.recompute != "cheap" && f.recompute != "elementwise" && f.recompute != "off")
    bad_value("recompute", f.recompute, "cheap, elementwise or off");
  if (!f.memory_limit.empty()) parse_size(f.memory_limit, "memory_limit");
  // Positive and finite; buckets under a byte would mean one all-reduce per element.
  if (!(f.bucket_mb * 1048576.0 >= 1.0) || !std::isfinite(f.bucket_mb))
    bad_value("bucket_mb", show(f.bucket_mb), "a positive size in MiB (e.g. 25, or 0.0001 for one tensor per bucket)");
  if (!(f.collective_timeout > 0) || !std::isfinite(f.collective_timeout))
    bad_value("collective_timeout", show(f.collective_timeout), "a positive number of seconds");
  if (!f.memory_budget.empty()) {
    char* end = nullptr;
    double frac = std::strtod(f.memory_budget.c_str(), &end);
    bool is_fraction = *end == '\0' && f.memory_budget.find('.') != std::string::npos;
    if (is_fraction) {
      if (!(frac > 0 && frac <= 1)) bad_value("memory_budget", f.memory_budget, "a fraction in (0, 1] or a size");
    } else {
      parse_size(f.memory_budget, "memory_budget");
    }
  }
}

std::map<std::string, std::string>& env_values() {
  static std::map<std::string, std::string> values;
  return values;
}

Flags read_environment() {
  Flags f;
  auto& seen = env_values();
#define KILN_READ_FLAG(type, name, def, doc)                   \
  if (const char* v = std::getenv(env_name(#name).c_str())) { \
    parse_into(f.name, #name, v);                              \
    seen[#name] = v;                                           \
  }
  KILN_FLAG_LIST(KILN_READ_FLAG)
#undef KILN_READ_FLAG
  validate(f);
  return f;
}

}  // namespace

int64_t parse_size(const std::string& text, const char* what) {
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  std::string unit(static_cast<const char*>(end), text.c_str() + text.size());  // to the end: a NUL inside is no unit
  static const std::map<std::string, double> units = {
      {"", 1},        {"B", 1},         {"K", 1024.0},       {"KB", 1e3},           {"KiB", 1024.0},
      {"M", 1 << 20}, {"MB", 1e6},      {"MiB", 1 << 20},    {"G", 1 << 30},         {"GB", 1e9},
      {"GiB", 1 << 30}, {"T", 1099511627776.0}, {"TB", 1e12}, {"TiB", 1099511627776.0}};
  auto it = units.find(unit);
  KILN_CHECK(end != text.c_str() && it != units.end() && v >= 0, "flags",
             "cannot read '{}' as a size for {}; write e.g. 512MiB, 2GB or a byte count", text, what);
  // Under 2^63 bytes, so the conversion is defined ("1e300", "inf" and 9EiB are not sizes).
  const double bytes = v * it->second;
  KILN_CHECK(bytes < 0x1p63, "flags", "size '{}' for {} is over 2^63 bytes", text, what);
  return static_cast<int64_t>(bytes);
}

Flags Flags::from_environment() { return read_environment(); }

Flags& flags() {
  static Flags f = read_environment();
  return f;
}

void Flags::set(const std::string& name, const std::string& value) {
  Flags copy = *this;
  bool known = false;
#define KILN_SET_FLAG(type, fname, def, doc) \
  if (name == #fname) {                      \
    parse_into(copy.fname, #fname, value);   \
    known = true;                            \
  }
  KILN_FLAG_LIST(KILN_SET_FLAG)
#undef KILN_SET_FLAG
  KILN_CHECK(known, "flags", "unknown flag '{}'; kiln::flags().print() lists them", name);
  validate(copy);
  *this = copy;
}

std::string Flags::to_string() const {
  std::string out = "kiln flags:\n";
  const Flags defaults;
#define KILN_PRINT_FLAG(type, name, def, doc)                                                      \
  {                                                                                                \
    std::string source = "default";                                                                \
    auto env = env_values().find(#name);                                                           \
    if (show(name) != show(defaults.name))                                                         \
      source = env != env_values().end() && show(name) == show([&] { type t{}; parse_into(t, #name, env->second); return t; }()) ? "env" : "code"; \
    out += fmt::format("  {:<14} = {:<10} {:<8} {:<20} {}\n", #name, show(name), source, env_name(#name), doc); \
  }
  KILN_FLAG_LIST(KILN_PRINT_FLAG)
#undef KILN_PRINT_FLAG
  return out;
}

void Flags::print() const { fmt::print("{}", to_string()); }

FlagsGuard::FlagsGuard() : saved_(flags()) {}
FlagsGuard::~FlagsGuard() { flags() = saved_; }

}  // namespace kiln
