// kiln::nn: modules, layers, initializers, losses, checkpoint files (save/load) and activation
// checkpointing (nn::checkpoint).
//
//   nn::Sequential mlp(nn::Linear(784, 512), nn::ReLU(), nn::Linear(512, 10));
//   Tensor loss = nn::cross_entropy(mlp.forward(x), y);
//   nn::save(mlp, "mlp.safetensors");
#pragma once
#include "nn/checkpoint.h"
#include "nn/conv.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "nn/loss.h"
#include "nn/module.h"
#include "nn/module_list.h"
#include "nn/pooling.h"
#include "nn/quantize.h"
#include "core/options.h"
#include "nn/sequential.h"
#include "nn/serialize.h"
#include "nn/transformer.h"
