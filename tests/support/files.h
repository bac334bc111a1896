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

// The same file without entry `name`: its bytes are cut out of the data section and later
// entries' offsets moved down, so the file stays well formed (entries tile the data section).
inline std::vector<char> without_entry(const std::vector<char>& original, const std::string& name) {
  nlohmann::json header = header_of(original);
  const size_t begin = header[name]["data_offsets"][0], end = header[name]["data_offsets"][1];
  header.erase(name);
  for (auto& [key, info] : header.items()) {
    if (key == "__metadata__") continue;
    for (auto& offset : info["data_offsets"])
      if (offset.get<size_t>() >= end) offset = offset.get<size_t>() - (end - begin);
  }
  uint64_t n = 0;
  std::memcpy(&n, original.data(), 8);
  std::vector<char> data(original.begin() + 8 + static_cast<std::ptrdiff_t>(n), original.end());
  data.erase(data.begin() + static_cast<std::ptrdiff_t>(begin), data.begin() + static_cast<std::ptrdiff_t>(end));
  std::vector<char> out = with_header(header, original);
  out.resize(out.size() - (original.size() - 8 - n));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// The same file with one more entry `name`, a copy of entry `from` whose bytes are appended to
// the data section.
inline std::vector<char> with_entry_copy(const std::vector<char>& original, const std::string& name,
                                         const std::string& from) {
  nlohmann::json header = header_of(original);
  uint64_t n = 0;
  std::memcpy(&n, original.data(), 8);
  const size_t data_size = original.size() - 8 - n;
  const size_t begin = header[from]["data_offsets"][0], end = header[from]["data_offsets"][1];
  header[name] = header[from];
  header[name]["data_offsets"] = {data_size, data_size + (end - begin)};
  std::vector<char> out = with_header(header, original);
  const auto data = original.begin() + 8 + static_cast<std::ptrdiff_t>(n);
  out.insert(out.end(), data + static_cast<std::ptrdiff_t>(begin), data + static_cast<std::ptrdiff_t>(end));
  return out;
}

}  // namespace kiln::testing
