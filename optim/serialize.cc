// Optimizer state files: see serialize.h.
#include "optim/serialize.h"

#include <charconv>
#include <cstdio>

#include "core/error.h"
#include "nn/serialize.h"

namespace kiln::optim {

namespace {

std::string group_key(size_t group, const std::string& name) { return fmt::format("group.{}.{}", group, name); }

const std::string& required(const nn::Metadata& meta, const std::string& key, const std::string& path) {
  auto it = meta.find(key);
  KILN_CHECK(it != meta.end(), "optim::load", "'{}' has no metadata '{}': not an optimizer state file", path, key);
  return it->second;
}

// A number written by save: the shortest text that reads back as the same double.
double parse_number(const std::string& text, const std::string& key, const std::string& path) {
  double value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  KILN_CHECK(ec == std::errc() && end == text.data() + text.size(), "optim::load",
             "'{}': metadata '{}' is '{}', not a number", path, key, text);
  return value;
}

size_t parse_count(const std::string& text, const std::string& key, const std::string& path) {
  size_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  KILN_CHECK(ec == std::errc() && end == text.data() + text.size(), "optim::load",
             "'{}': metadata '{}' is '{}', not a count", path, key, text);
  return value;
}

// A GradScaler's entries in an optimizer file: "scaler.scale", "scaler.growth_tracker".
const std::string kScalerPrefix = "scaler.";

// Writes the optimizer's state and hyperparameters, and `extra` tensors (the scaler's).
void save_with(const Optimizer& optimizer, nn::TensorMap extra, const std::string& path) {
  nn::Metadata meta{{"optimizer", optimizer.type_name()},
                    {"param_groups", std::to_string(optimizer.group_count())}};
  for (size_t g = 0; g < optimizer.group_count(); ++g) {
    meta[group_key(g, "params")] = std::to_string(optimizer.group_params(g).size());
    for (const auto& [name, value] : optimizer.hyperparameters(g)) meta[group_key(g, name)] = fmt::format("{}", value);
  }
  nn::TensorMap tensors = optimizer.state();
  tensors.merge(extra);
  nn::save_tensors(tensors, path, meta);
}

// Loads the optimizer and, when `scaler` is given, the scaler: all-or-nothing for both.
void load_with(Optimizer& optimizer, GradScaler* scaler, const std::string& path) {
  nn::Metadata meta;
  nn::TensorMap tensors = nn::load_tensors(path, &meta);  // throws for a bad file
  std::map<std::string, Tensor> scaler_state;
  for (auto it = tensors.begin(); it != tensors.end();) {
    if (it->first.starts_with(kScalerPrefix)) {
      scaler_state[it->first.substr(kScalerPrefix.size())] = it->second;
      it = tensors.erase(it);
    } else {
      ++it;
    }
  }

  // The file must describe an optimizer like this one.
  const std::string& type = required(meta, "optimizer", path);
  KILN_CHECK(type == optimizer.type_name(), "optim::load", "'{}' holds the state of {}, not of {}", path, type,
             optimizer.type_name());
  size_t groups = parse_count(required(meta, "param_groups", path), "param_groups", path);
  KILN_CHECK(groups == optimizer.group_count(), "optim::load", "'{}' has {} parameter groups; this {} has {}", path,
             groups, type, optimizer.group_count());
  std::vector<Hyperparameters> hyperparameters(groups);
  for (size_t g = 0; g < groups; ++g) {
    std::string key = group_key(g, "params");
    size_t params = parse_count(required(meta, key, path), key, path);
    KILN_CHECK(params == optimizer.group_params(g).size(), "optim::load",
               "'{}': group {} has {} parameters in the file but {} in the optimizer", path, g, params,
               optimizer.group_params(g).size());
    for (const auto& [name, _] : optimizer.hyperparameters(g)) {
      key = group_key(g, name);
      hyperparameters[g][name] = parse_number(required(meta, key, path), key, path);
    }
  }
  // dtypes: load_state would convert; a file must match exactly, as for nn::load.
  for (const auto& [key, value] : tensors) {
    size_t g = 0, i = 0;
    int used = 0;
    bool parsed = std::sscanf(key.c_str(), "%zu.%zu.%n", &g, &i, &used) == 2 && used > 0;
    KILN_CHECK(parsed && g < groups && i < optimizer.group_params(g).size(), "optim::load",
               "'{}' has tensor '{}', which names no parameter of this {}", path, key, type);
    bool is_step = key.substr(static_cast<size_t>(used)) == "step";
    DType want = is_step ? DType::Int64 : optimizer.group_params(g)[i].dtype();
    KILN_CHECK(value.dtype() == want, "optim::load", "'{}': '{}' has dtype {} in the file; it must be {}", path, key,
               dtype_name(value.dtype()), dtype_name(want));
    KILN_CHECK(!is_step || (value.dim() == 0 && value.item() >= 0), "optim::load",
               "'{}': '{}' must be a non-negative scalar, got {}", path, key, value.str());
  }

  // Hyperparameters and state are each replaced all-or-nothing; undo the first if the second fails.
  std::vector<Hyperparameters> previous;
  for (size_t g = 0; g < groups; ++g) previous.push_back(optimizer.hyperparameters(g));
  const std::map<std::string, Tensor> previous_state = scaler ? optimizer.state() : std::map<std::string, Tensor>{};
  optimizer.set_hyperparameters(hyperparameters);
  try {
    optimizer.load_state(tensors);
  } catch (...) {
    optimizer.set_hyperparameters(previous);
    throw;
  }
  if (scaler == nullptr) return;
  try {
    scaler->load_state(scaler_state);  // all-or-nothing itself
  } catch (...) {
    optimizer.set_hyperparameters(previous);
    optimizer.load_state(previous_state);
    throw;
  }
}

}  // namespace

void save(const Optimizer& optimizer, const std::string& path) { save_with(optimizer, {}, path); }

void save(const Optimizer& optimizer, const GradScaler& scaler, const std::string& path) {
  nn::TensorMap extra;
  for (const auto& [key, value] : scaler.state()) extra[kScalerPrefix + key] = value;
  save_with(optimizer, std::move(extra), path);
}

void load(Optimizer& optimizer, const std::string& path) { load_with(optimizer, nullptr, path); }
void load(Optimizer& optimizer, GradScaler& scaler, const std::string& path) { load_with(optimizer, &scaler, path); }

}  // namespace kiln::optim
