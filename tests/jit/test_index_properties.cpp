// Properties of the index simplifier, checked against plain arithmetic instead of expected
// renderings: every div/mod it folds must keep the value for every loop-variable value, and any
// chain of views must read the element a slow element-by-element reference reads. An off-by-one
// in one of its rules (a remainder bound `<= d` for `< d`) passes the hand-written cases and
// fails here.
#include <catch2/catch.hpp>

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>

#include <kiln/kiln.h>

#include "backends/cuda/cuda_runtime.h"
#include "jit/index_expr.h"

using namespace kiln;
using namespace kiln::jit;

namespace {

// An expression built twice: simplified by IndexContext, and as a plain function of the loop
// variables' values.
struct Both {
  IndexExpr expr;
  std::function<int64_t(const std::vector<int64_t>&)> value;
};

// Random expressions over loop variables v0.. of the given extents.
class ExpressionMaker {
 public:
  ExpressionMaker(IndexContext& ctx, std::vector<int64_t> extents, std::mt19937& rng)
      : ctx_(ctx), extents_(std::move(extents)), rng_(rng) {}

  Both make(int depth) {
    const int choice = depth <= 0 ? static_cast<int>(rng_() % 2) : static_cast<int>(rng_() % 7);
    switch (choice) {
      case 0: {
        const size_t v = rng_() % extents_.size();
        return {ctx_.var("v" + std::to_string(v), extents_[v]), [v](const std::vector<int64_t>& x) { return x[v]; }};
      }
      case 1: {
        const int64_t c = static_cast<int64_t>(rng_() % 9) - 2;
        return {ctx_.constant(c), [c](const std::vector<int64_t>&) { return c; }};
      }
      case 2: case 3: {  // the sum of two, as linear_index builds them
        Both a = make(depth - 1), b = make(depth - 1);
        return {ctx_.add(a.expr, b.expr), [a, b](const std::vector<int64_t>& x) { return a.value(x) + b.value(x); }};
      }
      case 4: {  // a stride
        static const int64_t kScales[] = {-2, -1, 2, 3, 4, 6, 12};
        const int64_t c = kScales[rng_() % std::size(kScales)];
        Both a = make(depth - 1);
        return {ctx_.scale(a.expr, c), [a, c](const std::vector<int64_t>& x) { return c * a.value(x); }};
      }
      default: {  // quotient or remainder of a non-negative value, as unflatten makes them
        Both a = non_negative(make(depth - 1));
        const int64_t d = kDivisors[rng_() % std::size(kDivisors)];
        if (choice == 5)
          return {ctx_.div(a.expr, d), [a, d](const std::vector<int64_t>& x) { return a.value(x) / d; }};
        return {ctx_.mod(a.expr, d), [a, d](const std::vector<int64_t>& x) { return a.value(x) % d; }};
      }
    }
  }

  // Every assignment of values to the loop variables.
  std::vector<std::vector<int64_t>> points() const {
    std::vector<std::vector<int64_t>> all{{}};
    for (int64_t extent : extents_) {
      std::vector<std::vector<int64_t>> next;
      for (const auto& p : all)
        for (int64_t v = 0; v < extent; ++v) {
          next.push_back(p);
          next.back().push_back(v);
        }
      all = std::move(next);
    }
    return all;
  }

  std::vector<std::pair<std::string, int64_t>> named(const std::vector<int64_t>& p) const {
    std::vector<std::pair<std::string, int64_t>> out;
    for (size_t v = 0; v < p.size(); ++v) out.push_back({"v" + std::to_string(v), p[v]});
    return out;
  }

 private:
  static constexpr int64_t kDivisors[] = {1, 2, 3, 4, 5, 6, 8, 12, 24};

  // `a` shifted by its smallest value over the loops: kernels divide only non-negative indices.
  Both non_negative(Both a) {
    int64_t lowest = 0;
    for (const auto& p : points()) lowest = std::min(lowest, a.value(p));
    if (lowest == 0) return a;
    return {ctx_.add(a.expr, ctx_.constant(-lowest)),
            [a, lowest](const std::vector<int64_t>& x) { return a.value(x) - lowest; }};
  }

  IndexContext& ctx_;
  std::vector<int64_t> extents_;
  std::mt19937& rng_;
};

}  // namespace

TEST_CASE("div and mod simplification keeps the value of random expressions", "[jit][index][property]") {
  std::mt19937 rng(2024);
  int checked = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<int64_t> extents;
    for (size_t v = 0, n = 1 + rng() % 3; v < n; ++v) extents.push_back(1 + static_cast<int64_t>(rng() % 7));
    IndexContext ctx;
    ExpressionMaker maker(ctx, extents, rng);
    Both e = maker.make(1 + static_cast<int>(rng() % 4));
    const int64_t lo = ctx.min(e.expr), hi = ctx.max(e.expr);
    for (const auto& p : maker.points()) {
      const int64_t want = e.value(p), got = ctx.evaluate(e.expr, maker.named(p));
      if (got == want && lo <= want && want <= hi) continue;
      INFO("trial " << trial << ": " << ctx.render(e.expr) << " at v = " << fmt::format("{}", fmt::join(p, ", "))
                    << " is " << got << ", plain arithmetic gives " << want << "; bounds [" << lo << ", " << hi << "]");
      REQUIRE(got == want);
      REQUIRE(lo <= want);
      REQUIRE(want <= hi);
    }
    ++checked;
  }
  CHECK(checked == 3000);
}

TEST_CASE("div and mod of c1*x + c2*y + k keep their value at the edges of every rule", "[jit][index][property]") {
  // A sweep rather than random draws: each rule of div and mod tests a bound of a remainder
  // (0 <= r < d, or < a factor of d), and an off-by-one there fails only where the remainder
  // reaches that bound exactly, e.g. (2*x + y)/4 with y < 3 is not x/2 at x = 1, y = 2.
  int64_t checked = 0;
  for (int64_t c1 = 1; c1 <= 6; ++c1)
    for (int64_t c2 : {1, 2, 3})
      for (int64_t ex = 1; ex <= 6; ++ex)
        for (int64_t ey = 1; ey <= 7; ++ey)
          for (int64_t k = 0; k <= 3; ++k)
            for (int64_t d = 2; d <= 9; ++d) {
              IndexContext ctx;
              IndexExpr a = ctx.add(ctx.add(ctx.scale(ctx.var("x", ex), c1), ctx.scale(ctx.var("y", ey), c2)),
                                    ctx.constant(k));
              IndexExpr q = ctx.div(a, d), r = ctx.mod(a, d);
              for (int64_t x = 0; x < ex; ++x)
                for (int64_t y = 0; y < ey; ++y) {
                  const int64_t value = c1 * x + c2 * y + k;
                  const std::vector<std::pair<std::string, int64_t>> at = {{"x", x}, {"y", y}};
                  if (ctx.evaluate(q, at) == value / d && ctx.evaluate(r, at) == value % d) continue;
                  INFO("(" << c1 << "*x + " << c2 << "*y + " << k << ") with x < " << ex << ", y < " << ey << ", d = " << d
                           << " at x = " << x << ", y = " << y << ": /d is " << ctx.render(q) << ", %d is "
                           << ctx.render(r));
                  REQUIRE(ctx.evaluate(q, at) == value / d);
                  REQUIRE(ctx.evaluate(r, at) == value % d);
                }
              ++checked;
            }
  CHECK(checked == 6 * 3 * 6 * 7 * 4 * 8);
}

namespace {

// A tensor as plain values in row-major order, and the views applied to it element by element.
struct Reference {
  std::vector<double> values;
  Shape shape;

  std::vector<int64_t> unravel(int64_t flat, const Shape& s) const {
    std::vector<int64_t> idx(s.size());
    for (size_t d = s.size(); d-- > 0;) {
      idx[d] = flat % s[d];
      flat /= s[d];
    }
    return idx;
  }
  int64_t ravel(const std::vector<int64_t>& idx) const {
    int64_t flat = 0;
    for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + idx[d];
    return flat;
  }
  // out[i] = values[source(i)], or 0 where source says -1.
  Reference map(Shape out, const std::function<int64_t(const std::vector<int64_t>&)>& source) const {
    Reference r{std::vector<double>(static_cast<size_t>(numel(out))), out};
    for (int64_t i = 0; i < numel(out); ++i) {
      const int64_t from = source(unravel(i, out));
      r.values[i] = from < 0 ? 0.0 : values[from];
    }
    return r;
  }
};

// One random view applied to the tensor and to its reference.
struct ViewChain {
  std::mt19937& rng;
  std::string steps;

  int64_t pick(int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1)); }

  void apply(Tensor& t, Reference& r) {
    const size_t rank = r.shape.size();
    switch (rng() % 6) {
      case 0: {  // permute
        std::vector<int64_t> perm(rank);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        Shape out(rank);
        for (size_t d = 0; d < rank; ++d) out[d] = r.shape[perm[d]];
        t = permute(t, perm);
        r = r.map(out, [&](const std::vector<int64_t>& i) {
          std::vector<int64_t> in(rank);
          for (size_t d = 0; d < rank; ++d) in[perm[d]] = i[d];
          return r.ravel(in);
        });
        steps += fmt::format(" permute({})", fmt::join(perm, ","));
        break;
      }
      case 1: case 2: {  // reshape to another factorization: the views that make div/mod atoms
        int64_t rest = numel(r.shape);
        Shape out;
        while (rest > 1 && out.size() < 3) {
          std::vector<int64_t> divisors;
          for (int64_t k = 2; k <= rest; ++k)
            if (rest % k == 0) divisors.push_back(k);
          const int64_t k = divisors[rng() % divisors.size()];
          out.push_back(k);
          rest /= k;
        }
        if (rest > 1 || out.empty()) out.push_back(rest);
        std::shuffle(out.begin(), out.end(), rng);
        t = reshape(t, out);
        r.shape = out;
        steps += fmt::format(" reshape({})", fmt::join(out, ","));
        break;
      }
      case 3: {  // slice with a step
        const size_t axis = rng() % rank;
        const int64_t extent = r.shape[axis];
        const int64_t start = pick(0, extent - 1), stop = pick(start + 1, extent), step = pick(1, 3);
        Shape out = r.shape;
        out[axis] = (stop - start + step - 1) / step;
        t = slice(t, static_cast<int64_t>(axis), start, stop, step);
        r = r.map(out, [&](std::vector<int64_t> i) {
          i[axis] = start + step * i[axis];
          return r.ravel(i);
        });
        steps += fmt::format(" slice(axis {}, {}:{}:{})", axis, start, stop, step);
        break;
      }
      case 4: {  // a new axis of 1, expanded
        const size_t axis = rng() % (rank + 1);
        const int64_t copies = pick(2, 3);
        Shape with_one = r.shape, out = r.shape;
        with_one.insert(with_one.begin() + static_cast<std::ptrdiff_t>(axis), 1);
        out.insert(out.begin() + static_cast<std::ptrdiff_t>(axis), copies);
        t = expand(reshape(t, with_one), out);
        r = r.map(out, [&](std::vector<int64_t> i) {
          i.erase(i.begin() + static_cast<std::ptrdiff_t>(axis));
          return r.ravel(i);
        });
        steps += fmt::format(" expand(new axis {} x{})", axis, copies);
        break;
      }
      default: {  // zero padding on one axis
        const size_t axis = rng() % rank;
        const int64_t before = pick(0, 2), after = pick(0, 2);
        std::vector<std::pair<int64_t, int64_t>> pads(rank, {0, 0});
        pads[axis] = {before, after};
        Shape out = r.shape;
        out[axis] += before + after;
        t = pad(t, pads);
        const int64_t extent = r.shape[axis];
        r = r.map(out, [&](std::vector<int64_t> i) {
          i[axis] -= before;
          return i[axis] < 0 || i[axis] >= extent ? -1 : r.ravel(i);
        });
        steps += fmt::format(" pad(axis {}, {}, {})", axis, before, after);
        break;
      }
    }
  }
};

// Random view chains on `device`, all realized in one plan (one compile), each compared with its
// reference element by element, and summed over its last axis (a reduction reading the views).
void check_random_view_chains(Device device) {
  std::mt19937 rng(11);
  const std::vector<Shape> starts = {{3, 4}, {4, 6}, {2, 3, 4}, {6, 5}, {2, 2, 6}};
  std::vector<Tensor> results;
  std::vector<Reference> want;
  std::vector<std::string> what;
  for (int chain = 0; chain < 40; ++chain) {
    const Shape& start = starts[rng() % starts.size()];
    Reference r{std::vector<double>(static_cast<size_t>(numel(start))), start};
    std::iota(r.values.begin(), r.values.end(), 1.0);  // distinct and never the padding's 0
    Tensor t = from_doubles(r.values, start, DType::Float64).to(device);
    // Half of the chains read a stored buffer, half a computed value the views fuse into.
    if (chain % 2 == 1) t = t * 1.0;
    ViewChain views{rng, fmt::format("{}", fmt::join(start, "x"))};
    for (int64_t n = 2 + static_cast<int64_t>(rng() % 4); n > 0 && numel(r.shape) < 400; --n) views.apply(t, r);
    results.push_back(t);
    want.push_back(r);
    what.push_back(views.steps);
    // The sum over the last axis.
    const int64_t last = r.shape.back();
    Reference summed{std::vector<double>(static_cast<size_t>(numel(r.shape) / last)), r.shape};
    summed.shape.pop_back();
    for (size_t i = 0; i < r.values.size(); ++i) summed.values[i / static_cast<size_t>(last)] += r.values[i];
    results.push_back(sum(t, {static_cast<int64_t>(r.shape.size()) - 1}));
    want.push_back(summed);
    what.push_back(views.steps + " then sum over the last axis");
  }
  sync(results);
  for (size_t i = 0; i < results.size(); ++i) {
    INFO(what[i]);
    REQUIRE(results[i].shape() == want[i].shape);
    CHECK(results[i].to_doubles() == want[i].values);
  }
}

}  // namespace

TEST_CASE("transpose, reshape and a stepped slice read the right elements", "[jit][index][view]") {
  // (3, 4) transposed, viewed as (2, 6), every other column.
  Tensor x = from_doubles({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {3, 4}, DType::Float64);
  Tensor v = slice(reshape(transpose(x, 0, 1), {2, 6}), 1, 0, 6, 2);
  // transpose: 0 4 8 1 5 9 2 6 10 3 7 11 -> rows (0 4 8 1 5 9), (2 6 10 3 7 11) -> columns 0, 2, 4.
  CHECK(v.to_doubles() == std::vector<double>{0, 8, 5, 2, 10, 7});
}

// A pad narrows the loop variable it reads to the part its guard lets through; a second pad on the
// same axis must narrow that copy, shift included (found by tests/jit/test_one_result.cpp: the
// inner pad read 6 columns off).
TEST_CASE("pads of pads and of slices of pads read the right elements", "[jit][index][view]") {
  std::vector<double> values(4 * 10);
  std::iota(values.begin(), values.end(), 1.0);
  const Tensor stored = from_doubles(values, {4, 10}, DType::Float64).realize();
  for (bool computed : {false, true}) {
    INFO((computed ? "a computed value" : "a stored buffer") << " under the views");
    const Tensor x = computed ? stored * 1.0 : stored;
    Tensor twice = pad(pad(x, {{0, 0}, {2, 1}}), {{0, 0}, {3, 0}});  // (4, 16)
    Tensor nested = pad(slice(pad(slice(pad(x, {{0, 0}, {3, 1}}), 1, 2, 14), {{1, 0}, {3, 1}}), 1, 2, 16), {{0, 0}, {4, 2}});
    sync({twice, nested});
    auto row_of = [&](const Tensor& t, int64_t r) {
      const std::vector<double> v = t.to_doubles();
      const int64_t w = t.shape()[1];
      return std::vector<double>(v.begin() + r * w, v.begin() + (r + 1) * w);
    };
    CHECK(row_of(twice, 1) == std::vector<double>{0, 0, 0, 0, 0, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 0});
    // pad(3, 1): 0 0 0 x0..x9 0; slice 2:14: 0 x0..x9 0; pad(3, 1): 0 0 0 0 x0..x9 0 0;
    // slice 2:16: 0 0 x0..x9 0 0; pad(4, 2): 0 0 0 0 0 0 x0..x9 0 0 0 0. Row 0 is the padded row.
    CHECK(row_of(nested, 0) == std::vector<double>(20, 0.0));
    CHECK(row_of(nested, 2) == std::vector<double>{0, 0, 0, 0, 0, 0, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 0, 0, 0, 0});
    CHECK(nested.shape() == Shape{5, 20});
  }
}

TEST_CASE("random view chains read what an element-by-element reference reads", "[jit][index][view][property]") {
  check_random_view_chains(Device::cpu());
}

TEST_CASE("random view chains on a CUDA device read what the reference reads", "[jit][index][view][device]") {
  if (!cuda::available()) {
    WARN("SKIPPED: no CUDA device (" << cuda::unavailable_reason() << "); KILN_CUDA_EMULATOR=1 runs this on the host");
    return;
  }
  check_random_view_chains(Device::cuda(0));
}
