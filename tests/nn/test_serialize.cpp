// Checkpoints: safetensors round trips bit-exactly; bad files are rejected, module unchanged.
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <kiln/kiln.h>
#include <nlohmann/json.hpp>

#include "tests/support/files.h"
#include <unistd.h>

using namespace kiln;

namespace {

using testing::header_of;
using testing::read_bytes;
using testing::with_entry_copy;
using testing::with_header;
using testing::without_entry;
using testing::write_bytes;

std::string temp_path(const std::string& name) { return testing::temp_path("kiln_nn", name); }

struct Model : nn::Module {
  nn::Linear fc = register_module("fc", nn::Linear(3, 4));
  nn::BatchNorm1d norm = register_module("norm", nn::BatchNorm1d(4));
  nn::Embedding emb = register_module("emb", nn::Embedding(5, 2));
  Model() : Module("Model") {}
};

// The raw bytes of every state tensor, by name.
std::map<std::string, std::vector<char>> snapshot(const nn::Module& m) {
  std::map<std::string, std::vector<char>> out;
  for (auto& [name, state] : m.state()) {
    Tensor t = state.detach().to(Device::cpu());  // bytes on the host wherever the module lives
    const char* p = static_cast<const char*>(t.data());
    out[name] = std::vector<char>(p, p + t.numel() * dtype_size(t.dtype()));
  }
  return out;
}

}  // namespace

TEST_CASE("module state round-trips through safetensors bit-exactly", "[nn]") {
  manual_seed(7);
  Model a;
  a.norm.forward(randn({6, 4}));  // moves the running statistics away from their defaults
  std::string path = temp_path("roundtrip.safetensors");
  nn::save(a, path);
  CHECK_FALSE(std::filesystem::exists(path + ".tmp." + std::to_string(::getpid())));

  auto bytes = read_bytes(path);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  CHECK(header_len % 8 == 0);
  nlohmann::json header = header_of(bytes);
  CHECK(header["fc.weight"]["dtype"] == "F32");
  CHECK(header["fc.weight"]["shape"] == nlohmann::json::array({4, 3}));
  CHECK(header["norm.num_batches_tracked"]["dtype"] == "I64");
  CHECK(header["norm.num_batches_tracked"]["shape"] == nlohmann::json::array());
  CHECK(header["__metadata__"]["format"] == "kiln");
  size_t total = 0;
  for (auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    size_t begin = info["data_offsets"][0], end = info["data_offsets"][1];
    size_t elems = 1;
    for (auto d : info["shape"]) elems *= d.get<size_t>();
    CHECK(end - begin == elems * (info["dtype"] == "I64" ? 8 : 4));
    total += end - begin;
  }
  CHECK(bytes.size() == 8 + header_len + total);
  size_t begin = header["fc.bias"]["data_offsets"][0];
  CHECK(std::memcmp(bytes.data() + 8 + header_len + begin, a.fc.bias.data(), 16) == 0);

  manual_seed(8);
  Model b;
  CHECK(snapshot(a) != snapshot(b));
  nn::load(b, path);
  CHECK(snapshot(a) == snapshot(b));
  for (auto& p : b.parameters()) CHECK(p.requires_grad());
  std::filesystem::remove(path);
}

TEST_CASE("save_tensors and load_tensors keep every dtype exactly", "[nn]") {
  nn::TensorMap tensors{
      {"f64", from_vector<double>({1.0 / 3, -2.5e300}, {2})},
      {"f16", from_doubles({0.5, -65504.0, 1e-3}, {3}, DType::Float16)},
      {"bf16", from_doubles({1.5, -3.0e38}, {1, 2}, DType::BFloat16)},
      {"i32", from_vector<int32_t>({-7, 1 << 30}, {2})},
      {"i64", from_vector<int64_t>({int64_t{1} << 62, -1}, {2})},
      {"i8", from_vector<int8_t>({-128, 127}, {2})},
      {"u8", from_vector<uint8_t>({0, 255}, {2})},
      {"bool", from_vector<bool>({true, false, true}, {3})},
      {"step", scalar(12.0)},
  };
  std::string path = temp_path("tensors.safetensors");
  nn::save_tensors(tensors, path, {{"note", "optimizer"}});
  auto header = header_of(read_bytes(path));
  CHECK(header["bf16"]["dtype"] == "BF16");
  CHECK(header["bool"]["dtype"] == "BOOL");
  CHECK(header["__metadata__"]["note"] == "optimizer");
  auto loaded = nn::load_tensors(path);
  REQUIRE(loaded.size() == tensors.size());
  for (auto& [name, t] : tensors) {
    INFO(name);
    const Tensor& u = loaded.at(name);
    CHECK(u.dtype() == t.dtype());
    CHECK(u.shape() == t.shape());
    CHECK(std::memcmp(u.data(), t.data(), t.numel() * dtype_size(t.dtype())) == 0);
  }
  std::filesystem::remove(path);
}

TEST_CASE("bad checkpoints are rejected and leave the module unchanged", "[nn]") {
  manual_seed(9);
  Model source;
  std::string good = temp_path("good.safetensors"), bad = temp_path("bad.safetensors");
  nn::save(source, good);
  auto bytes = read_bytes(good);
  nlohmann::json header = header_of(bytes);

  manual_seed(10);
  Model target;
  auto before = snapshot(target);
  auto rejects = [&](const std::vector<char>& file, const std::string& needle) {
    write_bytes(bad, file);
    CHECK_THROWS_WITH(nn::load(target, bad), Catch::Contains(needle));
    CHECK(snapshot(target) == before);
  };

  SECTION("missing key") { rejects(without_entry(bytes, "norm.running_var"), "norm.running_var"); }
  SECTION("wrong shape") {
    nlohmann::json h = header;
    h["fc.weight"]["shape"] = {3, 4};
    rejects(with_header(h, bytes), "fc.weight");
  }
  SECTION("wrong dtype") {
    nlohmann::json h = header;
    h["fc.bias"]["dtype"] = "I32";
    rejects(with_header(h, bytes), "fc.bias");
  }
  SECTION("unexpected key") {
    std::vector<char> file = with_entry_copy(bytes, "extra", "fc.bias");
    rejects(file, "extra");
    write_bytes(bad, file);
    CHECK_NOTHROW(nn::load(target, bad, /*strict=*/false));
  }
  SECTION("entries whose bytes overlap") {
    nlohmann::json h = header;
    h["norm.running_var"]["data_offsets"] = h["norm.running_mean"]["data_offsets"];
    rejects(with_header(h, bytes), "overlap");
    h = header;
    h["extra"] = h["fc.bias"];  // the same bytes twice
    write_bytes(bad, with_header(h, bytes));
    CHECK_THROWS_WITH(nn::load(target, bad, /*strict=*/false), Catch::Contains("overlap"));
  }
  SECTION("bytes that no entry owns") {
    std::vector<char> longer = bytes;
    longer.insert(longer.end(), 8, '\0');
    rejects(longer, "no entry owns");
  }
  SECTION("a dtype kiln cannot hold names the file and the entry") {
    nlohmann::json h = header;
    h["fc.bias"]["dtype"] = "F33";
    rejects(with_header(h, bytes), "entry 'fc.bias' has dtype 'F33'");
    rejects(with_header(h, bytes), bad);
  }
  SECTION("a shape whose byte count would wrap") {
    nlohmann::json h = header;
    h["fc.bias"]["shape"] = {int64_t{1} << 62};
    rejects(with_header(h, bytes), "more bytes than memory can address");
  }
  SECTION("truncated data") {
    std::vector<char> cut(bytes.begin(), bytes.end() - 5);
    rejects(cut, "truncated");
  }
  SECTION("truncated header") {
    rejects(std::vector<char>(bytes.begin(), bytes.begin() + 20), "truncated");
    rejects(std::vector<char>(bytes.begin(), bytes.begin() + 4), "truncated");
  }
  SECTION("corrupt header") {
    std::vector<char> garbled = bytes;
    garbled[9] = '#';
    rejects(garbled, "corrupt");
  }
  SECTION("offsets that disagree with the shape") {
    nlohmann::json h = header;
    h["fc.bias"]["data_offsets"][1] = h["fc.bias"]["data_offsets"][0].get<size_t>() + 4;
    rejects(with_header(h, bytes), "fc.bias");
  }
  SECTION("missing file") {
    CHECK_THROWS_WITH(nn::load(target, temp_path("nope.safetensors")), Catch::Contains("cannot open"));
    CHECK_THROWS_AS(nn::load_tensors(temp_path("nope.safetensors")), Error);
  }
  std::filesystem::remove(good);
  std::filesystem::remove(bad);
}
