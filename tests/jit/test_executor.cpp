// Executor tests: laziness, fusion counts, plan-cache replay, eager mode, freeing, failures.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "backends/cpu/compiler.h"
#include "memory/allocator.h"
#include "tests/support/mlp.h"

using namespace kiln;

namespace {

std::vector<float> ramp(int64_t n, float scale = 0.01f) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>((i * 37) % 101) - 0.5f;
  return v;
}

// Kernels one realize of `t` runs.
int64_t kernels_for(Tensor t) {
  int64_t before = jit::stats().kernels_run;
  t.realize();
  return jit::stats().kernels_run - before;
}

// One SGD step of a small MLP, recorded as a single graph and realized together.
struct TinyMlp {
  Tensor w1, b1, w2, b2;
  TinyMlp() {
    w1 = from_vector<float>(ramp(8 * 16, 0.003f), {8, 16}).requires_grad_();
    b1 = zeros({16}).realize().requires_grad_();
    w2 = from_vector<float>(ramp(16 * 1, 0.02f), {16, 1}).requires_grad_();
    b2 = zeros({1}).realize().requires_grad_();
  }
  double step(const Tensor& x, const Tensor& y, double lr) {
    Tensor h = tanh(matmul(x, w1) + b1);
    Tensor loss = mse_loss(matmul(h, w2) + b2, y);
    std::vector<Tensor> params = {w1, b1, w2, b2};
    testing::sgd_step(params, loss, lr);
    return loss.item();
  }
};

Tensor batch_x(int step) { return from_vector<float>(ramp(32 * 8, 0.01f + 0.001f * step), {32, 8}); }
Tensor batch_y(int step) { return from_vector<float>(ramp(32, 0.02f - 0.001f * step), {32, 1}); }

}  // namespace

TEST_CASE("recording ops computes nothing until a value is needed", "[jit]") {
  Tensor x = from_vector<float>(ramp(64), {8, 8});
  int64_t before = jit::stats().kernels_run;
  Tensor y = exp(x) * 2.0 + sin(x);
  Tensor z = sum(y, {1});
  CHECK(jit::stats().kernels_run == before);
  CHECK_FALSE(z.is_realized());
  auto v = z.to_vector<float>();
  CHECK(z.is_realized());
  CHECK(jit::stats().kernels_run > before);
  auto xs = x.to_vector<float>();
  for (int r = 0; r < 8; ++r) {
    double ref = 0;
    for (int c = 0; c < 8; ++c) ref += std::exp(xs[r * 8 + c]) * 2.0 + std::sin(xs[r * 8 + c]);
    CHECK(v[r] == Approx(ref).epsilon(1e-5));
  }
}

TEST_CASE("a chain of 10 elementwise ops is one kernel", "[jit][fusion]") {
  Tensor x = from_vector<float>(ramp(4096), {64, 64});
  Tensor y = x;
  y = y * 1.5;
  y = y + 0.25;
  y = exp(y);
  y = y - 1.0;
  y = tanh(y);
  y = y * y;
  y = sqrt(y + 1.0);
  y = log(y);
  y = -y;
  y = abs(y);
  CHECK(kernels_for(y) == 1);
  auto xs = x.to_vector<float>();
  auto ys = y.to_vector<float>();
  for (size_t i = 0; i < xs.size(); i += 97) {
    double t = std::tanh(std::exp(xs[i] * 1.5 + 0.25) - 1.0);
    CHECK(ys[i] == Approx(std::abs(-std::log(std::sqrt(t * t + 1.0)))).margin(1e-6).epsilon(1e-5));
  }
}

TEST_CASE("softmax over the last axis takes at most 3 kernels", "[jit][fusion]") {
  Tensor x = from_vector<float>(ramp(32 * 10), {32, 10});
  Tensor s = softmax(x, -1);
  CHECK(kernels_for(s) <= 3);
  auto v = s.to_vector<float>();
  for (int r = 0; r < 32; ++r) {
    double total = 0;
    for (int c = 0; c < 10; ++c) total += v[r * 10 + c];
    CHECK(total == Approx(1.0).epsilon(1e-5));
  }
}

TEST_CASE("views fold into the consumer's kernel", "[jit][fusion]") {
  Tensor x = from_vector<float>(ramp(6 * 4), {6, 4});
  Tensor y = transpose(x, 0, 1).slice(1, 1, 5).reshape({2, 8}) * 2.0;
  CHECK(kernels_for(y) == 1);
  auto xs = x.to_vector<float>();
  auto ys = y.to_vector<float>();
  for (int i = 0; i < 16; ++i) {
    int r = i / 4, c = i % 4;  // (4, 4) after slicing: row r of x^T, column 1 + c
    CHECK(ys[i] == Approx(2.0 * xs[(1 + c) * 4 + r]));
  }
}

TEST_CASE("a repeated training step replays from the plan cache", "[jit][plan-cache]") {
  TinyMlp cached;
  cached.step(batch_x(0), batch_y(0), 0.1);  // builds the plan
  auto before = jit::stats();
  double loss1 = cached.step(batch_x(1), batch_y(1), 0.1);
  auto after = jit::stats();
  CHECK(after.kernels_compiled == before.kernels_compiled);
  CHECK(after.plans_built == before.plans_built);
  CHECK(after.plan_cache_hits > before.plan_cache_hits);

  FlagsGuard guard;
  flags().plan_cache = false;
  TinyMlp uncached;
  uncached.step(batch_x(0), batch_y(0), 0.1);
  double loss2 = uncached.step(batch_x(1), batch_y(1), 0.1);
  CHECK(loss1 == loss2);  // bit-identical
  CHECK(cached.w1.to_vector<float>() == uncached.w1.to_vector<float>());
  CHECK(cached.b2.to_vector<float>() == uncached.b2.to_vector<float>());
}

TEST_CASE("training loss falls", "[jit][train]") {
  TinyMlp m;
  double first = m.step(batch_x(0), batch_y(0), 0.2);
  double last = first;
  for (int s = 0; s < 30; ++s) last = m.step(batch_x(0), batch_y(0), 0.2);
  CHECK(last < 0.5 * first);
}

TEST_CASE("eager and lazy modes give identical results", "[jit][eager]") {
  std::vector<double> lazy_losses, eager_losses;
  std::vector<float> lazy_w, eager_w;
  {
    TinyMlp m;
    for (int s = 0; s < 3; ++s) lazy_losses.push_back(m.step(batch_x(s), batch_y(s), 0.1));
    lazy_w = m.w1.to_vector<float>();
  }
  {
    FlagsGuard guard;
    flags().lazy = false;
    TinyMlp m;
    Tensor probe = exp(m.w1);
    CHECK(probe.is_realized());  // eager: every op runs at once
    for (int s = 0; s < 3; ++s) eager_losses.push_back(m.step(batch_x(s), batch_y(s), 0.1));
    eager_w = m.w1.to_vector<float>();
  }
  CHECK(lazy_losses == eager_losses);
  CHECK(lazy_w == eager_w);
}

TEST_CASE("buffers of unreachable nodes are freed", "[jit][memory]") {
  int64_t base = memory::allocated_bytes();
  {
    Tensor x = from_vector<float>(ramp(1 << 16), {256, 256});
    Tensor y = (x * 2.0).realize();
    CHECK(memory::allocated_bytes() >= base + 2 * (1 << 18));
  }
  CHECK(memory::allocated_bytes() == base);
  // Intermediates of a plan do not outlive the realize call.
  Tensor x = from_vector<float>(ramp(1 << 16), {256, 256});
  int64_t with_input = memory::allocated_bytes();
  Tensor s = sum(matmul(x, x) * 2.0);  // the matmul result is an intermediate
  s.realize();
  CHECK(memory::allocated_bytes() == with_input + 4);
}

TEST_CASE("bad input throws kiln::Error and leaves tensors usable", "[jit][errors]") {
  Tensor a = from_vector<float>(ramp(6), {2, 3});
  Tensor b = from_vector<float>(ramp(8), {2, 4});
  REQUIRE_THROWS_WITH(add(a, b), Catch::Contains("add") && Catch::Contains("[2, 3]") && Catch::Contains("[2, 4]"));
  REQUIRE_THROWS_WITH(matmul(a, b), Catch::Contains("matmul") && Catch::Contains("[2, 3]") && Catch::Contains("[2, 4]"));
  REQUIRE_THROWS_AS(sum(a, {2}), Error);
  REQUIRE_THROWS_WITH(sum(a, {-3}), Catch::Contains("axis"));
  REQUIRE_THROWS_WITH(cross_entropy(a, from_vector<float>({0, 1}, {2})), Catch::Contains("cross_entropy"));
  Tensor idx = from_vector<int64_t>({0, 5, 1}, {1, 3});
  Tensor g = gather(a, 1, idx);
  REQUIRE_THROWS_WITH(g.realize(), Catch::Contains("out of range") && Catch::Contains("5"));
  CHECK_FALSE(g.is_realized());
  CHECK(a.to_vector<float>() == ramp(6));
  CHECK((a + 1.0).to_vector<float>()[0] == Approx(ramp(6)[0] + 1.0));
  REQUIRE_THROWS_AS(Tensor().shape(), Error);
}

TEST_CASE("a corrupted kernel cache file is rebuilt", "[jit][cache]") {
  char tmpl[] = "/tmp/kiln-exec-cache-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  {
    FlagsGuard guard;
    flags().use_cuda = false;  // the host compiler's cache files (NVRTC's are tested in test_cuda_render)
    flags().cache_dir = dir;
    cpu::clear_memory_cache();
    jit::clear_plan_cache();
    Tensor x = from_vector<float>(ramp(100), {10, 10});
    auto expected = (cos(x) * 3.0).to_vector<float>();
    int corrupted = 0;
    for (auto& entry : std::filesystem::directory_iterator(dir))
      if (entry.path().extension() == ".so") {
        // A new file (new inode): this process still has the old one mapped.
        std::filesystem::remove(entry.path());
        std::FILE* f = std::fopen(entry.path().c_str(), "wb");
        std::fputs("not an ELF file", f);
        std::fclose(f);
        corrupted++;
      }
    CHECK(corrupted == 1);
    cpu::clear_memory_cache();
    jit::clear_plan_cache();
    int64_t compiled = jit::stats().kernels_compiled;
    CHECK((cos(x) * 3.0).to_vector<float>() == expected);
    CHECK(jit::stats().kernels_compiled > compiled);  // rebuilt, not loaded
    cpu::clear_memory_cache();
    jit::clear_plan_cache();
  }
  std::filesystem::remove_all(dir);
}
