// Several threads using kiln at once (docs/guide.md, "What kiln guarantees"): each thread records
// and realizes its own graphs, reading realized tensors the threads share; the executor runs one
// plan at a time, so every thread gets the bits it gets alone. CI runs these [threads] cases
// under ThreadSanitizer (.ci/run), where a data race is a failure even when the bits agree.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <omp.h>

#include <thread>
#include <vector>

#include "tests/support/mlp.h"

using namespace kiln;

namespace {

std::vector<float> ramp(int64_t n, float scale, int salt) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>((i * 37 + salt * 11) % 101) - 0.5f * scale * 100;
  return v;
}

// A (16 -> 32 -> 10) MLP whose weights depend only on `salt`: no draw from the shared random
// counter, whose order between threads is not fixed.
std::vector<Tensor> mlp_params(int salt) {
  const std::vector<int64_t> widths = {16, 32, 10};
  std::vector<Tensor> params;
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    params.push_back(from_vector<float>(ramp(widths[i] * widths[i + 1], 0.002f, salt), {widths[i], widths[i + 1]})
                         .realize()
                         .requires_grad_());
    params.push_back(zeros({widths[i + 1]}).realize().requires_grad_());
  }
  return params;
}

Tensor batch(int step, int salt) { return from_vector<float>(ramp(24 * 16, 0.01f, salt + step), {24, 16}); }
Tensor labels(int step) {
  std::vector<int64_t> y(24);
  for (int i = 0; i < 24; ++i) y[static_cast<size_t>(i)] = (i * 7 + step) % 10;
  return from_vector<int64_t>(y, {24});
}

struct Trained {
  std::vector<double> losses;
  std::vector<std::vector<float>> params;
};

// Steps of SGD on the MLP of `salt`, every step one plan (forward, backward, update).
Trained train(int salt, int steps) {
  std::vector<Tensor> params = mlp_params(salt);
  Trained out;
  for (int s = 0; s < steps; ++s)
    out.losses.push_back(testing::mlp_step(params, batch(s, salt), labels(s), 0.1).item());
  for (const Tensor& p : params) out.params.push_back(p.to_vector<float>());
  return out;
}

// Inference of a shared model under no-grad: softmax of the logits of `x`.
std::vector<float> infer(const std::vector<Tensor>& model, const Tensor& x) {
  NoGradGuard no_grad;
  Tensor h = relu(matmul(x, model[0]) + model[1]);
  return softmax(matmul(h, model[2]) + model[3], 1).to_vector<float>();
}

}  // namespace

TEST_CASE("two threads train their own models at once, each bit for bit as alone", "[jit][threads]") {
  constexpr int kThreads = 2, kSteps = 6;
  std::vector<Trained> alone;
  for (int t = 0; t < kThreads; ++t) alone.push_back(train(t, kSteps));
  for (int round = 0; round < 3; ++round) {  // the first round builds plans concurrently, later ones replay them
    std::vector<Trained> together(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) threads.emplace_back([&together, t] { together[t] = train(t, kSteps); });
    for (std::thread& th : threads) th.join();
    for (int t = 0; t < kThreads; ++t) {
      INFO("round " << round << ", thread " << t);
      CHECK(together[t].losses == alone[t].losses);
      CHECK(together[t].params == alone[t].params);
    }
  }
}

TEST_CASE("threads reading one realized model under no-grad get the bits of a single thread", "[jit][threads]") {
  const std::vector<Tensor> model = mlp_params(5);
  std::vector<std::vector<float>> expected;
  for (int t = 0; t < 4; ++t) expected.push_back(infer(model, batch(t, 9)));
  std::vector<std::vector<std::vector<float>>> got(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int repeat = 0; repeat < 5; ++repeat) got[t].push_back(infer(model, batch(t, 9)));
    });
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < 4; ++t)
    for (const std::vector<float>& g : got[t]) CHECK(g == expected[t]);
  // The model is untouched and still usable from this thread.
  CHECK(infer(model, batch(0, 9)) == expected[0]);
}

TEST_CASE("threads building on one pending value each get the single-thread bits", "[jit][threads]") {
  const Tensor base = from_vector<float>(ramp(64 * 48, 0.01f, 3), {64, 48}).realize();
  auto use = [](const Tensor& shared, int t) { return (sum(shared * static_cast<double>(t + 1), {1}) + 1.0).to_vector<float>(); };
  std::vector<std::vector<float>> expected;
  {
    const Tensor shared = exp(base * 0.5);
    for (int t = 0; t < 4; ++t) expected.push_back(use(shared, t));
  }
  for (int round = 0; round < 3; ++round) {
    const Tensor shared = exp(base * 0.5);  // pending: whichever thread runs first computes it
    std::vector<std::vector<float>> got(4);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) threads.emplace_back([&, t] { got[t] = use(shared, t); });
    for (std::thread& th : threads) th.join();
    for (int t = 0; t < 4; ++t) CHECK(got[t] == expected[t]);
  }
}

// Gradients through shared parameters: kiln::grad per thread, and backward() into one .grad.
std::vector<Tensor> loss_of_shared(const std::vector<Tensor>& model, int t) {
  Tensor h = relu(matmul(batch(t, 2), model[0]) + model[1]);
  return {cross_entropy(matmul(h, model[2]) + model[3], labels(t))};
}

TEST_CASE("threads taking gradients through one shared model get the single-thread bits", "[jit][threads]") {
  const std::vector<Tensor> model = mlp_params(7);
  auto grads_of = [&](int t) {
    std::vector<Tensor> g = grad(loss_of_shared(model, t)[0], model);
    sync(g);
    std::vector<std::vector<float>> out;
    for (const Tensor& x : g) out.push_back(x.to_vector<float>());
    return out;
  };
  std::vector<std::vector<std::vector<float>>> expected, got(3);
  for (int t = 0; t < 3; ++t) expected.push_back(grads_of(t));
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t)
    threads.emplace_back([&, t] {
      for (int r = 0; r < 3; ++r) got[t] = grads_of(t);
    });
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < 3; ++t) CHECK(got[t] == expected[t]);
}

TEST_CASE("threads calling backward() through one shared model accumulate every gradient", "[jit][threads]") {
  const std::vector<Tensor> model = mlp_params(8);
  // One thread after another first: the sum every order must reach, up to rounding.
  for (int t = 0; t < 4; ++t) loss_of_shared(model, t)[0].backward();
  std::vector<std::vector<float>> sequential;
  for (const Tensor& p : model) sequential.push_back(p.grad().to_vector<float>());
  for (Tensor p : model) p.zero_grad();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back([&, t] { loss_of_shared(model, t)[0].backward(); });
  for (std::thread& th : threads) th.join();
  for (size_t i = 0; i < model.size(); ++i) {
    const std::vector<float> together = model[i].grad().to_vector<float>();
    REQUIRE(together.size() == sequential[i].size());
    for (size_t j = 0; j < together.size(); ++j) CHECK(together[j] == Approx(sequential[i][j]).margin(1e-6));
  }
}

TEST_CASE("an Error in one thread's graph leaves the other thread's training intact", "[jit][threads][errors]") {
  const Trained alone = train(3, 4);
  Trained together;
  std::thread trainer([&] { together = train(3, 4); });
  int errors = 0;
  for (int i = 0; i < 20; ++i) {
    Tensor a = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
    Tensor idx = from_vector<int64_t>({0, 7}, {1, 2});  // 7 is out of range: the gather fails when it runs
    try {
      gather(a, 1, idx).realize();
    } catch (const Error&) {
      ++errors;
    }
  }
  trainer.join();
  CHECK(errors == 20);
  CHECK(together.losses == alone.losses);
  CHECK(together.params == alone.params);
}

// Not concurrency, but the other meaning of threads: KILN_NUM_THREADS = 0 means every core, also
// after a run with a count (the OpenMP setting outlives the run that made it).
TEST_CASE("KILN_NUM_THREADS=0 after a count gives the kernels every core again", "[jit][threads-flag]") {
  const Tensor x = from_vector<float>(std::vector<float>(40000, 1.0f), {40000}).realize();
  (x + 1.0).realize();
  const int every = omp_get_max_threads();
  {
    FlagsGuard guard;
    flags().num_threads = 1;
    (x + 2.0).realize();
    CHECK(omp_get_max_threads() == 1);
  }
  CHECK((x + 3.0).to_vector<float>()[0] == 4.0f);
  CHECK(omp_get_max_threads() == every);
}
