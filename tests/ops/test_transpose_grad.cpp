// Transposed operands: x @ W^T's weight gradient (computed as dY^T @ x, in W's layout), and
// permute-of-permute folding, which must never hide a node someone can ask a gradient for.
#include <catch2/catch.hpp>

#include <vector>

#include "core/autograd.h"
#include "ops/ops.h"
#include "tests/support/gradcheck.h"

using namespace kiln;

TEST_CASE("x @ W^T gives exact gradients for W and for the transposed view", "[ops][matmul]") {
  Tensor x = testing::uniform({5, 4}, -1, 1, 1).cast(DType::Float32).realize();
  Tensor r = testing::uniform({5, 3}, -1, 1, 2).cast(DType::Float32).realize();
  Tensor w = testing::uniform({3, 4}, -1, 1, 3).cast(DType::Float32).realize();
  w.requires_grad_(true);
  Tensor wt = w.t();
  auto g = grad((matmul(x, wt) * r).sum(), {w, wt});
  REQUIRE(g[0].shape() == Shape{3, 4});
  REQUIRE(g[1].shape() == Shape{4, 3});
  auto xs = x.to_vector<float>(), rs = r.to_vector<float>();
  auto dw = g[0].to_vector<float>(), dwt = g[1].to_vector<float>();
  for (int o = 0; o < 3; ++o)
    for (int i = 0; i < 4; ++i) {
      double expected = 0;  // dW[o, i] = sum_n r[n, o] x[n, i]
      for (int n = 0; n < 5; ++n) expected += double(rs[n * 3 + o]) * xs[n * 4 + i];
      CHECK(dw[o * 4 + i] == Approx(expected).margin(1e-5));
      CHECK(dwt[i * 3 + o] == Approx(expected).margin(1e-5));
    }
}

TEST_CASE("a permute of a permute folds only where no gradient can be asked for", "[ops][matmul]") {
  Tensor a = testing::uniform({2, 3, 4}, -1, 1, 4);
  {
    NoGradGuard no_grad;
    Tensor back = permute(permute(a, {2, 0, 1}), {1, 2, 0});
    CHECK(back.node() == a.node());  // the two transposes cancel: no node at all
  }
  Tensor leaf = (a * 1.0).realize();
  leaf.requires_grad_(true);
  Tensor mid = permute(leaf, {2, 0, 1});
  Tensor out = permute(mid, {1, 2, 0}) * 2.0;
  auto g = grad(out.sum(), {mid, leaf});
  for (double v : g[0].to_vector<double>()) CHECK(v == 2.0);
  for (double v : g[1].to_vector<double>()) CHECK(v == 2.0);
}
