// Test helpers for checkpoint files: per-process temporary paths, raw bytes in and out, and
// safetensors headers to read or rewrite (for the corrupt-file tests).
#pragma once
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <unistd.h>

namespace kiln::testing {

// A path in the temporary directory, unique to this process: prefix_<pid>_name.
inline std::string temp_path(const std::string& prefix, const std::string& name) {
  return (std::filesystem::temp_directory_path() / (prefix + "_" + std::to_string(::getpid()) + "_" + name)).string();
}

inline std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_bytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The JSON header of a safetensors file's bytes.
inline nlohmann::json header_of(const std::vector<char>& bytes) {
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  return nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n));
}

// The same file with its header replaced by `header` (the data section unchanged).
inline std::vector<char> with_header(const nlohmann::json& header, const std::vector<char>& original) {
  uint64_t n = 0;
  std::memcpy(&n, original.data(), 8);
  std::string text = header.dump();
  uint64_t len = text.size();
  std::string out(reinterpret_cast<const char*>(&len), 8);
  out += text;
  out.append(original.begin() + 8 + static_cast<std::ptrdiff_t>(n), original.end());
  return {out.begin(), out.end()};
}

}  // namespace kiln::testing
