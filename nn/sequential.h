// nn::Sequential: modules applied in order; children are named "0", "1", ...
//
//   nn::Sequential mlp(nn::Linear(784, 512), nn::ReLU(), nn::Linear(512, 10));
//   mlp.push_back(nn::Dropout(0.1));
//   Tensor logits = mlp.forward(x);
//   Tensor h = mlp[0].forward(x);                  // one step: an nn::AnyModule
//
// Any nn::Layer can be added (a Module-derived type whose forward overrides
// `Tensor forward(const Tensor&)`); Sequential keeps it as an nn::AnyModule, a handle that
// aliases the module added, as with every Module copy.
#pragma once
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "nn/module.h"

namespace kiln::nn {

class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  template <Layer... Ms>
    requires(sizeof...(Ms) > 0 && !(sizeof...(Ms) == 1 && (std::is_same_v<std::decay_t<Ms>, Sequential> && ...)))
  explicit Sequential(Ms&&... layers) : Module("Sequential") {
    (push_back(std::forward<Ms>(layers)), ...);
  }

  Sequential& push_back(AnyModule layer) {
    steps_->push_back(register_module(std::to_string(steps_->size()), std::move(layer)));
    return *this;
  }

  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    for (AnyModule& step : *steps_) h = step.forward(h);
    return h;
  }
  size_t size() const { return steps_->size(); }
  AnyModule& operator[](size_t index) const { return steps_->at(index); }

 private:
  // Shared so that copies of a Sequential alias one list, like every Module.
  std::shared_ptr<std::vector<AnyModule>> steps_ = std::make_shared<std::vector<AnyModule>>();
};

}  // namespace kiln::nn
