// safetensors reading and writing. See serialize.h.
#include "nn/serialize.h"

#include <algorithm>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <fcntl.h>
#include <unistd.h>

#include "core/autograd.h"
#include "core/shape.h"
#include "ops/ops.h"

namespace kiln::nn {

static_assert(std::endian::native == std::endian::little, "safetensors stores little-endian bytes");

namespace {

struct DTypeTag {
  DType dtype;
  const char* tag;
};
constexpr DTypeTag kTags[] = {{DType::Float32, "F32"}, {DType::Float64, "F64"}, {DType::Float16, "F16"},
                              {DType::BFloat16, "BF16"}, {DType::Int64, "I64"}, {DType::Int32, "I32"},
                              {DType::Int8, "I8"},       {DType::UInt8, "U8"},  {DType::Bool, "BOOL"}};

// Writes `pieces` to `path` so that a crash at any moment (kill -9, power loss) leaves either the
// previous file or the whole new one: a temporary name in the same directory, fsync'ed before it
// is renamed over `path`, then the directory fsync'ed so that the rename itself is on disk.
// Temporaries of `path` left by saving processes that were killed (their pid is gone): removed, so
// that crashes do not pile up copies of a checkpoint beside it.
void remove_stale_temporaries(const std::string& path) {
  const std::filesystem::path p(path);
  const std::string prefix = p.filename().string() + ".tmp.";
  std::error_code ec;
  const std::filesystem::path dir = p.parent_path().empty() ? std::filesystem::path(".") : p.parent_path();
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + prefix.size(), &end, 10);
    if (pid <= 0 || *end != '\0' || pid == ::getpid()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) std::filesystem::remove(entry.path(), ec);
  }
}

void write_replacing(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces) {
  remove_stale_temporaries(path);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  KILN_CHECK(fd >= 0, "save", "cannot write '{}': {}", tmp, std::strerror(errno));
  auto fail = [&](const char* what) {
    const int error = errno;
    ::close(fd);
    std::remove(tmp.c_str());
    KILN_FAIL("save", "{} '{}' failed: {}", what, tmp, std::strerror(error));
  };
  for (auto [data, bytes] : pieces) {
    const char* at = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t written = ::write(fd, at, bytes);
      if (written < 0 && errno == EINTR) continue;
      if (written <= 0) fail("writing");
      at += written;
      bytes -= static_cast<size_t>(written);
    }
  }
  if (::fsync(fd) != 0) fail("flushing");
  if (::close(fd) != 0) {
    const int error = errno;
    std::remove(tmp.c_str());
    KILN_FAIL("save", "closing '{}' failed: {}", tmp, std::strerror(error));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::remove(tmp.c_str());
    KILN_FAIL("save", "cannot rename '{}' to '{}': {}", tmp, path, ec.message());
  }
  // Without this a power loss may forget the rename (the data is safe either way). Some file
  // systems cannot fsync a directory; the file is already whole then, so that is no error.
  std::string directory = std::filesystem::path(path).parent_path().string();
  if (directory.empty()) directory = ".";
  if (const int dir = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

// Builds a realized tensor of `dtype` from raw little-endian bytes, bit-exactly.
Tensor tensor_from_bytes(const char* bytes, DType dtype, const Shape& shape) {
  int64_t n = numel(shape);
  auto copy_as = [&]<typename T>(T) {
    std::vector<T> values(n);
    if (n > 0) std::memcpy(values.data(), bytes, n * sizeof(T));
    return from_vector<T>(values, shape);
  };
  switch (dtype) {
    case DType::Float32: return copy_as(float{});
    case DType::Float64: return copy_as(double{});
    case DType::Int64: return copy_as(int64_t{});
    case DType::Int32: return copy_as(int32_t{});
    case DType::Int8: return copy_as(int8_t{});
    case DType::UInt8: return copy_as(uint8_t{});
    default: {  // bool and the 16-bit floats convert to double and back exactly
      std::vector<double> values(n);
      for (int64_t i = 0; i < n; ++i) values[i] = load_as_double(bytes, dtype, i);
      return from_doubles(values, shape, dtype);
    }
  }
}

struct Entry {
  DType dtype;
  Shape shape;
  size_t begin, end;
};

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KILN_CHECK(in.good(), "load", "cannot open '{}'", path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return bytes;
}

// Parses and checks the whole header against the file size; returns entries and data start, and
// the "__metadata__" strings into `metadata` when given.
std::map<std::string, Entry> parse_header(const std::vector<char>& file, const std::string& path, size_t& data_start,
                                          Metadata* metadata = nullptr) {
  KILN_CHECK(file.size() >= 8, "load", "'{}' is truncated: {} bytes, too short for a safetensors header", path,
             file.size());
  uint64_t header_len = 0;
  std::memcpy(&header_len, file.data(), 8);
  KILN_CHECK(header_len <= file.size() - 8, "load", "'{}' is truncated or corrupt: header of {} bytes, file of {}",
             path, header_len, file.size());
  data_start = 8 + header_len;
  size_t data_size = file.size() - data_start;
  nlohmann::json header = nlohmann::json::parse(file.begin() + 8, file.begin() + data_start, nullptr, false);
  KILN_CHECK(!header.is_discarded() && header.is_object(), "load", "'{}' has a corrupt header (not a JSON object)",
             path);
  std::map<std::string, Entry> entries;
  for (auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      KILN_CHECK(info.is_object(), "load", "'{}' has a corrupt header: __metadata__ is not an object", path);
      for (auto& [key, value] : info.items()) {
        KILN_CHECK(value.is_string(), "load", "'{}': metadata '{}' is not a string", path, key);
        if (metadata) (*metadata)[key] = value.get<std::string>();
      }
      continue;
    }
    KILN_CHECK(info.is_object() && info.contains("dtype") && info.contains("shape") && info.contains("data_offsets"),
               "load", "'{}': entry '{}' lacks dtype, shape or data_offsets", path, name);
    KILN_CHECK(info["dtype"].is_string(), "load", "'{}': entry '{}' has a non-string dtype", path, name);
    Entry e;
    const std::string tag = info["dtype"].get<std::string>();
    const auto known = std::find_if(std::begin(kTags), std::end(kTags), [&](const auto& t) { return tag == t.tag; });
    KILN_CHECK(known != std::end(kTags), "load", "'{}': entry '{}' has dtype '{}', which kiln cannot hold", path, name,
               tag);
    e.dtype = known->dtype;
    const auto& shape = info["shape"];
    KILN_CHECK(shape.is_array(), "load", "'{}': entry '{}' has a shape that is not a list", path, name);
    for (const auto& d : shape) {
      KILN_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0, "load", "'{}': entry '{}' has a bad dimension {}",
                 path, name, d.dump());
      e.shape.push_back(d.get<int64_t>());
    }
    const auto& off = info["data_offsets"];
    KILN_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
               "load", "'{}': entry '{}' has malformed data_offsets", path, name);
    e.begin = off[0].get<size_t>();
    e.end = off[1].get<size_t>();
    KILN_CHECK(e.begin <= e.end && e.end <= data_size, "load",
               "'{}' is truncated or corrupt: '{}' needs bytes [{}, {}) of {}", path, name, e.begin, e.end, data_size);
    // Checked products: a shape of 2^62 float32 elements would wrap the byte count to 0.
    size_t expected = dtype_size(e.dtype);
    for (int64_t d : e.shape)
      KILN_CHECK(!__builtin_mul_overflow(expected, static_cast<size_t>(d), &expected), "load",
                 "'{}': entry '{}' has shape {}, more bytes than memory can address", path, name, shape_str(e.shape));
    KILN_CHECK(e.end - e.begin == expected, "load", "'{}': entry '{}' holds {} bytes; {} {} needs {}", path, name,
               e.end - e.begin, info["dtype"].get<std::string>(), shape_str(e.shape), expected);
    entries.emplace(name, std::move(e));
  }
  // The entries must tile the data section exactly (as the format requires): no overlaps, where
  // one tensor's bytes would be read as another's, and no holes hiding other content.
  std::vector<std::pair<size_t, size_t>> ranges;
  for (const auto& [name, e] : entries) ranges.push_back({e.begin, e.end});
  std::sort(ranges.begin(), ranges.end());
  size_t covered = 0;
  for (auto [begin, end] : ranges) {
    KILN_CHECK(begin == covered, "load", "'{}' is corrupt: {} at byte {} of its data section{}", path,
               begin < covered ? "entries overlap" : "bytes no entry owns start", std::min(begin, covered),
               begin < covered ? "" : " (a hole)");
    covered = end;
  }
  KILN_CHECK(covered == data_size, "load", "'{}' is corrupt: its data section ends with {} bytes no entry owns", path,
             data_size - covered);
  return entries;
}

}  // namespace

std::string safetensors_dtype(DType dtype) {
  for (const auto& t : kTags)
    if (t.dtype == dtype) return t.tag;
  KILN_FAIL("save", "dtype {} has no safetensors tag", dtype_name(dtype));
}

DType dtype_from_safetensors(const std::string& tag) {
  for (const auto& t : kTags)
    if (tag == t.tag) return t.dtype;
  KILN_FAIL("load", "unsupported safetensors dtype '{}'", tag);
}

void save_tensors(const TensorMap& tensors, const std::string& path, const Metadata& metadata) {
  nlohmann::json header = nlohmann::json::object();
  std::vector<Tensor> all;
  for (const auto& [name, t] : tensors) {
    KILN_CHECK(!name.empty() && name != "__metadata__", "save", "invalid tensor name '{}'", name);
    KILN_CHECK(t.defined(), "save", "tensor '{}' is undefined", name);
    all.push_back(t);
  }
  sync(all);  // one plan realizes every pending value
  // Bytes are written from host memory: device tensors are copied back first.
  std::vector<Tensor> host;
  for (const Tensor& t : all) host.push_back(t.device().is_cpu() ? t : t.detach().to(Device::cpu()));
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    size_t bytes = static_cast<size_t>(t.numel()) * dtype_size(t.dtype());
    header[name] = {{"dtype", safetensors_dtype(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  nlohmann::json meta = {{"format", "kiln"}};
  for (const auto& [k, v] : metadata) meta[k] = v;
  header["__metadata__"] = meta;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  uint64_t header_len = text.size();

  std::vector<std::pair<const void*, size_t>> pieces = {{&header_len, 8}, {text.data(), text.size()}};
  for (const Tensor& t : host)
    if (t.numel() > 0) pieces.push_back({t.data(), static_cast<size_t>(t.numel()) * dtype_size(t.dtype())});
  write_replacing(path, pieces);
}

TensorMap load_tensors(const std::string& path, Metadata* metadata) {
  std::vector<char> file = read_file(path);
  size_t data_start = 0;
  Metadata found;
  auto entries = parse_header(file, path, data_start, &found);
  TensorMap out;
  for (const auto& [name, e] : entries) out.emplace(name, tensor_from_bytes(file.data() + data_start + e.begin, e.dtype, e.shape));
  if (metadata) *metadata = std::move(found);
  return out;
}

void save(const Module& module, const std::string& path, const Metadata& extra) {
  TensorMap tensors;
  Metadata metadata = extra;
  for (const auto& [name, t] : module.state()) {
    tensors.emplace(name, t);
    // How a reader outside kiln turns quantized weights (nn/quantize.h) back into the float ones.
    if (name.ends_with(".weight_int8") || name == "weight_int8")
      metadata[name] = "int8, symmetric per output channel: weight[o][i] = weight_int8[i][o] * weight_scale[o]";
    if (name.ends_with(".weight_int4") || name == "weight_int4")
      metadata[name] =
          "int4 in uint8 pairs, symmetric per group of g input features (g = rows of weight_int4 * 2 / rows of "
          "weight_scale): q = (byte >> 4 * (i % 2)) & 15, weight[o][i] = (q - 8) * weight_scale[i / g][o]; rows past "
          "in_features are padding";
  }
  save_tensors(tensors, path, metadata);
}

void load(Module& module, const std::string& path, bool strict) {
  std::vector<char> file = read_file(path);
  size_t data_start = 0;
  auto entries = parse_header(file, path, data_start);
  auto state = module.state();
  // Validate everything before touching the module.
  for (const auto& [name, t] : state) {
    auto it = entries.find(name);
    KILN_CHECK(it != entries.end(), "load", "'{}' has no tensor '{}' (a {} {} of {})", path, name,
               dtype_name(t.dtype()), shape_str(t.shape()), module.type_name());
    KILN_CHECK(it->second.shape == t.shape(), "load", "'{}': '{}' has shape {} in the file but {} in the module", path,
               name, shape_str(it->second.shape), shape_str(t.shape()));
    KILN_CHECK(it->second.dtype == t.dtype(), "load", "'{}': '{}' has dtype {} in the file but {} in the module", path,
               name, dtype_name(it->second.dtype), dtype_name(t.dtype()));
  }
  if (strict) {
    for (const auto& [name, _] : entries) {
      bool known = false;
      for (const auto& [n, t] : state) known = known || n == name;
      KILN_CHECK(known, "load", "'{}' has tensor '{}' that {} does not have (pass strict = false to ignore)", path,
                 name, module.type_name());
    }
  }
  std::vector<Tensor> loaded;
  for (const auto& [name, t] : state) {
    const Entry& e = entries.at(name);
    loaded.push_back(tensor_from_bytes(file.data() + data_start + e.begin, e.dtype, e.shape));
  }
  NoGradGuard no_grad;
  for (size_t i = 0; i < state.size(); ++i) state[i].second.assign(loaded[i].to(state[i].second.device()));
  std::vector<Tensor> targets;
  for (auto& [_, t] : state) targets.push_back(t);
  sync(targets);
}

}  // namespace kiln::nn
