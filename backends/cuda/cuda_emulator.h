// The CUDA emulator: kernels rendered for CUDA (backends/cuda/render_cuda.h) run on the host, so the CUDA
// code paths (renderer, launches, device memory, the executor's device plans) are tested on
// machines without a GPU. The same kernel text is compiled by the host compiler against CUDA's
// built-ins written for the host (backends/cuda/cuda_emulator_prelude.h); a launch runs each block's
// threads as fibers on one OS thread, switching at __syncthreads and warp shuffles, and reports
// a barrier that some threads never reach (a hang on a GPU) as a kiln::Error. Slow and exact:
// for tests (KILN_CUDA_EMULATOR=1), never for speed.
//
//   CudaSource cuda = render_cuda(kernels);
//   auto module = compile_cached(emulator::host_source(cuda), cuda.function_count);
//   emulator::Entry f = emulator::entry(*module, cuda.launches[0][0].function);
//   void* args[] = {&out, &in, &sc, &isc, &err};            // as for cudaLaunchKernel
//   emulator::launch(f, cuda.launches[0][0], args);
#pragma once
#include <string>
#include <vector>

#include "backends/cpu/compiler.h"
#include "jit/kernel_ir.h"
#include "backends/cuda/render_cuda.h"

namespace kiln::cuda::emulator {

// A function's host entry point: takes the launch's argument array (pointers to each argument).
using Entry = void (*)(void** args);

// One host translation unit: the built-ins, backends/cuda/cuda_prelude.h's kCudaPrelude, the random
// generators, every function of `cuda`, and an entry `kiln_emu_<function>` for each.
std::string host_source(const CudaSource& cuda);

// The entry of `function` in a module compiled from host_source (binding the module to the
// emulator on first use).
Entry entry(const cpu::CompiledModule& module, const std::string& function);

// Runs one launch to completion. Every kiln kernel is written for any grid size (grid-stride
// loops), so only a few blocks are emulated, each with launch.threads fibers.
void launch(Entry entry, const CudaLaunch& launch, void** args);

}  // namespace kiln::cuda::emulator
