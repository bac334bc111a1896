// Optimizer state files: what an optimizer needs to continue training where it stopped, in the
// safetensors format of nn::save, next to the model's own file.
//
//   nn::save(net, "net.safetensors");
//   optim::save(opt, "net.optim.safetensors");
//   ...                                         // later, a fresh process
//   nn::load(net, "net.safetensors");
//   optim::load(opt, "net.optim.safetensors");  // momentum / Adam moments, step counts, lr
//
// The file holds opt.state() as tensors ("0.3.momentum_buffer", "0.3.step" as an I64 scalar) and,
// in its metadata, the optimizer's type ("optimizer": "SGD"), the group count ("param_groups"),
// each group's parameter count ("group.0.params") and hyperparameters ("group.0.lr": "0.05",
// written so they read back bit-exactly). An optimizer's type, groups and parameters must match
// the file; the parameters themselves are not in it.
#pragma once
#include <string>

#include "optim/optimizer.h"

namespace kiln::optim {

void save(const Optimizer& optimizer, const std::string& path);

// All-or-nothing, like nn::load: a missing, truncated or corrupt file, another optimizer type, a
// different number of groups or parameters, a state tensor of the wrong shape or dtype, or a
// parameter with only part of its state throws kiln::Error naming the problem, and the optimizer
// is left unchanged. Otherwise the state and every group's hyperparameters (the learning rate
// included: set_lr afterwards to override it) are replaced.
void load(Optimizer& optimizer, const std::string& path);

}  // namespace kiln::optim
