// nn::ModuleList: modules built in a loop and registered as children "0", "1", ..., so their
// parameters are found, saved and moved with the owner's. It has no forward of its own: the owner
// runs its members (as torch.nn.ModuleList).
//
//   nn::ModuleList blocks = register_module("blocks", nn::ModuleList());
//   for (int i = 0; i < layers; ++i) blocks.push_back(nn::TransformerBlock(d, heads));
//   for (nn::AnyModule& block : blocks) h = block.forward(h);
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "nn/module.h"

namespace kiln::nn {

class ModuleList : public Module {
 public:
  ModuleList() : Module("ModuleList") {}

  ModuleList& push_back(AnyModule module) {
    items_->push_back(register_module(std::to_string(items_->size()), std::move(module)));
    return *this;
  }
  size_t size() const { return items_->size(); }
  bool empty() const { return items_->empty(); }
  AnyModule& operator[](size_t index) const { return items_->at(index); }
  std::vector<AnyModule>::iterator begin() const { return items_->begin(); }
  std::vector<AnyModule>::iterator end() const { return items_->end(); }

 private:
  // Shared so that copies of a ModuleList alias one list, like every Module.
  std::shared_ptr<std::vector<AnyModule>> items_ = std::make_shared<std::vector<AnyModule>>();
};

}  // namespace kiln::nn
