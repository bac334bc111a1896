// kiln: a deep-learning framework in C++ with a lazy graph and a fusing JIT.
// Include this one header to get the whole public API.
#pragma once
#include "core/autograd.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/flags.h"
#include "core/tensor.h"
#include "jit/stats.h"
#include "jit/executor.h"
#include "memory/allocator.h"
#include "backends/cuda/cuda_runtime.h"
#include "memory/pool.h"
#include "memory/recompute.h"
#include "memory/report.h"
#include "nn/nn.h"
#include "nn/data/mnist.h"
#include "ops/ops.h"
#include "optim/optim.h"
