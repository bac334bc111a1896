// optim::GradScaler: an inf or NaN gradient skips the step on the device (parameters, momentum and
// Adam moments bit-identical) and halves the scale; clean steps grow it; step(loss) equals
// backward + step bit for bit; float16 gradients that underflow without scaling survive with it;
// a scaler step runs the same plans as a plain one (no extra realize, plan cache hits, updates in
// place); state round trips; bad input throws kiln::Error and changes nothing.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <vector>

#include "../support/files.h"
#include "../support/mlp.h"
#include "backends/cuda/cuda_runtime.h"

using namespace kiln;
using namespace kiln::optim;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The CPU, and cuda:0 where there is one (the emulator under KILN_CUDA_EMULATOR=1).
std::vector<Device> test_devices() {
  std::vector<Device> devices{Device::cpu()};
  if (cuda::available()) devices.push_back(Device::cuda(0));
  return devices;
}

Tensor on(const std::vector<double>& values, Shape shape, Device device) {
  return from_doubles(values, std::move(shape), DType::Float32).to(device).realize();
}

Tensor make_param(Device device) { return on({0.5, -1.25, 2.0, 0.75, -0.3, 1.5}, {2, 3}, device).requires_grad_(); }

// 0.5 * sum(w * (p - target)^2) + sum(p * poison): the gradient is w * (p - target) + poison, so
// a poison of inf or NaN in one place injects it into the gradient (and the loss).
Tensor loss_of(const Tensor& p, double poison = 0) {
  const Device d = p.device();
  Tensor diff = p - on({0.1, 0.2, -0.3, 0.4, -0.5, 0.6}, {2, 3}, d);
  Tensor quadratic = (on({1.0, 2.0, 0.5, 3.0, 1.5, 0.25}, {2, 3}, d) * diff * diff).sum() * 0.5;
  return quadratic + (p * on({0, 0, 0, poison, 0, 0}, {2, 3}, d)).sum();
}

enum class Style { Backward, StepLoss };
const char* name(Style s) { return s == Style::Backward ? "scale(loss).backward(); step(opt)" : "step(opt, loss)"; }

void scaled_step(GradScaler& scaler, Optimizer& opt, const Tensor& loss, Style style) {
  if (style == Style::Backward) {
    opt.zero_grad();
    scaler.scale(loss).backward();
    scaler.step(opt, {loss});
  } else {
    scaler.step(opt, loss);
  }
  scaler.update();
}

// The bits of a float32 tensor, wherever it lives.
std::vector<uint32_t> bits(const Tensor& t) {
  std::vector<float> values = t.detach().to(Device::cpu()).to_vector<float>();
  std::vector<uint32_t> out(values.size());
  std::memcpy(out.data(), values.data(), values.size() * sizeof(float));
  return out;
}

// Every float32 value of a step: the parameters and each state tensor, by name.
std::map<std::string, std::vector<uint32_t>> snapshot(const Optimizer& opt) {
  std::map<std::string, std::vector<uint32_t>> out;
  std::vector<Tensor> params = opt.parameters();
  for (size_t i = 0; i < params.size(); ++i) out["param." + std::to_string(i)] = bits(params[i]);
  for (const auto& [key, t] : opt.state())
    if (t.dtype() == DType::Float32) out[key] = bits(t);
  return out;
}

int64_t tracker_of(const GradScaler& scaler) {
  return static_cast<int64_t>(scaler.state().at("growth_tracker").item());
}

}  // namespace

TEST_CASE("GradScaler: an inf or NaN gradient skips the step and halves the scale", "[optim][scaler][device]") {
  for (Device device : test_devices())
    for (double poison : {kInf, kNaN})
      for (bool adam : {false, true})
        for (Style style : {Style::Backward, Style::StepLoss}) {
          INFO(device.str() << ", poison " << poison << ", " << (adam ? "Adam" : "SGD momentum") << ", "
                            << name(style));
          Tensor p = make_param(device);
          std::unique_ptr<Optimizer> opt;
          if (adam) opt = std::make_unique<Adam>(std::vector<Tensor>{p}, AdamOptions(0.01));
          else opt = std::make_unique<SGD>(std::vector<Tensor>{p}, SGDOptions(0.05).momentum(0.9));
          GradScaler scaler;
          for (int s = 0; s < 2; ++s) scaled_step(scaler, *opt, loss_of(p), style);  // momentum, moments != 0
          CHECK(tracker_of(scaler) == 2);
          auto before = snapshot(*opt);
          REQUIRE(before.size() == (adam ? 3u : 2u));

          scaled_step(scaler, *opt, loss_of(p, poison), style);
          CHECK(snapshot(*opt) == before);
          CHECK(scaler.get_scale() == 32768.0);
          CHECK(tracker_of(scaler) == 0);
          CHECK(scaler.state().at("scale").device() == device);

          scaled_step(scaler, *opt, loss_of(p), style);  // a clean step updates again
          CHECK(bits(p) != before.at("param.0"));
          CHECK(scaler.get_scale() == 32768.0);
          CHECK(tracker_of(scaler) == 1);
        }
}

TEST_CASE("GradScaler: growth_interval clean steps in a row grow the scale", "[optim][scaler]") {
  Tensor p = make_param(Device::cpu());
  SGD opt({p}, SGDOptions(0.01));
  GradScaler scaler(GradScalerOptions().init_scale(8.0).growth_interval(3));
  auto step = [&](double poison = 0) { scaled_step(scaler, opt, loss_of(p, poison), Style::StepLoss); };
  step(), step();
  CHECK(scaler.get_scale() == 8.0);
  CHECK(tracker_of(scaler) == 2);
  step();
  CHECK(scaler.get_scale() == 16.0);
  CHECK(tracker_of(scaler) == 0);
  step(), step(), step(kNaN);  // an inf or NaN restarts the count
  CHECK(scaler.get_scale() == 8.0);
  CHECK(tracker_of(scaler) == 0);
  step(), step(), step();
  CHECK(scaler.get_scale() == 16.0);

  // Growth that would overflow float32 keeps the scale (as PyTorch's _amp_update_scale_).
  GradScaler top(GradScalerOptions().init_scale(std::ldexp(1.0, 127)).growth_interval(1));
  scaled_step(top, opt, loss_of(p) * 0.0, Style::StepLoss);  // 0 * 2^127: no inf in the gradients
  CHECK(top.get_scale() == std::ldexp(1.0, 127));
  CHECK(tracker_of(top) == 0);
}

TEST_CASE("GradScaler: 2000 clean steps at the defaults double the scale", "[optim][scaler]") {
  Tensor w = from_vector<float>({0.5f}, {1}).realize().requires_grad_();
  SGD opt({w}, SGDOptions(1e-3));
  GradScaler scaler;
  for (int s = 0; s < 1999; ++s) scaled_step(scaler, opt, (w * w).sum(), Style::StepLoss);
  CHECK(scaler.get_scale() == 65536.0);
  CHECK(tracker_of(scaler) == 1999);
  scaled_step(scaler, opt, (w * w).sum(), Style::StepLoss);
  CHECK(scaler.get_scale() == 131072.0);
  CHECK(tracker_of(scaler) == 0);
}

TEST_CASE("GradScaler: step(opt with loss) equals scale(loss).backward() then step(opt) bit for bit",
          "[optim][scaler][device]") {
  for (Device device : test_devices()) {
    INFO(device.str());
    std::vector<std::map<std::string, std::vector<uint32_t>>> results;
    std::vector<double> scales;
    for (Style style : {Style::Backward, Style::StepLoss}) {
      manual_seed(11);
      std::vector<Tensor> params = testing::make_mlp({6, 8, 3});
      for (Tensor& p : params) p = p.detach().to(device).realize().requires_grad_();
      Adam opt(params, AdamOptions(0.01));
      GradScaler scaler(GradScalerOptions().growth_interval(2));
      for (int s = 0; s < 5; ++s) {
        Tensor x = (randn({4, 6}) * (s == 2 ? kInf : 1.0)).to(device);  // step 3 overflows
        Tensor y = from_vector<int64_t>({0, 2, 1, 0}, {4}).to(device);
        Tensor h = relu(matmul(x, params[0]) + params[1]);
        scaled_step(scaler, opt, nn::cross_entropy(matmul(h, params[2]) + params[3], y), style);
      }
      results.push_back(snapshot(opt));
      scales.push_back(scaler.get_scale());
    }
    CHECK(results[0] == results[1]);
    CHECK(scales[0] == scales[1]);
    CHECK(scales[0] == 131072.0);  // grown at step 2, halved at 3, grown again at 5
  }
}

TEST_CASE("GradScaler: float16 gradients that underflow to zero survive with scaling", "[optim][scaler][device]") {
  for (Device device : test_devices()) {
    INFO(device.str());
    const std::vector<double> xs = {1.0, -2.0, 3.0, 0.5};
    Tensor w = on({0.25, 0.5, -1.0, 2.0}, {4}, device).requires_grad_();
    Tensor x = on(xs, {4}, device);
    // The product runs in float16; d(loss)/d(product) = 1e-8 is below float16's smallest
    // subnormal (6e-8), so the gradient that reaches w is zero.
    auto loss_of_w = [&] {
      return cast(cast(w, DType::Float16) * cast(x, DType::Float16), DType::Float32).sum() * 1e-8;
    };
    for (double g : grad(loss_of_w(), {w})[0].to(Device::cpu()).to_doubles()) CHECK(g == 0.0);

    SGD opt({w}, SGDOptions(1e6));
    GradScaler scaler;
    scaler.scale(loss_of_w()).backward();
    scaler.unscale_(opt);
    std::vector<double> unscaled = w.grad().to(Device::cpu()).to_doubles();
    for (size_t i = 0; i < xs.size(); ++i) CHECK(unscaled[i] == Approx(xs[i] * 1e-8).epsilon(2e-3));
    std::vector<uint32_t> before = bits(w);
    scaler.step(opt);
    scaler.update();
    CHECK(bits(w) != before);  // it trains
    CHECK(scaler.get_scale() == 65536.0);
  }
}

TEST_CASE("GradScaler: a scaler step runs the plans of a plain step from the plan cache and in place",
          "[optim][scaler][device]") {
  if (!flags().lazy) return;  // eager mode runs op by op
  for (Device device : test_devices())
    for (Style style : {Style::Backward, Style::StepLoss}) {
      INFO(device.str() << ", " << name(style));
      auto mlp = [&] {
        manual_seed(3);
        std::vector<Tensor> params = testing::make_mlp({6, 8, 3});
        for (Tensor& p : params) p = p.detach().to(device).realize().requires_grad_();
        return params;
      };
      Tensor x = randn({4, 6}).to(device).realize(), y = from_vector<int64_t>({0, 2, 1, 0}, {4}).to(device);
      auto loss_of_params = [&](const std::vector<Tensor>& p) {
        return nn::cross_entropy(matmul(relu(matmul(x, p[0]) + p[1]), p[2]) + p[3], y);
      };
      // Plans a step runs: built or replayed (each realize of pending work counts one of them).
      auto plans = [] { return jit::stats().plans_built + jit::stats().plan_cache_hits; };

      std::vector<Tensor> plain_params = mlp();
      Adam plain(plain_params, AdamOptions(0.01));
      auto plain_step = [&] {
        Tensor loss = loss_of_params(plain_params);
        if (style == Style::Backward) {
          plain.zero_grad();
          loss.backward();
          plain.step({loss});
        } else {
          plain.step(loss);
        }
      };
      plain_step();
      int64_t built = jit::stats().plans_built, before = plans();
      for (int s = 0; s < 4; ++s) plain_step();
      const int64_t plain_plans = plans() - before;
      CHECK(jit::stats().plans_built == built);

      std::vector<Tensor> params = mlp();
      Adam opt(params, AdamOptions(0.01));
      GradScaler scaler;
      scaled_step(scaler, opt, loss_of_params(params), style);
      std::vector<const void*> buffers;
      for (const Tensor& p : params) buffers.push_back(p.data());
      built = jit::stats().plans_built;
      const int64_t compiled = jit::stats().kernels_compiled;
      before = plans();
      for (int s = 0; s < 4; ++s) scaled_step(scaler, opt, loss_of_params(params), style);
      CHECK(plans() - before == plain_plans);  // no realize of its own: nothing read on the host
      CHECK(plain_plans == 4);
      CHECK(jit::stats().plans_built == built);  // the plan cache serves every step from step 2 on
      CHECK(jit::stats().kernels_compiled == compiled);
      for (size_t i = 0; i < params.size(); ++i) {
        INFO("parameter " << i);
        CHECK(params[i].data() == buffers[i]);  // updated in place, select and all
      }
    }
}

TEST_CASE("GradScaler: 50 steps leave no pending graph behind", "[optim][scaler]") {
  // The PyTorch recipe with clipping: unscale_, clip, step, update. After each iteration the
  // scale, the tracker and the parameters are realized values, not a growing lazy graph.
  Tensor p = make_param(Device::cpu());
  SGD opt({p}, SGDOptions(0.01).momentum(0.9));
  GradScaler scaler(GradScalerOptions().growth_interval(7));
  int64_t built = 0;
  for (int s = 0; s < 50; ++s) {
    Tensor loss = loss_of(p, s % 10 == 5 ? kInf : 0.0);
    opt.zero_grad();
    scaler.scale(loss).backward();
    scaler.unscale_(opt);
    clip_grad_norm(opt.parameters(), 10.0);
    scaler.step(opt, {loss});
    scaler.update();
    for (const auto& [key, t] : scaler.state()) CHECK(t.is_realized());
    CHECK(p.is_realized());
    if (s == 1) built = jit::stats().plans_built;
  }
  CHECK(jit::stats().plans_built == built);
  // Five skipped steps, and the tracker reached 7 in the runs of clean steps between them.
  CHECK(std::isfinite(p.to_vector<float>()[0]));

  // update() after unscale_ alone (no step) computes the next scale lazily; the next step's plan
  // realizes it.
  Tensor loss = loss_of(p, kInf);
  opt.zero_grad();
  const double scale = scaler.get_scale();
  scaler.scale(loss).backward();
  scaler.unscale_(opt);
  scaler.update();
  CHECK(!scaler.state().at("scale").is_realized());
  scaled_step(scaler, opt, loss_of(p), Style::StepLoss);
  CHECK(scaler.state().at("scale").is_realized());
  CHECK(scaler.get_scale() == scale * 0.5);
}

TEST_CASE("GradScaler: each optimizer skips on its own gradients and update sees them all", "[optim][scaler]") {
  Tensor a = make_param(Device::cpu()), b = make_param(Device::cpu());
  SGD opt_a({a}, SGDOptions(0.1)), opt_b({b}, SGDOptions(0.1));
  GradScaler scaler;
  Tensor loss = loss_of(a) + loss_of(b, kInf);
  std::vector<uint32_t> a_before = bits(a), b_before = bits(b);
  scaler.scale(loss).backward();
  scaler.step(opt_a);
  scaler.step(opt_b);
  scaler.update();
  CHECK(bits(a) != a_before);
  CHECK(bits(b) == b_before);
  CHECK(scaler.get_scale() == 32768.0);

  // An optimizer none of whose parameters has a gradient finds nothing to skip.
  Tensor frozen = make_param(Device::cpu());
  SGD opt_frozen({frozen}, SGDOptions(0.1));
  opt_a.zero_grad();
  scaler.scale(loss_of(a)).backward();
  scaler.step(opt_frozen);
  scaler.update();
  CHECK(scaler.get_scale() == 32768.0);
  CHECK(tracker_of(scaler) == 1);
}

TEST_CASE("GradScaler: without AMP a power-of-two scale changes no bit of float32 training", "[optim][scaler]") {
  // Scaling by 2^k and back is exact in float32 (short of overflow), so the scaler is only math.
  std::vector<std::map<std::string, std::vector<uint32_t>>> results;
  for (int variant = 0; variant < 3; ++variant) {  // no scaler, scaler, disabled scaler
    manual_seed(5);
    std::vector<Tensor> params = testing::make_mlp({6, 8, 3});
    SGD opt(params, SGDOptions(0.1).momentum(0.9));
    GradScaler scaler(GradScalerOptions().enabled(variant != 1));
    for (int s = 0; s < 4; ++s) {
      Tensor x = randn({4, 6}), y = from_vector<int64_t>({0, 2, 1, 0}, {4});
      Tensor loss = nn::cross_entropy(matmul(relu(matmul(x, params[0]) + params[1]), params[2]) + params[3], y);
      if (variant == 0) {
        opt.zero_grad();
        loss.backward();
        opt.step({loss});
      } else {
        scaled_step(scaler, opt, loss, Style::Backward);
      }
    }
    results.push_back(snapshot(opt));
  }
  CHECK(results[1] == results[0]);
  CHECK(results[2] == results[0]);
}

TEST_CASE("GradScaler: disabled it passes everything through", "[optim][scaler]") {
  GradScaler scaler(GradScalerOptions().enabled(false));
  Tensor p = make_param(Device::cpu());
  SGD opt({p}, SGDOptions(0.1));
  Tensor loss = loss_of(p, kInf);
  CHECK(scaler.scale(loss).node() == loss.node());
  scaler.scale(loss).backward();
  scaler.unscale_(opt);
  scaler.unscale_(opt);  // no check either
  scaler.step(opt);      // a plain step: the inf goes into the parameter
  scaler.update();
  CHECK(std::isinf(p.to_vector<float>()[3]));
  CHECK(scaler.get_scale() == 1.0);
  CHECK(scaler.state().empty());
  scaler.load_state({});  // ignored
}

TEST_CASE("GradScaler: state round trips alone and saved with the optimizer", "[optim][scaler]") {
  Tensor p = make_param(Device::cpu());
  SGD opt({p}, SGDOptions(0.01).momentum(0.9));
  GradScaler scaler(GradScalerOptions().growth_interval(4));
  CHECK(scaler.get_scale() == 65536.0);
  CHECK(scaler.state().at("scale").item() == 65536.0);  // before the first step: the initial values
  for (double poison : {0.0, kInf, 0.0, 0.0}) scaled_step(scaler, opt, loss_of(p, poison), Style::StepLoss);
  auto state = scaler.state();
  CHECK(state.at("scale").item() == 32768.0);
  CHECK(state.at("scale").dtype() == DType::Float32);
  CHECK(state.at("growth_tracker").item() == 2.0);
  CHECK(state.at("growth_tracker").dtype() == DType::Int32);

  GradScaler copy(GradScalerOptions().growth_interval(4));
  copy.load_state(state);
  CHECK(copy.get_scale() == 32768.0);
  CHECK(tracker_of(copy) == 2);

  const std::string path = testing::temp_path("kiln_scaler", "opt.safetensors");
  optim::save(opt, scaler, path);
  Tensor q = make_param(Device::cpu());
  SGD opt2({q}, SGDOptions(0.5));
  GradScaler restored(GradScalerOptions().growth_interval(4));
  optim::load(opt2, restored, path);
  CHECK(restored.get_scale() == 32768.0);
  CHECK(tracker_of(restored) == 2);
  CHECK(opt2.lr() == 0.01);
  SGD opt3({make_param(Device::cpu())}, SGDOptions(0.5));
  optim::load(opt3, path);  // without a scaler: its entries are ignored
  CHECK(opt3.lr() == 0.01);

  // A file saved without a scaler has no scaler state: an Error, and nothing changes.
  optim::save(opt, path);
  GradScaler fresh;
  SGD opt4({make_param(Device::cpu())}, SGDOptions(0.5));
  CHECK_THROWS_AS(optim::load(opt4, fresh, path), Error);
  CHECK(fresh.get_scale() == 65536.0);
  CHECK(opt4.lr() == 0.5);
  CHECK(opt4.state().empty());
  std::filesystem::remove(path);
}

TEST_CASE("GradScaler: bad input throws kiln::Error and changes nothing", "[optim][scaler][errors]") {
  using O = GradScalerOptions;
  for (O bad : {O().init_scale(0), O().init_scale(-1), O().init_scale(kInf), O().init_scale(kNaN), O().growth_factor(1),
                O().growth_factor(0.5), O().backoff_factor(0), O().backoff_factor(1), O().backoff_factor(1.5),
                O().growth_interval(0)})
    CHECK_THROWS_AS(GradScaler(bad), Error);
  CHECK_THROWS_WITH(GradScaler(O().growth_factor(1)),
                    Catch::Contains("optim::GradScaler") && Catch::Contains("growth_factor"));

  Tensor p = make_param(Device::cpu());
  SGD opt({p}, SGDOptions(0.1));
  GradScaler scaler;
  CHECK_THROWS_WITH(scaler.unscale_(opt), Catch::Contains("scale the loss"));
  CHECK_THROWS_WITH(scaler.update(), Catch::Contains("update()"));
  scaler.scale(loss_of(p)).backward();
  scaler.unscale_(opt);
  CHECK_THROWS_WITH(scaler.unscale_(opt), Catch::Contains("unscale_ has already been called"));
  CHECK_THROWS_AS(scaler.step(opt, loss_of(p)), Error);  // p.grad() unscaled, but step(loss) ignores it
  scaler.step(opt);
  CHECK_THROWS_AS(scaler.step(opt), Error);     // twice without update()
  CHECK_THROWS_AS(scaler.unscale_(opt), Error);  // after step()
  scaler.update();

  // An update() that calls Tensor::assign itself cannot be skipped on the device: an Error that
  // names the fix, under the scaler only.
  struct DirectSGD : SGD {
    using SGD::SGD;
    void update(size_t, Tensor& param, const Tensor& grad, ParamState&) override { param.assign(param - grad * 0.1); }
  };
  Tensor q = make_param(Device::cpu());
  DirectSGD direct({q}, SGDOptions(0.1));
  direct.step(loss_of(q));
  CHECK_THROWS_WITH(GradScaler().step(direct, loss_of(q)), Catch::Contains("Optimizer::assign"));

  // load_state: missing or unknown keys, shapes, dtypes and values; the scaler keeps its state.
  const auto good = scaler.state();
  auto with = [&](const std::string& key, const Tensor& value) {
    auto s = good;
    if (value.defined()) s[key] = value;
    else s.erase(key);
    return s;
  };
  for (const auto& bad : {with("scale", {}), with("growth_tracker", {}), with("extra", scalar(1.0)),
                          with("scale", full({1}, 4.0)), with("scale", scalar(4.0, DType::Float64)),
                          with("growth_tracker", scalar(3.0)), with("scale", scalar(0.0)),
                          with("scale", scalar(kInf)), with("growth_tracker", scalar(-1, DType::Int32))}) {
    CHECK_THROWS_WITH(scaler.load_state(bad), Catch::Contains("optim::GradScaler"));
    CHECK(scaler.get_scale() == 65536.0);
    CHECK(tracker_of(scaler) == 1);
  }
}
