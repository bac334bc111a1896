// nn::Module: registration, traversal, train/eval and printing. See module.h.
#include "nn/module.h"

#include <fmt/format.h>

#include "backends/cuda/cuda_runtime.h"

namespace kiln::nn {

struct Module::State {
  std::string type_name;
  std::string extra_repr;
  bool training = true;
  NamedTensors parameters;
  NamedTensors buffers;
  NamedModules children;
};

namespace {

void check_name(const std::string& name, const char* what) {
  KILN_CHECK(!name.empty(), what, "name is empty; every {} needs a name", what);
  KILN_CHECK(name.find('.') == std::string::npos, what,
             "name '{}' contains '.', which separates levels in dotted names; use '_' instead", name);
}

template <typename List> bool contains(const List& list, const std::string& name) {
  for (const auto& [n, _] : list)
    if (n == name) return true;
  return false;
}

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

bool Module::has_name(const std::string& name) const {
  return contains(state_->parameters, name) || contains(state_->buffers, name) || contains(state_->children, name);
}

Module::Module(std::string type_name) : state_(std::make_shared<State>()) {
  state_->type_name = std::move(type_name);
}

Tensor Module::forward(const Tensor&) {
  KILN_FAIL("Module::forward",
            "module {} has no single-input forward: its class does not override `Tensor forward(const Tensor&)`, "
            "or this is a copy stored as a plain nn::Module, which keeps only the shared state; hold modules by "
            "value as nn::AnyModule",
            state_->type_name);
}

Tensor Module::register_parameter(const std::string& name, Tensor value) {
  check_name(name, "register_parameter");
  KILN_CHECK(value.defined(), "register_parameter", "parameter '{}' is an undefined tensor", name);
  KILN_CHECK(!has_name(name), "register_parameter", "name '{}' is already registered in {}",
             name, state_->type_name);
  KILN_CHECK(is_floating(value.dtype()), "register_parameter",
             "parameter '{}' has dtype {}; parameters must be floating point", name, dtype_name(value.dtype()));
  value.requires_grad_();
  state_->parameters.emplace_back(name, value);
  return value;
}

Tensor Module::register_buffer(const std::string& name, Tensor value) {
  check_name(name, "register_buffer");
  KILN_CHECK(value.defined(), "register_buffer", "buffer '{}' is an undefined tensor", name);
  KILN_CHECK(!has_name(name), "register_buffer", "name '{}' is already registered in {}", name,
             state_->type_name);
  state_->buffers.emplace_back(name, value);
  return value;
}

void Module::add_child(const std::string& name, const Module& child) {
  check_name(name, "register_module");
  KILN_CHECK(!has_name(name), "register_module", "name '{}' is already registered in {}", name,
             state_->type_name);
  KILN_CHECK(!child.same_as(*this), "register_module", "a module cannot be its own child ('{}')", name);
  state_->children.emplace_back(name, child);
}

void Module::append_named(NamedTensors& out, const std::string& prefix, bool buffers, bool recurse) const {
  for (const auto& [name, t] : buffers ? state_->buffers : state_->parameters) out.emplace_back(prefix + name, t);
  if (!recurse) return;
  for (const auto& [name, child] : state_->children) child.append_named(out, prefix + name + ".", buffers, true);
}

NamedTensors Module::named_parameters(bool recurse) const {
  NamedTensors out;
  append_named(out, "", false, recurse);
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [_, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

NamedTensors Module::named_buffers(bool recurse) const {
  NamedTensors out;
  append_named(out, "", true, recurse);
  return out;
}

std::vector<Tensor> Module::buffers(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [_, t] : named_buffers(recurse)) out.push_back(t);
  return out;
}

NamedTensors Module::state(bool include_buffers) const {
  NamedTensors out = named_parameters();
  if (include_buffers)
    for (auto& entry : named_buffers()) out.push_back(std::move(entry));
  return out;
}

NamedModules Module::named_children() const { return state_->children; }

std::vector<Module> Module::children() const {
  std::vector<Module> out;
  for (const auto& [_, child] : state_->children) out.push_back(child);
  return out;
}

int64_t Module::parameter_count() const {
  int64_t n = 0;
  for (const Tensor& p : parameters()) n += p.numel();
  return n;
}

void Module::train(bool on) {
  state_->training = on;
  for (auto& [_, child] : state_->children) child.train(on);
}

bool Module::is_training() const { return state_->training; }

void Module::to(Device device) {
  cuda::check_device(device, "Module::to");  // before anything moves
  for (auto& [_, t] : state()) Tensor(t).to_(device);
}

void Module::zero_grad() {
  for (Tensor& p : parameters()) p.zero_grad();
}

const std::string& Module::type_name() const { return state_->type_name; }
void Module::set_extra_repr(std::string text) { state_->extra_repr = std::move(text); }

void Module::print(std::string& out, const std::string& name, int depth) const {
  out += std::string(2 * depth, ' ');
  if (!name.empty()) out += "(" + name + "): ";
  out += state_->type_name;
  if (!state_->extra_repr.empty()) out += "(" + state_->extra_repr + ")";
  int64_t count = parameter_count();
  out += fmt::format(" - {} parameter{}\n", with_commas(count), count == 1 ? "" : "s");
  for (const auto& [child_name, child] : state_->children) child.print(out, child_name, depth + 1);
}

std::string Module::to_string() const {
  std::string out;
  print(out, "", 0);
  return out;
}

std::ostream& operator<<(std::ostream& os, const Module& module) { return os << module.to_string(); }

}  // namespace kiln::nn
