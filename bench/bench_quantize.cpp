// Dynamic int8 Linear against the float32 one, same run: 768 -> 3072 and 3072 -> 768 at batch 1,
// 8, 32 and 128 (the MLP of a BERT-base block), under NoGradGuard, medians of --runs forwards
// (each realized). int8: the plain (K, N) weight, which oneDNN repacks on each call; packed: the
// weight laid out once for this CPU (prim::pack_quantized_weight; what nn::Linear runs after
// quantize_dynamic). Prints the oneDNN implementation the int8 matmul runs.
//
//   ./build/bench/bench_quantize [--runs 200]
#include <kiln/kiln.h>

#include "backends/cpu/matmul_onednn.h"
#include "bench/bench_util.h"
#include "ops/primitive.h"

#include <CLI/CLI.hpp>
#include <chrono>

using namespace kiln;

int main(int argc, char** argv) {
  CLI::App app{"kiln int8 Linear against float32"};
  int runs = 200;
  app.add_option("--runs", runs, "timed forwards per shape");
  CLI11_PARSE(app, argc, argv);
  try {
    NoGradGuard no_grad;
    fmt::print("int8 matmul: {}\n", cpu::onednn_quantized_matmul_impl(32, 768, 3072));
    fmt::print("{:>14} {:>6} {:>12} {:>12} {:>12} {:>8}\n", "layer", "batch", "float32 us", "int8 us", "packed us",
               "speed-up");
    for (auto [in, out] : {std::pair<int64_t, int64_t>{768, 3072}, {3072, 768}}) {
      manual_seed(1);
      nn::Linear fc(in, out);
      const nn::QuantizedWeight q = nn::quantize_per_channel(fc.weight);
      nn::QuantizedWeight packed = q;
      packed.packed = prim::pack_quantized_weight(q.values);
      for (int64_t batch : {1, 8, 32, 128}) {
        Tensor x = randn({batch, in}).realize();
        auto time = [&](auto forward) {
          for (int i = 0; i < 5; ++i) forward().realize();
          std::vector<double> us;
          for (int i = 0; i < runs; ++i) {
            auto t0 = std::chrono::steady_clock::now();
            forward().realize();
            us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
          }
          return bench::median(us);
        };
        const double f32 = time([&] { return fc.forward(x); });
        const double i8 = time([&] { return nn::quantized_linear(x, q, fc.bias); });
        const double i8p = time([&] { return nn::quantized_linear(x, packed, fc.bias); });
        fmt::print("{:>14} {:>6} {:>12.1f} {:>12.1f} {:>12.1f} {:>7.2f}x\n", fmt::format("{}->{}", in, out), batch, f32,
                   i8, i8p, f32 / i8p);
      }
    }
  } catch (const Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
