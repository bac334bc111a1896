// kiln: a deep-learning framework in C++ with a lazy graph and a fusing JIT. Include this one
// header to get the whole public API:
//
//   #include <kiln/kiln.h>
//   kiln::nn::Linear fc(4, 1);
//   kiln::optim::SGD opt(fc.parameters(), kiln::optim::SGDOptions(0.1));
//   kiln::Tensor x = kiln::randn({8, 4}), y = kiln::randn({8, 1});
//   for (int step = 0; step < 100; ++step) {
//     kiln::Tensor loss = kiln::mse_loss(fc.forward(x), y);
//     opt.zero_grad();
//     loss.backward();
//     opt.step();                              // the step runs here, as one compiled plan
//   }
//
// Everything reachable from here is public and installed; nothing here includes the kernel IR,
// the scheduler, the executor, backends/ or a library's headers (oneDNN, CUDA): a program built
// against an installed kiln needs none of them (tests/install checks it). Tests and benchmarks
// that measure internals include those headers by path ("jit/executor.h").
#pragma once
#include "core/autocast.h"
#include "core/autograd.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/flags.h"
#include "core/tensor.h"
#include "distributed/communicator.h"
#include "distributed/data_parallel.h"
#include "distributed/pipeline.h"
#include "distributed/tensor_parallel.h"
#include "jit/stats.h"
#include "memory/allocator.h"
#include "memory/pool.h"
#include "memory/profile.h"
#include "memory/recompute.h"
#include "memory/report.h"
#include "nn/data/mnist.h"
#include "nn/nn.h"
#include "ops/autocast.h"
#include "ops/ops.h"
#include "optim/optim.h"
