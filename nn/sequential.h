// nn::Sequential: modules applied in order; children are named "0", "1", ...
//
//   nn::Sequential mlp(nn::Linear(784, 512), nn::ReLU(), nn::Linear(512, 10));
//   mlp.push_back(nn::Dropout(0.1));
//   Tensor logits = mlp.forward(x);
//
// Any Module-derived type with `Tensor forward(const Tensor&)` can be added; Sequential keeps a
// handle to it (an alias, as with every Module copy) and calls its forward.
#pragma once
#include <concepts>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "nn/module.h"

namespace kiln::nn {

template <typename M>
concept Layer = std::derived_from<std::decay_t<M>, Module> && requires(std::decay_t<M>& m, const Tensor& x) {
  { m.forward(x) } -> std::convertible_to<Tensor>;
};

class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  template <Layer... Ms>
    requires(sizeof...(Ms) > 0 && !(sizeof...(Ms) == 1 && (std::is_same_v<std::decay_t<Ms>, Sequential> && ...)))
  explicit Sequential(Ms&&... layers) : Module("Sequential") {
    (push_back(std::forward<Ms>(layers)), ...);
  }

  template <Layer M> Sequential& push_back(M&& layer) {
    using Stored = std::decay_t<M>;
    Stored stored = register_module(std::to_string(steps_->size()), Stored(std::forward<M>(layer)));
    steps_->push_back([stored](const Tensor& x) mutable { return Tensor(stored.forward(x)); });
    return *this;
  }

  Tensor forward(const Tensor& x) const {
    Tensor h = x;
    for (const auto& step : *steps_) h = step(h);
    return h;
  }
  size_t size() const { return steps_->size(); }

 private:
  // Shared so that copies of a Sequential alias one list, like every Module.
  std::shared_ptr<std::vector<std::function<Tensor(const Tensor&)>>> steps_ =
      std::make_shared<std::vector<std::function<Tensor(const Tensor&)>>>();
};

}  // namespace kiln::nn
