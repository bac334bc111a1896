// The symbolic index simplifier: reshapes of contiguous data must fold back to affine form, and
// every simplification must keep the value of the expression.
#include <catch2/catch.hpp>

#include <random>

#include "core/shape.h"
#include "jit/index_expr.h"
#include "ops/ops.h"

using namespace kiln;
using namespace kiln::jit;


TEST_CASE("merging and splitting contiguous dims stays affine", "[jit][index]") {
  IndexContext ctx;
  // (B, T, C) = (4, 5, 6) viewed as (20, 6): row = b*5 + t, col = c.
  IndexExpr b = ctx.var("b", 4), t = ctx.var("t", 5), c = ctx.var("c", 6);
  IndexExpr lin = ctx.add(ctx.add(ctx.scale(b, 30), ctx.scale(t, 6)), c);
  auto idx = unflatten(ctx, lin, {20, 6});
  CHECK(ctx.is_affine(idx[0]));
  CHECK(ctx.is_affine(idx[1]));
  CHECK(ctx.render(idx[0]) == "5*b + t");
  CHECK(ctx.render(idx[1]) == "c");
  // And back: (20, 6) viewed as (4, 5, 6).
  IndexContext ctx2;
  IndexExpr r = ctx2.var("r", 20), k = ctx2.var("k", 6);
  auto back = unflatten(ctx2, ctx2.add(ctx2.scale(r, 6), k), {4, 5, 6});
  CHECK(ctx2.render(back[2]) == "k");
  CHECK_FALSE(ctx2.is_affine(back[0]));  // r / 5 cannot be affine
}

TEST_CASE("an unravelled flat index linearized again folds back to the flat index", "[jit][index]") {
  // The pooling/randn pattern: a flat loop variable o split by a 4-d shape and linearized
  // again: 25088*(o/25088) + 784*((o/784)%32) + 28*((o/28)%28) + o%28 must be o.
  IndexContext ctx;
  const Shape shape{128, 32, 28, 28};
  IndexExpr o = ctx.var("o", numel(shape));
  auto idx = unflatten(ctx, o, shape);
  auto strides = contiguous_strides(shape);
  IndexExpr lin = ctx.constant(0);
  for (size_t d = 0; d < shape.size(); ++d) lin = ctx.add(lin, ctx.scale(idx[d], strides[d]));
  CHECK(ctx.render(lin) == "o");
  // With an outer x inner split as the executor's fallback loops make: 28*o2 + i.
  IndexContext ctx2;
  IndexExpr o2 = ctx2.var("o", numel(shape) / 28), i = ctx2.var("i", 28);
  IndexExpr flat = ctx2.add(ctx2.scale(o2, 28), i);
  auto idx2 = unflatten(ctx2, flat, shape);
  IndexExpr lin2 = ctx2.constant(0);
  for (size_t d = 0; d < shape.size(); ++d) lin2 = ctx2.add(lin2, ctx2.scale(idx2[d], strides[d]));
  CHECK(ctx2.is_affine(lin2));
  CHECK(ctx2.render(lin2) == "28*o + i");
  // A split of the inner axis, as a 2x2 window's gradient sees it: 2*((28*o + i)/2 % 14) + i%2.
  IndexExpr split = ctx2.add(ctx2.scale(ctx2.mod(ctx2.div(flat, 2), 14), 2), ctx2.mod(flat, 2));
  CHECK(ctx2.render(split) == "i");
}

TEST_CASE("random reshape chains keep their values", "[jit][index]") {
  std::mt19937 rng(7);
  const std::vector<Shape> shapes = {{24}, {2, 12}, {4, 6}, {2, 3, 4}, {3, 8}, {6, 2, 2}, {1, 24, 1}, {2, 2, 2, 3}};
  for (int trial = 0; trial < 40; ++trial) {
    const Shape& from = shapes[rng() % shapes.size()];
    const Shape& via = shapes[rng() % shapes.size()];
    const Shape& to = shapes[rng() % shapes.size()];
    IndexContext ctx;
    std::vector<IndexExpr> vars;
    std::vector<std::string> names;
    for (size_t d = 0; d < to.size(); ++d) {
      names.push_back("v" + std::to_string(d));
      vars.push_back(ctx.var(names.back(), to[d]));
    }
    // to -> via -> from, as nested reshapes are folded.
    auto lin_of = [&](const std::vector<IndexExpr>& idx, const Shape& s) {
      auto st = contiguous_strides(s);
      IndexExpr lin = ctx.constant(0);
      for (size_t d = 0; d < s.size(); ++d) lin = ctx.add(lin, ctx.scale(idx[d], st[d]));
      return lin;
    };
    auto mid = unflatten(ctx, lin_of(vars, to), via);
    auto src = unflatten(ctx, lin_of(mid, via), from);
    IndexExpr offset = lin_of(src, from);
    for (int64_t flat = 0; flat < 24; ++flat) {
      std::vector<std::pair<std::string, int64_t>> values;
      int64_t rest = flat;
      auto st = contiguous_strides(to);
      for (size_t d = 0; d < to.size(); ++d) {
        values.push_back({names[d], rest / st[d]});
        rest %= st[d];
      }
      INFO("trial " << trial << " offset " << ctx.render(offset));
      REQUIRE(ctx.evaluate(offset, values) == flat);  // a reshape chain never moves data
    }
  }
}

TEST_CASE("slices with steps and pads shift and scale indices", "[jit][index]") {
  IndexContext ctx;
  IndexExpr i = ctx.var("i", 5);
  IndexExpr sliced = ctx.add(ctx.scale(i, 3), ctx.constant(2));  // x[2::3]
  CHECK(ctx.render(sliced) == "3*i + 2");
  CHECK(ctx.min(sliced) == 2);
  CHECK(ctx.max(sliced) == 14);
  IndexExpr padded = ctx.add(i, ctx.constant(-1));
  CHECK(ctx.min(padded) == -1);
  CHECK(ctx.render(ctx.div(ctx.scale(i, 4), 2)) == "2*i");
  CHECK(ctx.render(ctx.mod(ctx.add(ctx.scale(i, 4), ctx.constant(1)), 2)) == "1");
}

TEST_CASE("views map output indices to the element they read", "[jit][index]") {
  // Each view of a [3, 4] input, checked element by element against the index it must read.
  Tensor x = zeros({3, 4});
  auto check = [](const Tensor& view, auto expected) {
    const Node& node = *view.node();
    IndexContext ctx;
    std::vector<IndexExpr> idx;
    for (size_t d = 0; d < node.shape.size(); ++d) idx.push_back(ctx.var("v" + std::to_string(d), node.shape[d]));
    std::vector<Guard> guards;
    std::vector<IndexExpr> in = view_source_index(ctx, node, idx, &guards);
    const Shape& s = node.shape;
    for (int64_t a = 0; a < s[0]; ++a)
      for (int64_t b = 0; b < (s.size() > 1 ? s[1] : 1); ++b) {
        std::vector<std::pair<std::string, int64_t>> at = {{"v0", a}};
        if (s.size() > 1) at.push_back({"v1", b});
        std::vector<int64_t> got;
        for (const IndexExpr& e : in) got.push_back(ctx.evaluate(e, at));
        CHECK(got == expected(a, b));
      }
    return guards.size();
  };
  CHECK(check(permute(x, {1, 0}), [](int64_t a, int64_t b) { return std::vector<int64_t>{b, a}; }) == 0);
  CHECK(check(slice(x, 1, 1, 4, 2), [](int64_t a, int64_t b) { return std::vector<int64_t>{a, 1 + 2 * b}; }) == 0);
  CHECK(check(reshape(x, {2, 6}), [](int64_t a, int64_t b) { return std::vector<int64_t>{(6 * a + b) / 4, (6 * a + b) % 4}; }) == 0);
  CHECK(check(expand(zeros({3, 1}), {3, 5}), [](int64_t a, int64_t) { return std::vector<int64_t>{a, 0}; }) == 0);
  CHECK(check(pad(x, {{1, 0}, {0, 2}}), [](int64_t a, int64_t b) { return std::vector<int64_t>{a - 1, b}; }) == 2);  // both padded dims guarded
  // A pad has no strided form: asking for one without guards is an error, not a silent misread.
  Tensor p = pad(x, {{1, 0}, {0, 2}});
  IndexContext ctx;
  CHECK_THROWS_AS(view_source_index(ctx, *p.node(), {ctx.var("a", 4), ctx.var("b", 6)}), Error);
}

TEST_CASE("a pad's input sees only the guarded part of a loop variable", "[jit][index]") {
  // Element (o, i) of a (16, 24) concatenation of three (16, 8) pieces along axis 1: the last
  // piece is read at i - 16 where the guard lets it through, so a reshape of that piece (as
  // (16 * 8) rows) folds to a plain row index instead of div/mod over the whole loop.
  Tensor piece = zeros({16, 8});
  Tensor padded = pad(piece, {{0, 0}, {16, 0}});
  IndexContext ctx;
  std::vector<IndexExpr> idx = {ctx.var("o", 16), ctx.var("i", 24)};
  std::vector<Guard> guards;
  std::vector<IndexExpr> in = view_source_index(ctx, *padded.node(), idx, &guards);
  REQUIRE(guards.size() == 1);
  CHECK(ctx.render(guards[0].expr) == "i - 16");  // the guard itself reads the whole loop
  const IndexExpr flat = linear_index(ctx, in, {16, 8});
  const std::vector<IndexExpr> rows = unflatten(ctx, flat, {32, 4});  // a reshape of the piece
  const IndexExpr back = linear_index(ctx, rows, {32, 4});
  CHECK(ctx.is_affine(back));
  CHECK(ctx.render(back) == "8*o + (i - 16)");
  CHECK(ctx.coefficient(back, "i") == 1);
  CHECK(ctx.offset(back) == -16);
  // Where the guard holds the value is exact; over the whole loop the bounds stay honest.
  for (int64_t o = 0; o < 16; ++o)
    for (int64_t i = 16; i < 24; ++i) CHECK(ctx.evaluate(back, {{"o", o}, {"i", i}}) == 8 * o + i - 16);
  CHECK(ctx.whole_min(back) == -16);
  CHECK(ctx.whole_max(back) == 8 * 15 + 7);
  CHECK(ctx.min(back) == 0);
}
