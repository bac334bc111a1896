// nn::Module: the base of every layer and model. A Module is a cheap handle, like Tensor:
// copying one aliases the same parameters, buffers, children and train/eval flag.
//
//   struct Net : kiln::nn::Module {
//     nn::Linear fc1 = register_module("fc1", nn::Linear(784, 512));
//     nn::Linear fc2 = register_module("fc2", nn::Linear(512, 10));
//     Net() : Module("Net") {}
//     Tensor forward(const Tensor& x) { return fc2.forward(relu(fc1.forward(x))); }
//   };
//   Net net;
//   Tensor logits = net.forward(x);            // (B, 10)
//   for (auto& [name, p] : net.named_parameters()) ...   // "fc1.weight", "fc1.bias", ...
//   fmt::print("{}\n", net.to_string());       // the tree with parameter counts
//
// forward is not virtual: each module declares its own `Tensor forward(const Tensor&)` and
// containers (Sequential) capture it when a module is added.
#pragma once
#include <array>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"

namespace kiln::nn {

// Sizes of 2-D layers (kernel, stride, padding, ...): {height, width}.
using Size2 = std::array<int64_t, 2>;

class Module;
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
using NamedModules = std::vector<std::pair<std::string, Module>>;

class Module {
 public:
  // `type_name` is what printing shows for this module ("Net", "Linear").
  explicit Module(std::string type_name = "Module");

  // Registration. Names must be non-empty, contain no '.', and be unique within this module.
  // Each returns what it registered, so a member can be declared and registered in one line:
  //   nn::Linear fc = register_module("fc", nn::Linear(4, 2));
  Tensor register_parameter(const std::string& name, Tensor value);  // marks requires_grad
  Tensor register_buffer(const std::string& name, Tensor value);      // state without gradient
  template <typename M> M register_module(const std::string& name, M module) {
    add_child(name, static_cast<const Module&>(module));
    return module;
  }

  // Parameters and buffers of this module then of each child, depth-first, in registration
  // order, with dotted names ("block.0.weight").
  NamedTensors named_parameters(bool recurse = true) const;
  std::vector<Tensor> parameters(bool recurse = true) const;
  NamedTensors named_buffers(bool recurse = true) const;
  std::vector<Tensor> buffers(bool recurse = true) const;
  // Parameters followed by buffers: what a checkpoint holds.
  NamedTensors state(bool include_buffers = true) const;
  NamedModules named_children() const;
  std::vector<Module> children() const;
  int64_t parameter_count() const;  // elements in all parameters, recursively

  // Training mode (the default) and evaluation mode, set on this module and every descendant.
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const;

  // Moves parameters and buffers (and their grads) to `device`; kiln::Error when it is a CUDA
  // device this process cannot use.
  void to(Device device);
  void zero_grad();  // clears grad() of every parameter

  // One line per module: "(name): Type(extra) — N parameters", children indented.
  std::string to_string() const;
  const std::string& type_name() const;
  // Shown inside the parentheses when printing ("in=784, out=512, bias=true").
  void set_extra_repr(std::string text);

  // True when both handles refer to the same module.
  bool same_as(const Module& other) const { return state_ == other.state_; }

 private:
  struct State;
  bool has_name(const std::string& name) const;
  void add_child(const std::string& name, const Module& child);
  void append_named(NamedTensors& out, const std::string& prefix, bool buffers, bool recurse) const;
  void print(std::string& out, const std::string& name, int depth) const;
  std::shared_ptr<State> state_;
};

std::ostream& operator<<(std::ostream& os, const Module& module);

}  // namespace kiln::nn
