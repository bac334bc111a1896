// nn::Conv2d: parameter layout and initialization as in PyTorch, options, forward = kiln::conv2d.
#include <catch2/catch.hpp>
#include <cmath>
#include <kiln/kiln.h>

using namespace kiln;

TEST_CASE("Conv2d has PyTorch's parameters, initialization and options", "[nn][conv]") {
  manual_seed(3);
  nn::Conv2d conv(nn::Conv2dOptions(4, 6, {3, 2}).stride(2).padding({1, 0}).groups(2));
  CHECK(conv.weight.shape() == Shape{6, 2, 3, 2});
  CHECK(conv.bias.shape() == Shape{6});
  auto names = conv.named_parameters();
  REQUIRE(names.size() == 2);
  CHECK(names[0].first == "weight");
  CHECK(names[1].first == "bias");
  // kaiming_uniform(a = sqrt(5)) and the bias both give a bound of 1/sqrt(fan_in), fan_in = 2*3*2.
  double bound = 1.0 / std::sqrt(12.0);
  for (float v : conv.weight.to_vector<float>()) CHECK(std::abs(v) <= bound + 1e-6);
  for (float v : conv.bias.to_vector<float>()) CHECK(std::abs(v) <= bound + 1e-6);
  CHECK(conv.options().stride() == nn::Size2{2, 2});
  CHECK(conv.to_string().find("groups=2") != std::string::npos);

  Tensor x = randn({2, 4, 7, 5});
  Tensor y = conv.forward(x);
  CHECK(y.shape() == Shape{2, 6, 4, 2});
  auto expected = conv2d(x, conv.weight, conv.bias, {2, 2}, {1, 0}, {1, 1}, 2).to_vector<float>();
  CHECK(y.to_vector<float>() == expected);

  nn::Conv2d plain(1, 2, 3);
  CHECK(plain.forward(randn({1, 5, 5})).shape() == Shape{2, 3, 3});
  CHECK_FALSE(nn::Conv2d(nn::Conv2dOptions(1, 2, 3).bias(false)).bias.defined());
  CHECK_THROWS_WITH(conv.forward(randn({2, 3, 7, 5})), Catch::Contains("Conv2d") && Catch::Contains("(N, 4, H, W)"));
  CHECK_THROWS_AS(nn::Conv2d(nn::Conv2dOptions(3, 6, 3).groups(2)), Error);
}

TEST_CASE("a small CNN learns a synthetic task", "[nn][conv][train]") {
  // Label = whether the bright pixel is in the left or right half: needs spatial features.
  manual_seed(5);
  nn::Conv2d conv(1, 4, 3);
  nn::Linear head(4 * 3 * 3, 2);
  std::vector<float> images(32 * 64, 0.0f);
  std::vector<int64_t> labels(32);
  for (int n = 0; n < 32; ++n) {
    int pos = (n * 7) % 64;
    images[n * 64 + pos] = 1.0f;
    labels[n] = pos % 8 >= 4;
  }
  Tensor x = from_vector(images, {32, 1, 8, 8});
  Tensor y = from_vector(labels, {32});
  std::vector<Tensor> params = conv.parameters();
  for (const Tensor& p : head.parameters()) params.push_back(p);
  optim::SGD opt(params, optim::SGDOptions(0.2).momentum(0.9));
  double first = 0, last = 0;
  for (int step = 0; step < 40; ++step) {
    Tensor h = max_pool2d(relu(conv.forward(x)), {2, 2});  // (32, 4, 3, 3)
    Tensor loss = cross_entropy(head.forward(h.reshape({32, 36})), y);
    opt.step(loss);
    (step == 0 ? first : last) = loss.item();
  }
  CHECK(last < 0.5 * first);
}
