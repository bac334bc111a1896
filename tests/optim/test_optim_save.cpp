// optim::save / optim::load: optimizer state files round-trip bit-exactly; training resumed from
// a model file and an optimizer file matches uninterrupted training bit for bit (SGD momentum,
// Adam); bad or mismatched files throw kiln::Error and leave the optimizer unchanged.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
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

std::string temp_path(const std::string& name) { return testing::temp_path("kiln_optim", name); }

struct Net : nn::Module {
  Net() : Module("Net") {}
  nn::Linear fc1 = register_module("fc1", nn::Linear(6, 8));
  nn::Linear fc2 = register_module("fc2", nn::Linear(8, 3));
  Tensor forward(const Tensor& x) { return fc2.forward(relu(fc1.forward(x))); }  // (B, 6) -> (B, 3)
};

struct Batch {
  Tensor x, y;
};
Batch batch_for(int step) {
  std::vector<double> x(5 * 6);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7 * static_cast<double>(i) + step);
  std::vector<int64_t> y(5);
  for (int64_t i = 0; i < 5; ++i) y[i] = (i + step) % 3;
  return {from_doubles(x, {5, 6}, DType::Float32), from_vector<int64_t>(y, {5})};
}

void train(Net& net, optim::Optimizer& opt, int first, int count) {
  for (int s = first; s < first + count; ++s) {
    Batch b = batch_for(s);
    opt.step(nn::cross_entropy(net.forward(b.x), b.y));
  }
}

std::vector<char> bytes_of(const Tensor& value) {
  Tensor t = value.detach().to(Device::cpu());  // bytes on the host wherever the tensor lives
  const char* p = static_cast<const char*>(t.data());
  return {p, p + t.numel() * dtype_size(t.dtype())};
}

// Everything load may change: state tensors (dtype, shape, bytes) and hyperparameters.
struct Snapshot {
  std::map<std::string, std::pair<std::string, std::vector<char>>> state;
  std::vector<optim::Hyperparameters> hyperparameters;
  bool operator==(const Snapshot&) const = default;
};
Snapshot snapshot(const optim::Optimizer& opt) {
  Snapshot s;
  for (const auto& [key, t] : opt.state()) s.state[key] = {t.str(), bytes_of(t)};
  for (size_t g = 0; g < opt.group_count(); ++g) s.hyperparameters.push_back(opt.hyperparameters(g));
  return s;
}

using MakeOptimizer = std::function<std::unique_ptr<optim::Optimizer>(Net&, double lr)>;

std::vector<std::pair<std::string, MakeOptimizer>> optimizers() {
  return {
      {"SGD momentum",
       [](Net& n, double lr) {
         return std::make_unique<optim::SGD>(n.parameters(), optim::SGDOptions(lr).momentum(0.9).weight_decay(1e-3));
       }},
      {"Adam", [](Net& n, double lr) { return std::make_unique<optim::Adam>(n.parameters(), optim::AdamOptions(lr)); }},
      {"AdamW",
       [](Net& n, double lr) { return std::make_unique<optim::AdamW>(n.parameters(), optim::AdamWOptions(lr)); }},
  };
}

}  // namespace

TEST_CASE("optim::save and optim::load round-trip state and hyperparameters bit-exactly", "[optim]") {
  std::string path = temp_path("roundtrip.safetensors");
  for (auto& [name, make] : optimizers()) {
    INFO(name);
    manual_seed(41);
    Net net;
    auto opt = make(net, 0.03);
    train(net, *opt, 0, 3);
    optim::save(*opt, path);
    nn::Metadata meta;
    nn::TensorMap file = nn::load_tensors(path, &meta);
    CHECK(meta.at("optimizer") == opt->type_name());
    CHECK(meta.at("group.0.lr") == "0.03");
    CHECK(file.at("0.0.step").item() == 3);

    auto fresh = make(net, 0.5);  // another lr: load restores the file's
    optim::load(*fresh, path);
    CHECK(fresh->lr() == 0.03);
    CHECK(snapshot(*fresh) == snapshot(*opt));
    CHECK(snapshot(*fresh).state.size() == 4 * (opt->type_name() == "SGD" ? 2 : 3));
  }
  std::filesystem::remove(path);
}

TEST_CASE("training resumed from model and optimizer files matches uninterrupted training", "[optim][train]") {
  std::string model_path = temp_path("resume.safetensors"), optim_path = temp_path("resume.optim.safetensors");
  for (auto& [name, make] : optimizers()) {
    INFO(name);
    manual_seed(42);
    Net uninterrupted;
    auto opt = make(uninterrupted, 0.05);
    train(uninterrupted, *opt, 0, 6);

    manual_seed(42);
    Net first_half;
    auto first_opt = make(first_half, 0.05);
    train(first_half, *first_opt, 0, 3);
    nn::save(first_half, model_path);
    optim::save(*first_opt, optim_path);

    manual_seed(43);  // another process: other initial weights, another lr on the command line
    Net resumed;
    auto resumed_opt = make(resumed, 0.2);
    nn::load(resumed, model_path);
    optim::load(*resumed_opt, optim_path);
    train(resumed, *resumed_opt, 3, 3);

    auto want = uninterrupted.state(), got = resumed.state();
    REQUIRE(want.size() == got.size());
    for (size_t i = 0; i < want.size(); ++i) {
      INFO(want[i].first);
      CHECK(bytes_of(got[i].second) == bytes_of(want[i].second));
    }
    CHECK(snapshot(*resumed_opt) == snapshot(*opt));
  }
  std::filesystem::remove(model_path);
  std::filesystem::remove(optim_path);
}

TEST_CASE("bad optimizer files are rejected and leave the optimizer unchanged", "[optim]") {
  std::string good = temp_path("good.safetensors"), bad = temp_path("bad.safetensors");
  manual_seed(44);
  Net net;
  optim::SGD source(net.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  train(net, source, 0, 2);
  optim::save(source, good);
  const std::vector<char> bytes = read_bytes(good);
  const nlohmann::json header = header_of(bytes);

  optim::SGD target(net.parameters(), optim::SGDOptions(0.02).momentum(0.5));
  train(net, target, 5, 1);
  const Snapshot before = snapshot(target);
  auto rejects = [&](const std::vector<char>& file, const std::string& needle) {
    write_bytes(bad, file);
    CHECK_THROWS_WITH(optim::load(target, bad), Catch::Contains(needle));
    CHECK(snapshot(target) == before);
  };

  SECTION("truncated data") { rejects(std::vector<char>(bytes.begin(), bytes.end() - 3), "truncated"); }
  SECTION("truncated header") { rejects(std::vector<char>(bytes.begin(), bytes.begin() + 30), "truncated"); }
  SECTION("corrupt header") {
    std::vector<char> garbled = bytes;
    garbled[8] = '#';  // the header's opening brace
    rejects(garbled, "corrupt");
  }
  SECTION("missing state tensor") { rejects(without_entry(bytes, "0.2.momentum_buffer"), "0.2.momentum_buffer"); }
  SECTION("missing step") { rejects(without_entry(bytes, "0.1.step"), "0.1.step"); }
  SECTION("wrong dtype") {
    nlohmann::json h = header;
    h["0.0.step"]["dtype"] = "F64";  // same size, other type
    rejects(with_header(h, bytes), "0.0.step");
  }
  SECTION("wrong shape") {
    nlohmann::json h = header;
    h["0.0.momentum_buffer"]["shape"] = {6, 8};  // fc1.weight is (8, 6)
    rejects(with_header(h, bytes), "0.0.momentum_buffer");
  }
  SECTION("unknown tensor") {
    rejects(with_entry_copy(bytes, "0.9.momentum_buffer", "0.3.momentum_buffer"), "0.9.momentum_buffer");
  }
  SECTION("bad hyperparameters") {
    nlohmann::json h = header;
    h["__metadata__"]["group.0.lr"] = "fast";
    rejects(with_header(h, bytes), "group.0.lr");
    h["__metadata__"]["group.0.lr"] = "-1";
    rejects(with_header(h, bytes), "lr");
    h = header;
    h["__metadata__"].erase("group.0.momentum");
    rejects(with_header(h, bytes), "group.0.momentum");
  }
  SECTION("not an optimizer file") {
    nn::save(net, bad);
    CHECK_THROWS_WITH(optim::load(target, bad), Catch::Contains("optimizer"));
    CHECK(snapshot(target) == before);
  }
  SECTION("another optimizer type") {
    optim::Adam adam(net.parameters(), optim::AdamOptions(0.01));
    train(net, adam, 0, 1);
    optim::save(adam, bad);
    CHECK_THROWS_WITH(optim::load(target, bad), Catch::Contains("Adam"));
    CHECK(snapshot(target) == before);
  }
  SECTION("another model: parameter count, or shapes after the hyperparameters were read") {
    optim::SGD fewer(net.fc1.parameters(), optim::SGDOptions(0.1).momentum(0.9));
    CHECK_THROWS_WITH(optim::load(fewer, good), Catch::Contains("parameters"));

    manual_seed(45);
    nn::Sequential other(nn::Linear(8, 6), nn::Linear(3, 8));  // same count, other shapes
    optim::SGD mismatched(other.parameters(), optim::SGDOptions(0.3).momentum(0.5));
    CHECK_THROWS_WITH(optim::load(mismatched, good), Catch::Contains("0.0.momentum_buffer"));
    CHECK(mismatched.lr() == 0.3);  // hyperparameters rolled back
    CHECK(mismatched.group(0).options.momentum() == 0.5);
    CHECK(mismatched.state().empty());
  }
  std::filesystem::remove(good);
  std::filesystem::remove(bad);
}
