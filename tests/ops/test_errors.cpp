// What users see when they get it wrong: shape, axis and dtype errors that name the op and the
// shapes, out-of-range indices that throw at run time and leave every tensor usable, 0-d edge
// cases, and (hidden, known to crash) tensors with a zero-size dim.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "ops/ops.h"
#include "tests/support/compare.h"

using kiln::DType;
using kiln::Tensor;
using kiln::testing::check_close;
using kiln::testing::f32;
using kiln::testing::i64;
using Catch::Contains;

TEST_CASE("shape mismatches name the op and the shapes", "[forward][error]") {
  Tensor a = kiln::zeros({2, 3}), b = kiln::zeros({4}), c = kiln::zeros({4, 5});
  REQUIRE_THROWS_WITH(kiln::add(a, b), Contains("add") && Contains("[2, 3]") && Contains("[4]"));
  REQUIRE_THROWS_WITH(a + b, Contains("add") && Contains("[2, 3]") && Contains("[4]"));
  REQUIRE_THROWS_WITH(kiln::mul(a, c), Contains("mul") && Contains("[2, 3]") && Contains("[4, 5]"));
  REQUIRE_THROWS_WITH(kiln::where(kiln::zeros({3}, DType::Bool), a, c), Contains("where"));
  REQUIRE_THROWS_WITH(kiln::matmul(a, c), Contains("matmul") && Contains("[2, 3]") && Contains("[4, 5]"));
  REQUIRE_THROWS_WITH(kiln::matmul(kiln::zeros({2, 2, 3}), kiln::zeros({3, 3, 4})),
                      Contains("matmul") && Contains("[2]") && Contains("[3]"));
  REQUIRE_THROWS_WITH(kiln::matmul(kiln::scalar(1.0), c), Contains("matmul"));
  REQUIRE_THROWS_WITH(kiln::reshape(a, {4, 2}), Contains("reshape") && Contains("[2, 3]") && Contains("[4, 2]"));
  REQUIRE_THROWS_WITH(kiln::reshape(a, {-1, -1}), Contains("reshape"));
  REQUIRE_THROWS_WITH(kiln::reshape(a, {-1, 4}), Contains("reshape"));
  REQUIRE_THROWS_WITH(kiln::expand(c, {4, 6}), Contains("expand") && Contains("[4, 5]") && Contains("[4, 6]"));
  REQUIRE_THROWS_WITH(kiln::broadcast_to(a, {3, 3}), Contains("broadcast_to"));
  REQUIRE_THROWS_WITH(kiln::concat({a, c}, 0), Contains("concat") && Contains("[2, 3]") && Contains("[4, 5]"));
  REQUIRE_THROWS_WITH(kiln::concat({a, b}, 0), Contains("concat"));
  REQUIRE_THROWS_WITH(kiln::layer_norm(a, {4}), Contains("layer_norm"));
  REQUIRE_THROWS_WITH(kiln::cross_entropy(a, i64({0, 1, 2}, {3})), Contains("cross_entropy"));
  REQUIRE_THROWS_WITH(kiln::from_vector<float>({1, 2, 3}, {2, 2}), Contains("from_vector"));
  REQUIRE_THROWS_WITH(kiln::permute(a, {0, 0}), Contains("permute"));
  REQUIRE_THROWS_WITH(kiln::pad(a, {{-3, 0}}), Contains("pad") && Contains("[2, 3]"));  // crops more than the axis has
  REQUIRE_THROWS_WITH(kiln::gather(a, 0, i64({0, 1}, {2})), Contains("gather"));
  REQUIRE_THROWS_WITH(kiln::gather(a, 0, f32({0, 1, 0, 1, 0, 1}, {2, 3})), Contains("gather"));
  REQUIRE_THROWS_WITH(kiln::zeros({2, 3}).item(), Contains("item"));
  // The error type is kiln::Error (a std::runtime_error).
  CHECK_THROWS_AS(kiln::add(a, b), kiln::Error);
  CHECK_THROWS_AS(kiln::add(a, b), std::runtime_error);
}

TEST_CASE("bad axes name the op and the axis", "[forward][error]") {
  Tensor a = kiln::zeros({2, 3});
  REQUIRE_THROWS_WITH(kiln::sum(a, {2}), Contains("sum") && Contains("axis 2"));
  REQUIRE_THROWS_WITH(kiln::sum(a, {-3}), Contains("sum") && Contains("axis -3"));
  REQUIRE_THROWS_WITH(kiln::sum(a, {1, -1}), Contains("sum") && Contains("repeated"));
  REQUIRE_THROWS_WITH(kiln::max(a, {5}), Contains("max") && Contains("axis 5"));
  REQUIRE_THROWS_WITH(kiln::mean(a, {2}), Contains("mean") && Contains("axis 2"));
  REQUIRE_THROWS_WITH(kiln::var(a, {2}), Contains("var") && Contains("axis 2"));
  REQUIRE_THROWS_WITH(kiln::argmax(a, 2), Contains("argmax") && Contains("axis 2"));
  REQUIRE_THROWS_WITH(kiln::transpose(a, 0, 2), Contains("transpose") && Contains("axis 2"));
  REQUIRE_THROWS_WITH(kiln::slice(a, 3, 0, 1), Contains("slice") && Contains("axis 3"));
  REQUIRE_THROWS_WITH(kiln::slice(a, 0, 0, 2, 0), Contains("slice") && Contains("step"));
  REQUIRE_THROWS_WITH(kiln::unsqueeze(a, 4), Contains("unsqueeze") && Contains("axis 4"));
  REQUIRE_THROWS_WITH(kiln::squeeze(a, -3), Contains("squeeze") && Contains("axis -3"));
  REQUIRE_THROWS_WITH(kiln::flatten(a, 1, 0), Contains("flatten"));
  REQUIRE_THROWS_WITH(kiln::concat({a, a}, 2), Contains("concat") && Contains("axis 2"));
  REQUIRE_THROWS_WITH(kiln::gather(a, 2, i64({0, 0, 0, 0, 0, 0}, {2, 3})), Contains("gather") && Contains("axis 2"));
  REQUIRE_THROWS_WITH(kiln::index_select(a, -3, i64({0}, {1})), Contains("index_select") && Contains("axis -3"));
  REQUIRE_THROWS_WITH(kiln::iota({2, 3}, 2), Contains("iota") && Contains("axis 2"));
  REQUIRE_THROWS_WITH(kiln::softmax(a, 2), Contains("softmax") && Contains("axis 2"));
  REQUIRE_THROWS_WITH(kiln::log_softmax(a, -3), Contains("log_softmax") && Contains("axis -3"));
  REQUIRE_THROWS_WITH(kiln::logsumexp(a, {2}), Contains("logsumexp") && Contains("axis 2"));
  REQUIRE_THROWS_WITH(a.size(2), Contains("axis 2"));
}

TEST_CASE("dtype errors", "[forward][error][dtype]") {
  Tensor i = i64({1, 2}, {2});
  REQUIRE_THROWS_WITH(i.requires_grad_(), Contains("requires_grad_") && Contains("int64"));
  REQUIRE_THROWS_WITH(kiln::cross_entropy(kiln::zeros({2, 3}), f32({0, 1})), Contains("cross_entropy"));
  REQUIRE_THROWS_WITH(kiln::randn({2}, DType::Int64), Contains("RandNormal") && Contains("int64"));
  CHECK_THROWS_AS(kiln::dtype_from_name("float128"), kiln::Error);
  CHECK(kiln::dtype_from_name("bf16") == DType::BFloat16);
}

TEST_CASE("out-of-range indices throw and leave tensors usable", "[forward][index][error]") {
  Tensor base = f32({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor a = base * 2.0;  // still lazy: the failed run must not lose it
  Tensor bad = kiln::gather(a, 1, i64({0, 3, 1, 2}, {2, 2}));
  REQUIRE_THROWS_AS(bad.to_vector<float>(), kiln::Error);
  REQUIRE_THROWS_WITH(kiln::gather(a, 1, i64({0, 7}, {1, 2})).realize(),
                      Contains("gather") && Contains("7") && Contains("out of range"));
  REQUIRE_THROWS_WITH(kiln::gather(a, 0, i64({-1, 0, 0}, {1, 3})).realize(), Contains("-1"));
  REQUIRE_THROWS_AS(kiln::index_select(a, 0, i64({0, 2}, {2})).realize(), kiln::Error);
  REQUIRE_THROWS_AS(kiln::scatter_add({2, 2}, 0, i64({0, 5}, {1, 2}), f32({1, 1}, {1, 2})).realize(), kiln::Error);
  // Everything still works afterwards, including the lazy input of the failed gather.
  check_close(a, {2, 4, 6, 8, 10, 12});
  check_close(kiln::gather(a, 1, i64({2, 0, 1, 1}, {2, 2})), {6, 2, 10, 10});
  check_close(base + 1.0, {2, 3, 4, 5, 6, 7});
  // The failed tensor fails again rather than returning stale data.
  CHECK_THROWS_AS(bad.realize(), kiln::Error);
}

TEST_CASE("0-d tensors: reductions accept axis 0, axis ops refuse it", "[forward][error]") {
  Tensor s = kiln::scalar(3.5);
  check_close(kiln::sum(s, {0}), {3.5});
  check_close(kiln::max(s, {-1}, true), {3.5});
  check_close(kiln::mean(s, {0}), {3.5});
  CHECK(kiln::sum(s, {0}).dim() == 0);
  REQUIRE_THROWS_WITH(kiln::sum(s, {1}), Contains("sum") && Contains("axis 1"));
  // Ops that index the shape by the axis must throw, not read past a 0-d shape.
  REQUIRE_THROWS_WITH(kiln::squeeze(s, 0), Contains("squeeze") && Contains("0-d"));
  REQUIRE_THROWS_WITH(kiln::transpose(s, 0, 0), Contains("transpose") && Contains("0-d"));
  REQUIRE_THROWS_WITH(kiln::slice(s, 0, 0, 1), Contains("slice") && Contains("0-d"));
  REQUIRE_THROWS_WITH(kiln::concat({s, s}, 0), Contains("concat") && Contains("0-d"));
  REQUIRE_THROWS_WITH(kiln::argmax(s, 0), Contains("argmax") && Contains("0-d"));
  REQUIRE_THROWS_WITH(kiln::index_select(s, 0, i64({0}, {1})), Contains("index_select") && Contains("0-d"));
  REQUIRE_THROWS_WITH(kiln::softmax(s), Contains("softmax") && Contains("0-d"));
  REQUIRE_THROWS_WITH(kiln::iota({}, 0), Contains("iota") && Contains("0-d"));
  REQUIRE_THROWS_WITH(s.size(0), Contains("0-d"));
  // Axis-free ops still work on 0-d tensors.
  check_close(kiln::unsqueeze(s, 0), {3.5});
  check_close(kiln::flatten(s), {3.5});
  check_close(kiln::exp(s) * s, {std::exp(3.5) * 3.5});
}

// Zero-size dims anywhere: strides before a 0 extent are 0, and the kernels' loops never run.
TEST_CASE("tensors with a zero-size dim", "[ops][zero-size]") {
  CHECK((kiln::zeros({0}) + 1.0).numel() == 0);
  CHECK((kiln::zeros({2, 0}) + 1.0).to_doubles().empty());
  CHECK(kiln::max(kiln::zeros({2, 0}), {0}).numel() == 0);
  check_close(kiln::sum(kiln::zeros({2, 0})), {0});
  check_close(kiln::matmul(kiln::zeros({2, 0}), kiln::zeros({0, 3})), std::vector<double>(6, 0.0));
}
