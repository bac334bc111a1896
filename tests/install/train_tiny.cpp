// Built by tests/install/run.sh against an installed kiln only (see CMakeLists.txt there): the
// umbrella header, a Linear layer, SGD, a lazy training loop and the JIT's counters. Exits 0
// when the loss fell; prints why otherwise.
//
// Legend: N = samples, D = input features.
#include <kiln/kiln.h>

#include <cstdio>

int main() {
  constexpr int64_t N = 64, D = 8;
  kiln::nn::Linear fc(D, 1);
  kiln::optim::SGD opt(fc.parameters(), kiln::optim::SGDOptions(0.1));
  kiln::Tensor x = kiln::randn({N, D});                          // (N, D)
  kiln::Tensor y = kiln::sum(x, {1}, /*keepdim=*/true) * 0.5;    // (N, 1): a linear target
  double first = 0, last = 0;
  for (int step = 0; step < 50; ++step) {
    kiln::Tensor loss = kiln::mse_loss(fc.forward(x), y);
    opt.zero_grad();
    loss.backward();
    opt.step({loss});
    (step == 0 ? first : last) = loss.item();
  }
  const kiln::jit::JitStats& stats = kiln::jit::stats();
  std::printf("loss %.5f -> %.5f; %lld kernels run, %lld plan cache hits\n", first, last,
              static_cast<long long>(stats.kernels_run), static_cast<long long>(stats.plan_cache_hits));
  if (!(last < 0.1 * first)) {
    std::printf("the loss did not fall\n");
    return 1;
  }
  return 0;
}
