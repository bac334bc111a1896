// nn layers and losses against plain-loop references and closed forms; a tiny MLP trains.
#include <catch2/catch.hpp>
#include <cmath>
#include <kiln/kiln.h>

#include "tests/support/compare.h"
#include "tests/support/gradcheck.h"

using namespace kiln;
using kiln::testing::check_close;

TEST_CASE("Linear matches a reference loop", "[nn]") {
  manual_seed(11);
  nn::Linear fc(5, 3);
  CHECK(fc.weight.shape() == Shape{3, 5});
  Tensor x = randn({4, 5});
  auto xs = x.to_vector<float>(), w = fc.weight.to_vector<float>(), b = fc.bias.to_vector<float>();
  auto y = fc.forward(x).to_vector<float>();
  for (int n = 0; n < 4; ++n)
    for (int o = 0; o < 3; ++o) {
      double ref = b[o];
      for (int i = 0; i < 5; ++i) ref += double(xs[n * 5 + i]) * w[o * 5 + i];
      CHECK(y[n * 3 + o] == Approx(ref).margin(1e-5));
    }
  // PyTorch's init bound: 1/sqrt(in) for weight (kaiming a=sqrt(5)) and bias.
  double bound = 1.0 / std::sqrt(5.0);
  for (float v : w) CHECK(std::abs(v) <= bound + 1e-6);
  for (float v : b) CHECK(std::abs(v) <= bound + 1e-6);
  nn::Linear no_bias(nn::LinearOptions(5, 3).bias(false));
  CHECK_FALSE(no_bias.bias.defined());
  CHECK(no_bias.parameters().size() == 1);
  CHECK_THROWS_AS(fc.forward(randn({4, 6})), Error);
}

TEST_CASE("initializers assign values with the documented bounds", "[nn]") {
  manual_seed(5);
  Tensor w = zeros({64, 32}).requires_grad_();
  nn::init::kaiming_uniform_(w);
  double bound = std::sqrt(2.0) * std::sqrt(3.0 / 32.0);
  double max_abs = 0;
  for (double v : w.to_doubles()) max_abs = std::max(max_abs, std::abs(v));
  CHECK(max_abs <= bound + 1e-6);
  CHECK(max_abs > 0.8 * bound);
  nn::init::xavier_uniform_(w);
  double xbound = std::sqrt(6.0 / 96.0);
  for (double v : w.to_doubles()) CHECK(std::abs(v) <= xbound + 1e-6);
  nn::init::kaiming_normal_(w);
  double sq = 0;
  for (double v : w.to_doubles()) sq += v * v;
  CHECK(std::sqrt(sq / w.numel()) == Approx(std::sqrt(2.0 / 32.0)).epsilon(0.1));
  nn::init::xavier_normal_(w, 2.0);
  nn::init::ones_(w);
  for (double v : w.to_doubles()) CHECK(v == 1.0);
  nn::init::zeros_(w);
  for (double v : w.to_doubles()) CHECK(v == 0.0);
  CHECK(w.requires_grad());
}

TEST_CASE("Dropout drops in training and is the identity in eval", "[nn]") {
  manual_seed(1);
  nn::Dropout drop(0.5);
  Tensor x = ones({1000});
  auto y = drop.forward(x).to_vector<float>();
  int zeros_seen = 0;
  for (float v : y) {
    CHECK((v == 0.0f || v == 2.0f));
    zeros_seen += v == 0.0f;
  }
  CHECK(zeros_seen > 400);
  CHECK(zeros_seen < 600);
  drop.eval();
  for (float v : drop.forward(x).to_vector<float>()) CHECK(v == 1.0f);
  CHECK_THROWS_AS(nn::Dropout(1.0), Error);
}

TEST_CASE("BatchNorm1d uses batch stats in training, running stats in eval", "[nn]") {
  nn::BatchNorm1d bn(nn::BatchNorm1dOptions(2).momentum(0.25));
  // x (N=4, C=2): channel 0 = 1, 2, 3, 4; channel 1 = 10, 10, 20, 20.
  Tensor x = from_vector<float>({1, 10, 2, 10, 3, 20, 4, 20}, {4, 2});
  auto y = bn.forward(x).to_vector<float>();
  // channel 0: mean 2.5, biased var 1.25; channel 1: mean 15, var 25.
  for (int n = 0; n < 4; ++n) {
    double c0 = n + 1, c1 = n < 2 ? 10 : 20;
    CHECK(y[n * 2] == Approx((c0 - 2.5) / std::sqrt(1.25 + 1e-5)).margin(1e-5));
    CHECK(y[n * 2 + 1] == Approx((c1 - 15.0) / std::sqrt(25.0 + 1e-5)).margin(1e-5));
  }
  // Running stats: (1 - m) * init + m * batch, the variance unbiased (x 4/3).
  auto mean = bn.running_mean.to_vector<float>(), var = bn.running_var.to_vector<float>();
  CHECK(mean[0] == Approx(0.25 * 2.5));
  CHECK(mean[1] == Approx(0.25 * 15.0));
  CHECK(var[0] == Approx(0.75 + 0.25 * 1.25 * 4.0 / 3.0));
  CHECK(var[1] == Approx(0.75 + 0.25 * 25.0 * 4.0 / 3.0));
  CHECK(bn.num_batches_tracked.item() == 1.0);

  bn.eval();
  auto e = bn.forward(x).to_vector<float>();
  for (int n = 0; n < 4; ++n) {
    double c0 = n + 1, c1 = n < 2 ? 10 : 20;
    CHECK(e[n * 2] == Approx((c0 - mean[0]) / std::sqrt(var[0] + 1e-5)).margin(1e-5));
    CHECK(e[n * 2 + 1] == Approx((c1 - mean[1]) / std::sqrt(var[1] + 1e-5)).margin(1e-5));
  }
  CHECK(bn.running_mean.to_vector<float>() == mean);  // eval leaves the statistics alone
  CHECK(bn.num_batches_tracked.item() == 1.0);

  // (N, C, L) input normalizes over N and L.
  nn::BatchNorm1d bn3(3);
  Tensor y3 = bn3.forward(randn({4, 3, 5}));
  CHECK(y3.shape() == Shape{4, 3, 5});
  for (double v : kiln::mean(y3, {0, 2}).to_doubles()) CHECK(v == Approx(0.0).margin(1e-5));
}

TEST_CASE("BatchNorm2d normalizes per channel over N, H, W", "[nn][batchnorm]") {
  nn::BatchNorm2d bn(nn::BatchNorm2dOptions(2).momentum(0.25));
  CHECK_THAT(bn.to_string(), Catch::Contains("BatchNorm2d(2"));
  CHECK(bn.weight.shape() == Shape{2});
  CHECK(bn.named_buffers().size() == 3);
  // x (N=2, C=2, H=1, W=2): channel 0 = 1, 2, 3, 4 (n-major); channel 1 = 10, 10, 20, 40.
  std::vector<double> xs = {1, 2, 10, 10, 3, 4, 20, 40};
  Tensor x = from_doubles(xs, {2, 2, 1, 2}, DType::Float32);
  double mean0 = 2.5, var0 = 1.25, mean1 = 20, var1 = (100 + 100 + 0 + 400) / 4.0;
  auto normalized = [&](const std::vector<double>& m, const std::vector<double>& v) {
    std::vector<double> want;
    for (int n = 0; n < 2; ++n)
      for (int c = 0; c < 2; ++c)
        for (int w = 0; w < 2; ++w) {
          double value = xs[static_cast<size_t>((n * 2 + c) * 2 + w)];
          want.push_back((value - m[c]) / std::sqrt(v[c] + 1e-5));
        }
    return want;
  };
  check_close(bn.forward(x), normalized({mean0, mean1}, {var0, var1}), 1e-5, 1e-5);
  // Running statistics: (1 - m) * initial + m * batch, the variance unbiased (x 4/3 for 4 values).
  double rm0 = 0.25 * mean0, rm1 = 0.25 * mean1;
  double rv0 = 0.75 + 0.25 * var0 * 4.0 / 3.0, rv1 = 0.75 + 0.25 * var1 * 4.0 / 3.0;
  check_close(bn.running_mean, {rm0, rm1});
  check_close(bn.running_var, {rv0, rv1});
  CHECK(bn.num_batches_tracked.item() == 1.0);
  // A second step moves the statistics again.
  bn.forward(x);
  check_close(bn.running_mean, {0.75 * rm0 + 0.25 * mean0, 0.75 * rm1 + 0.25 * mean1});
  CHECK(bn.num_batches_tracked.item() == 2.0);

  bn.eval();
  auto running_mean = bn.running_mean.to_doubles(), running_var = bn.running_var.to_doubles();
  check_close(bn.forward(x), normalized(running_mean, running_var), 1e-5, 1e-5);
  check_close(bn.running_mean, running_mean);  // eval leaves the statistics alone
  CHECK(bn.num_batches_tracked.item() == 2.0);

  // Affine parameters scale and shift each channel.
  nn::BatchNorm2d affine(2);
  Tensor(affine.weight).assign(from_vector<float>({2, 3}, {2}));
  Tensor(affine.bias).assign(from_vector<float>({1, -1}, {2}));
  auto plain = normalized({mean0, mean1}, {var0, var1});
  std::vector<double> scaled;
  for (size_t i = 0; i < plain.size(); ++i) scaled.push_back(i % 4 < 2 ? plain[i] * 2 + 1 : plain[i] * 3 - 1);
  check_close(affine.forward(x), scaled, 1e-5, 1e-5);

  // Without running statistics, eval mode keeps using the batch.
  nn::BatchNorm2d batch_only(nn::BatchNorm2dOptions(2).track_running_stats(false).affine(false));
  CHECK(batch_only.parameters().empty());
  batch_only.eval();
  check_close(batch_only.forward(x), normalized({mean0, mean1}, {var0, var1}), 1e-5, 1e-5);

  CHECK_THROWS_AS(bn.forward(randn({4, 2})), Error);         // (N, C): BatchNorm1d's input
  CHECK_THROWS_AS(bn.forward(randn({2, 3, 2, 2})), Error);   // wrong channel count
  bn.train();
  CHECK_THROWS_AS(bn.forward(randn({1, 2, 1, 1})), Error);   // one value per channel
  CHECK_THROWS_AS(nn::BatchNorm2d(0), Error);
}

TEST_CASE("gradient of BatchNorm2d in training mode", "[nn][batchnorm][gradcheck]") {
  nn::BatchNorm2d bn(nn::BatchNorm2dOptions(2).track_running_stats(false));
  auto f = [bn](const std::vector<Tensor>& v) mutable { return bn.forward(v[0]); };
  auto result = kiln::testing::gradcheck(f, {kiln::testing::uniform({2, 2, 2, 3}, -2, 2, 600)});
  INFO(result.report);
  CHECK(result.ok);
}

TEST_CASE("activations, Flatten, LayerNorm and Embedding", "[nn]") {
  Tensor x = from_vector<float>({-2, -0.5, 0, 1.5}, {2, 2});
  auto xs = x.to_vector<float>();
  auto relu_y = nn::ReLU().forward(x).to_vector<float>();
  auto sig_y = nn::Sigmoid().forward(x).to_vector<float>();
  auto tanh_y = nn::Tanh().forward(x).to_vector<float>();
  auto silu_y = nn::SiLU().forward(x).to_vector<float>();
  auto gelu_y = nn::GELU().forward(x).to_vector<float>();
  for (int i = 0; i < 4; ++i) {
    double v = xs[i], s = 1.0 / (1.0 + std::exp(-v));
    CHECK(relu_y[i] == Approx(std::max(v, 0.0)));
    CHECK(sig_y[i] == Approx(s));
    CHECK(tanh_y[i] == Approx(std::tanh(v)));
    CHECK(silu_y[i] == Approx(v * s).margin(1e-6));
    CHECK(gelu_y[i] == Approx(0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0)))).margin(1e-5));
  }
  CHECK(nn::Flatten().forward(zeros({2, 3, 4})).shape() == Shape{2, 12});

  nn::LayerNorm ln(4);
  Tensor h = from_vector<float>({1, 2, 3, 4}, {1, 4});
  auto l = ln.forward(h).to_vector<float>();
  for (int i = 0; i < 4; ++i) CHECK(l[i] == Approx((i + 1 - 2.5) / std::sqrt(1.25 + 1e-5)).margin(1e-5));

  nn::Embedding emb(5, 3);
  Tensor idx = from_vector<int64_t>({4, 0, 4, 2}, {2, 2});
  Tensor e = emb.forward(idx);
  CHECK(e.shape() == Shape{2, 2, 3});
  auto table = emb.weight.to_vector<float>(), rows = e.to_vector<float>();
  std::vector<int> picks{4, 0, 4, 2};
  for (int r = 0; r < 4; ++r)
    for (int d = 0; d < 3; ++d) CHECK(rows[r * 3 + d] == table[picks[r] * 3 + d]);
}

TEST_CASE("losses match closed forms", "[nn]") {
  Tensor logits = from_vector<double>({2.0, -1.0, 0.5, 0.0, 1.0, 3.0}, {2, 3});
  Tensor labels = from_vector<int64_t>({0, 2}, {2});
  auto lg = logits.to_vector<double>();
  auto lse = [&](int n) {
    double s = 0;
    for (int c = 0; c < 3; ++c) s += std::exp(lg[n * 3 + c]);
    return std::log(s);
  };
  double ce = ((lse(0) - lg[0]) + (lse(1) - lg[5])) / 2;
  CHECK(nn::cross_entropy(logits, labels).item() == Approx(ce));
  double smooth = 0;
  for (int n = 0; n < 2; ++n)
    for (int c = 0; c < 3; ++c) {
      double target = (c == (n == 0 ? 0 : 2) ? 0.9 : 0.0) + 0.1 / 3;
      smooth += target * (lse(n) - lg[n * 3 + c]);
    }
  CHECK(nn::cross_entropy(logits, labels, nn::CrossEntropyOptions().label_smoothing(0.1)).item() ==
        Approx(smooth / 2));
  CHECK(nn::cross_entropy(logits, labels, nn::CrossEntropyOptions().label_smoothing(0.1).reduction(nn::Reduction::Sum))
            .item() == Approx(smooth));
  // Reduction::None: one loss per row (N), without and with smoothing.
  auto rows = nn::cross_entropy(logits, labels, nn::CrossEntropyOptions().reduction(nn::Reduction::None));
  REQUIRE(rows.shape() == Shape{2});
  CHECK(rows.to_vector<double>()[0] == Approx(lse(0) - lg[0]));
  CHECK(rows.to_vector<double>()[1] == Approx(lse(1) - lg[5]));
  auto smooth_rows = nn::cross_entropy(
      logits, labels, nn::CrossEntropyOptions().label_smoothing(0.1).reduction(nn::Reduction::None));
  CHECK(kiln::sum(smooth_rows).item() == Approx(smooth));
  CHECK(nn::nll_loss(log_softmax(logits, 1), labels).item() == Approx(ce));
  auto per = nn::nll_loss(log_softmax(logits, 1), labels, nn::Reduction::None).to_vector<double>();
  CHECK(per[1] == Approx(lse(1) - lg[5]));

  Tensor p = from_vector<double>({1, 2, 3, 4}, {4}), t = from_vector<double>({0, 2, 5, 3}, {4});
  CHECK(nn::mse_loss(p, t).item() == Approx((1 + 0 + 4 + 1) / 4.0));
  CHECK(nn::l1_loss(p, t).item() == Approx((1 + 0 + 2 + 1) / 4.0));
  CHECK(nn::l1_loss(p, t, nn::Reduction::Sum).item() == Approx(4.0));
  CHECK_THROWS_AS(nn::mse_loss(p, zeros({3}, DType::Float64)), Error);

  // bce_with_logits stays finite for large logits, where log(sigmoid) would overflow.
  Tensor z = from_vector<double>({-200.0, -1.0, 0.5, 300.0}, {4}), y = from_vector<double>({1, 0, 1, 0}, {4});
  auto zs = z.to_vector<double>(), ys = y.to_vector<double>();
  double bce = 0;
  for (int i = 0; i < 4; ++i) bce += std::max(zs[i], 0.0) - zs[i] * ys[i] + std::log1p(std::exp(-std::abs(zs[i])));
  CHECK(nn::bce_with_logits(z, y).item() == Approx(bce / 4));
  CHECK(std::isfinite(nn::bce_with_logits(z, y).item()));
}

TEST_CASE("a small Sequential MLP trained with plain SGD lowers its loss", "[nn]") {
  manual_seed(42);
  // Two Gaussian blobs: class 0 around (-1, -1), class 1 around (1, 1).
  Tensor noise = randn({64, 2}) * 0.5;
  std::vector<int64_t> ys(64);
  std::vector<float> centers(128);
  for (int i = 0; i < 64; ++i) {
    ys[i] = i % 2;
    centers[2 * i] = centers[2 * i + 1] = ys[i] ? 1.0f : -1.0f;
  }
  Tensor x = (from_vector<float>(centers, {64, 2}) + noise).realize();
  Tensor y = from_vector<int64_t>(ys, {64});
  nn::Sequential mlp(nn::Linear(2, 16), nn::ReLU(), nn::Linear(16, 2));
  auto params = mlp.parameters();
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    Tensor loss = nn::cross_entropy(mlp.forward(x), y);
    auto grads = grad(loss, params);
    {
      NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) params[i].assign(params[i] - 0.5 * grads[i]);
    }
    std::vector<Tensor> outputs = params;
    outputs.push_back(loss);
    sync(outputs);
    (step == 0 ? first : last) = loss.item();
  }
  CHECK(last < 0.5 * first);
  CHECK(last < 0.2);
}
