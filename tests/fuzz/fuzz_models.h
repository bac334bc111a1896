// The small models the file fuzz targets load into, shared with the program that writes their
// seed files (make_corpus.cc), so the seeds match them key for key.
#pragma once
#include <kiln/kiln.h>

namespace kiln::fuzz {

// Parameters and buffers of two layers; BatchNorm1d brings an int64 buffer.
struct CheckpointNet : nn::Module {
  CheckpointNet() : Module("CheckpointNet") {}
  nn::Linear fc = register_module("fc", nn::Linear(3, 2));
  nn::BatchNorm1d norm = register_module("norm", nn::BatchNorm1d(2));
};

// What optimizer state files belong to: SGD with momentum, Adam, a GradScaler, over one layer.
struct Optimizers {
  nn::Linear fc{3, 2};
  optim::SGD sgd{fc.parameters(), optim::SGDOptions(0.1).momentum(0.9)};
  optim::Adam adam{fc.parameters(), optim::AdamOptions(0.01)};
  optim::GradScaler scaler;
};

}  // namespace kiln::fuzz
