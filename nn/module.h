// nn::Module: the base of every layer and model. A Module is a cheap handle, like Tensor:
// copying one aliases the same parameters, buffers, children and train/eval flag.
//
//   struct Net : kiln::nn::Module {
//     nn::Linear fc1 = register_module("fc1", nn::Linear(784, 512));
//     nn::Linear fc2 = register_module("fc2", nn::Linear(512, 10));
//     Net() : Module("Net") {}
//     Tensor forward(const Tensor& x) override { return fc2.forward(relu(fc1.forward(x))); }
//   };
//   Net net;
//   Tensor logits = net.forward(x);            // (B, 10)
//   nn::Module& any = net;  any.forward(x);    // forward is virtual: a Module& runs the Net's
//   nn::AnyModule held = net;                  // any module by value (see below), e.g. in a list
//   for (auto& [name, p] : net.named_parameters()) ...   // "fc1.weight", "fc1.bias", ...
//   fmt::print("{}\n", net.to_string());       // the tree with parameter counts
//
// A module with one input overrides `Tensor forward(const Tensor&)`; the default throws. Copying
// a derived module into a plain `nn::Module` keeps the shared state but slices off the derived
// members and the override, so such a copy cannot run: hold modules by value as nn::AnyModule.
//
// Plain settings of a layer (Linear's options, Dropout's p) are fixed at construction and only
// readable, so copies of a handle can never disagree about them.
#pragma once
#include <array>
#include <concepts>
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
  virtual ~Module() = default;
  Module(const Module&) = default;
  Module& operator=(const Module&) = default;
  Module(Module&&) = default;
  Module& operator=(Module&&) = default;

  // The module applied to one input. Modules with a single input override it; this default
  // throws kiln::Error naming the module (its class defines none, or this is a sliced copy).
  virtual Tensor forward(const Tensor& x);

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

// A module type that can be held by value and run: derived from Module, and the forward it has
// is the virtual `Tensor forward(const Tensor&)` (declared in it or inherited). A class whose
// forward is `const`, or takes something else, does not override the virtual one and is
// rejected here at compile time instead of throwing when run.
template <typename M>
concept Layer = std::derived_from<std::decay_t<M>, Module> && requires {
  static_cast<Tensor (std::decay_t<M>::*)(const Tensor&)>(&std::decay_t<M>::forward);
};

// Any module, held by value. It keeps a handle of the concrete type (so forward dispatches to
// it) and is itself a Module sharing that module's state: parameters, train/eval, printing and
// registration see the wrapped module. Copies alias, as with every Module.
//
//   std::vector<nn::AnyModule> stages{nn::Linear(4, 8), nn::ReLU(), Net()};
//   Tensor y = stages[2].forward(x);              // Net::forward
class AnyModule : public Module {
 public:
  template <Layer M>
    requires(!std::same_as<std::decay_t<M>, AnyModule>)
  AnyModule(M&& module)  // NOLINT: implicit, so a list of modules converts
      : Module(static_cast<const Module&>(module)),
        module_(std::make_shared<std::decay_t<M>>(std::forward<M>(module))) {}

  Tensor forward(const Tensor& x) override { return module_->forward(x); }
  // The wrapped module as its concrete type, or nullptr when it is another type.
  template <typename M> M* get() const { return dynamic_cast<M*>(module_.get()); }

 private:
  std::shared_ptr<Module> module_;
};

}  // namespace kiln::nn
