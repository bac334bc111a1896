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
//
// With a GradScaler (mixed precision), its state goes into the same file under the prefix
// "scaler." ("scaler.scale", "scaler.growth_tracker"):
//   optim::save(opt, scaler, "net.optim.safetensors");
//   optim::load(opt, scaler, "net.optim.safetensors");
// load(opt, path) alone ignores a scaler's entries (training may go on without one); load with a
// scaler needs them (a file saved without a scaler, or from a disabled one, is an Error).
#pragma once
#include <string>

#include "optim/grad_scaler.h"
#include "optim/optimizer.h"

namespace kiln::optim {

void save(const Optimizer& optimizer, const std::string& path);
void save(const Optimizer& optimizer, const GradScaler& scaler, const std::string& path);

// All-or-nothing, like nn::load: a missing, truncated or corrupt file, another optimizer type, a
// different number of groups or parameters, a state tensor of the wrong shape or dtype, or a
// parameter with only part of its state throws kiln::Error naming the problem, and the optimizer
// is left unchanged. Otherwise the state and every group's hyperparameters (the learning rate
// included: set_lr afterwards to override it) are replaced.
void load(Optimizer& optimizer, const std::string& path);
// The same, and the scaler's state: all-or-nothing for both.
void load(Optimizer& optimizer, GradScaler& scaler, const std::string& path);

}  // namespace kiln::optim
