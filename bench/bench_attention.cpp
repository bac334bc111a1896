// bench_attention: fused attention (one kernel, flash-attention style) against the composite
// (matmul -> causal mask -> softmax -> matmul, KILN_FUSED_ATTENTION=0) on one causal
// self-attention layer of the GPT sample's heads (4 heads of 32), forward + backward, at
// sequence lengths T = 64, 256, 1024 with B * T = 2048 tokens per step: the bytes kept for the
// backward (jit::saved_for_backward) and the median step time, each next to the composite's in
// the same run.
//
//   ./build/bench/bench_attention [repeats]      # default 15
#include <kiln/kiln.h>

#include <chrono>
#include <cstdlib>
#include <fmt/format.h>
#include <vector>

#include "bench/bench_util.h"
#include "jit/stats.h"

namespace {

using namespace kiln;

constexpr int64_t kHeads = 4, kHeadDim = 32, kDim = kHeads * kHeadDim, kTokens = 2048;

struct Result {
  int64_t saved = 0;
  double ms = 0;
};

Result measure(int64_t T, bool fused, int repeats) {
  FlagsGuard guard;
  flags().fused_attention = fused;
  const int64_t B = kTokens / T;
  manual_seed(1);
  Tensor x = randn({B, T, kDim});
  x.realize();
  Tensor w = (randn({kDim, 3 * kDim}) * 0.05).detach().requires_grad_();
  auto step = [&] {
    std::vector<Tensor> qkv = chunk(matmul(x, w), 3, 2);
    auto heads = [&](const Tensor& t) { return permute(t.reshape({B, T, kHeads, kHeadDim}), {0, 2, 1, 3}); };
    Tensor y = nn::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), {}, 0.0, true);
    return (y * y).mean();
  };
  Result r;
  r.saved = jit::saved_for_backward(step(), {w}).activations;
  std::vector<double> times;
  for (int i = 0; i < repeats + 2; ++i) {
    const auto start = std::chrono::steady_clock::now();
    Tensor g = grad(step(), {w})[0];
    g.realize();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (i >= 2) times.push_back(ms);  // the first runs compile
  }
  r.ms = bench::median(times);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 15;
  fmt::print("causal self-attention, {} heads of {}, {} tokens per step (B = {} / T), forward + backward; "
             "median of {} steps\n\n",
             kHeads, kHeadDim, kTokens, kTokens, repeats);
  fmt::print("| T | saved for backward, fused | composite | fused / composite | step ms, fused | composite | "
             "speed-up |\n|---|---|---|---|---|---|---|\n");
  for (int64_t T : {64, 256, 1024}) {
    const Result fused = measure(T, true, repeats), composite = measure(T, false, repeats);
    fmt::print("| {} | {:.2f} MiB | {:.2f} MiB | {:.3f} | {:.2f} | {:.2f} | {:.2f}x |\n", T, fused.saved / 1048576.0,
               composite.saved / 1048576.0, double(fused.saved) / composite.saved, fused.ms, composite.ms,
               composite.ms / fused.ms);
  }
  return 0;
}
