#include "backends/cuda/cuda_emulator.h"

#include <fmt/format.h>
#include <ucontext.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <set>

#include "core/error.h"
#include "backends/cuda/cuda_emulator_prelude.h"
#include "backends/cuda/cuda_prelude.h"
#include "jit/math_prelude.h"
#include "jit/random_prelude.h"

namespace kiln::cuda::emulator {

namespace {

// Matches kiln_emu_state in backends/cuda/cuda_emulator_prelude.h.
struct Uint3 {
  unsigned int x, y, z;
};
struct State {
  Uint3 thread_idx, block_idx, block_dim, grid_dim;
  void (*sync_threads)();
  unsigned long long (*shfl_down)(unsigned long long bits, int delta);
  void (*misaligned)(const void* p, unsigned long bytes);
};

// Three blocks: enough for every grid-stride loop to take uneven strides.
constexpr int64_t kEmulatedBlocks = 3;
constexpr size_t kStackBytes = 64 * 1024;

enum class Wait : uint8_t { Running, Sync, Shuffle, Done };

struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  Wait wait = Wait::Done;
  unsigned long long value = 0;  // a shuffle's operand, then its result
  int delta = 0;
};

// The one launch in flight (launches are serialized by g_launch_mutex).
std::mutex g_launch_mutex;
State g_state;
ucontext_t g_scheduler;
std::vector<Fiber> g_fibers;
size_t g_current = 0;
Entry g_entry = nullptr;
void** g_args = nullptr;

void suspend(Wait why) {
  Fiber& f = g_fibers[g_current];
  f.wait = why;
  swapcontext(&f.context, &g_scheduler);
}

void sync_threads() { suspend(Wait::Sync); }

unsigned long long shfl_down(unsigned long long bits, int delta) {
  g_fibers[g_current].value = bits;
  g_fibers[g_current].delta = delta;
  suspend(Wait::Shuffle);
  return g_fibers[g_current].value;
}

// The first misaligned vector access of the launch, reported when it ends (fibers never throw).
std::string g_fault;

void misaligned(const void* p, unsigned long bytes) {
  if (g_fault.empty()) g_fault = fmt::format("a {}-byte vector access at {} (not {}-byte aligned: a fault on a GPU)", bytes, p, bytes);
}

void fiber_main() {
  g_entry(g_args);
  g_fibers[g_current].wait = Wait::Done;  // returns to g_scheduler through uc_link
}

// Completes the shuffles of warps whose 32 lanes all wait at one; true if any did.
bool release_shuffles(size_t threads, const std::string& function) {
  bool released = false;
  for (size_t w = 0; w < threads; w += 32) {
    size_t waiting = 0, done = 0;
    for (size_t l = w; l < w + 32; ++l) {
      waiting += g_fibers[l].wait == Wait::Shuffle;
      done += g_fibers[l].wait == Wait::Done;
    }
    if (waiting == 0) continue;
    KILN_CHECK(done == 0, "cuda emulator", "kernel `{}`: {} lanes of warp {} wait at a full-warp shuffle that {} "
               "exited lanes never reach (a hang or undefined result on a GPU)", function, waiting, w / 32, done);
    if (waiting < 32) continue;
    unsigned long long values[32];
    for (size_t l = 0; l < 32; ++l) values[l] = g_fibers[w + l].value;
    for (size_t l = 0; l < 32; ++l) {
      Fiber& f = g_fibers[w + l];
      const size_t source = l + static_cast<size_t>(f.delta);
      f.value = source < 32 ? values[source] : values[l];
      f.wait = Wait::Running;
    }
    released = true;
  }
  return released;
}

void run_block(size_t threads, const std::string& function) {
  for (size_t t = 0; t < threads; ++t) {
    Fiber& f = g_fibers[t];
    if (!f.stack) f.stack = std::make_unique<char[]>(kStackBytes);
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &g_scheduler;
    makecontext(&f.context, fiber_main, 0);
    f.wait = Wait::Running;
  }
  for (;;) {
    for (size_t t = 0; t < threads; ++t) {
      if (g_fibers[t].wait != Wait::Running) continue;
      g_current = t;
      g_state.thread_idx = {static_cast<unsigned int>(t), 0, 0};
      swapcontext(&g_scheduler, &g_fibers[t].context);
    }
    if (release_shuffles(threads, function)) continue;
    size_t syncing = 0, done = 0;
    for (size_t t = 0; t < threads; ++t) {
      syncing += g_fibers[t].wait == Wait::Sync;
      done += g_fibers[t].wait == Wait::Done;
    }
    if (done == threads) return;
    // Threads that exited count as arrived at __syncthreads, as on current GPUs.
    KILN_CHECK(syncing + done == threads, "cuda emulator", "kernel `{}`: {} threads wait at __syncthreads while {} "
               "wait at a warp shuffle (a hang on a GPU)", function, syncing, threads - syncing - done);
    for (size_t t = 0; t < threads; ++t)
      if (g_fibers[t].wait == Wait::Sync) g_fibers[t].wait = Wait::Running;
  }
}

}  // namespace

std::string host_source(const CudaSource& cuda) {
  std::string source = std::string(kCudaEmulatorTypes) + kCudaPrelude + jit::kMathPrelude + jit::kRandomPrelude + cuda.functions;
  source += "\n// Entries taking a launch's argument array.\n";
  std::set<std::string> entries;  // kernels that share functions launch them under one name
  for (size_t k = 0; k < cuda.launches.size(); ++k) {
    if (cuda.launches[k].empty()) continue;
    const std::vector<std::string>& types = cuda.parameter_types[k];
    std::string call;
    for (size_t i = 0; i < types.size(); ++i) call += fmt::format("{}*({}*)a[{}]", i ? ", " : "", types[i], i);
    for (const CudaLaunch& l : cuda.launches[k])
      if (entries.insert(l.function).second)
        source += fmt::format("extern \"C\" void kiln_emu_{}(void** a) {{ {}({}); }}\n", l.function, l.function, call);
  }
  return source;
}

Entry entry(const cpu::CompiledModule& module, const std::string& function) {
  using Bind = unsigned long (*)(State*);
  auto bind = reinterpret_cast<Bind>(module.symbol("kiln_emu_bind"));
  KILN_CHECK(bind(&g_state) == sizeof(State), "cuda emulator",
             "module {} was built against another emulator state layout; clear the kernel cache ({})", module.key(),
             module.path());
  return reinterpret_cast<Entry>(module.symbol("kiln_emu_" + function));
}

void launch(Entry entry, const CudaLaunch& launch, void** args) {
  KILN_CHECK(launch.threads > 0 && launch.threads % 32 == 0 && launch.threads <= 1024 && launch.blocks >= 1,
             "cuda emulator", "kernel `{}`: launch of {} blocks x {} threads; blocks must be >= 1 and threads a "
             "multiple of 32 up to 1024", launch.function, launch.blocks, launch.threads);
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  const size_t threads = static_cast<size_t>(launch.threads);
  if (g_fibers.size() < threads) g_fibers.resize(threads);
  g_state.sync_threads = sync_threads;
  g_state.shfl_down = shfl_down;
  g_state.misaligned = misaligned;
  g_fault.clear();
  g_entry = entry;
  g_args = args;
  const int64_t blocks = std::min(launch.blocks, kEmulatedBlocks);
  g_state.block_dim = {static_cast<unsigned int>(threads), 1, 1};
  g_state.grid_dim = {static_cast<unsigned int>(blocks), 1, 1};
  for (int64_t b = 0; b < blocks; ++b) {
    g_state.block_idx = {static_cast<unsigned int>(b), 0, 0};
    run_block(threads, launch.function);
  }
  KILN_CHECK(g_fault.empty(), "cuda emulator", "kernel `{}`: {}", launch.function, g_fault);
}

}  // namespace kiln::cuda::emulator
