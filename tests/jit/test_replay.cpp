// Replay of a captured run (jit::realize_captured, jit::replay): the plan run again on new values
// gives what recording the graph again gives, updates in place only where nobody else sees the
// old value, random keys and scalars are bound per replay, and a wrong binding is an Error.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <algorithm>

#include "jit/executor.h"

using namespace kiln;

namespace {

// The position of `node` in the captured run's externals or outputs; -1 when it is not there.
template <typename Range, typename Address>
int position(const Range& range, const Node* node, Address address) {
  for (size_t i = 0; i < range.size(); ++i)
    if (address(range[i]) == node) return static_cast<int>(i);
  return -1;
}
int external_at(const jit::CapturedRun& run, const Tensor& t) {
  return position(run.externals, t.node().get(), [](const jit::CapturedRun::Value& v) { return v.node; });
}
int output_at(const jit::CapturedRun& run, const Tensor& t) {
  return position(run.outputs, t.node().get(), [](const Node* n) { return n; });
}

}  // namespace

TEST_CASE("replay: a captured run on new values gives what recording it again gives", "[jit][replay]") {
  Tensor x = rand({4, 8}).realize(), w = rand({8, 3}).realize();
  Tensor y = relu(matmul(x, w) * 2.5 + 1.0);
  std::string why;
  std::optional<jit::CapturedRun> run = jit::realize_captured({y.node()}, why);
  REQUIRE(run);
  REQUIRE(y.is_realized());
  const std::vector<float> first = y.to_vector<float>();
  const int at_x = external_at(*run, x), at_w = external_at(*run, w), at_y = output_at(*run, y);
  REQUIRE(at_x >= 0);
  REQUIRE(at_w >= 0);
  REQUIRE(at_y >= 0);

  Tensor x2 = rand({4, 8}).realize();
  jit::ReplayBindings bindings;
  bindings.externals.resize(run->externals.size());
  bindings.externals[static_cast<size_t>(at_x)] = x2.node();
  bindings.externals[static_cast<size_t>(at_w)] = w.node();
  bindings.scalars = run->scalars;
  REQUIRE(std::count(bindings.scalars.begin(), bindings.scalars.end(), 2.5) == 1);
  std::replace(bindings.scalars.begin(), bindings.scalars.end(), 2.5, -3.0);
  const int64_t plans = jit::stats().plans_built;
  std::vector<NodePtr> results = jit::replay(*run, bindings);
  CHECK(jit::stats().plans_built == plans);
  REQUIRE(results.size() == run->outputs.size());
  Tensor replayed(results[static_cast<size_t>(at_y)]);
  CHECK(replayed.is_realized());
  CHECK(replayed.shape() == Shape{4, 3});
  CHECK(replayed.to_vector<float>() == relu(matmul(x2, w) * -3.0 + 1.0).to_vector<float>());
  CHECK(y.to_vector<float>() == first);  // the captured run's result is its own
}

TEST_CASE("replay: an update overwrites its old value only where one Var and the bindings hold it",
          "[jit][replay]") {
  Tensor w = from_vector<float>({1, 2, 3, 4}, {4}), g = from_vector<float>({0.5f, 0.5f, 1, 1}, {4});
  w.assign(w - g * 2.0);
  std::string why;
  std::optional<jit::CapturedRun> run = jit::realize_captured({w.node()}, why);
  REQUIRE(run);
  CHECK(w.to_vector<float>() == std::vector<float>{0, 1, 1, 2});
  const int at_w = external_at(*run, w) >= 0 ? external_at(*run, w) : -1;
  // The old value is gone: bind the current one where the capture read the old (the other
  // external is g).
  REQUIRE(run->externals.size() == 2);
  const int at_g = external_at(*run, g);
  REQUIRE(at_g >= 0);
  CHECK(at_w == -1);
  const size_t old_at = at_g == 0 ? 1 : 0;
  auto bind = [&](const Tensor& value) {
    jit::ReplayBindings b;
    b.externals.resize(2);
    b.externals[old_at] = value.node();
    b.externals[static_cast<size_t>(at_g)] = g.node();
    b.scalars = run->scalars;
    return b;
  };

  SECTION("one Var: written in place") {
    const void* buffer = w.node()->storage->data;
    std::vector<NodePtr> results = jit::replay(*run, bind(w));
    REQUIRE(results.size() == 1);
    CHECK(results[0]->storage->data == buffer);
    CHECK(Tensor(results[0]).to_vector<float>() == std::vector<float>{-1, 0, -1, 0});
  }
  SECTION("another Var holds the old value: it keeps it") {
    Tensor other(w.node());
    std::vector<NodePtr> results = jit::replay(*run, bind(w));
    REQUIRE(results.size() == 1);
    CHECK(results[0]->storage->data != other.node()->storage->data);
    CHECK(Tensor(results[0]).to_vector<float>() == std::vector<float>{-1, 0, -1, 0});
    CHECK(other.to_vector<float>() == std::vector<float>{0, 1, 1, 2});
  }
}

TEST_CASE("replay: random keys are bound per replay", "[jit][replay]") {
  Tensor r = rand({1000}) * 1.0;
  std::string why;
  std::optional<jit::CapturedRun> run = jit::realize_captured({r.node()}, why);
  REQUIRE(run);
  REQUIRE(run->random.size() == 1);
  const std::vector<float> drawn = r.to_vector<float>();
  jit::ReplayBindings same{{}, run->scalars, run->random};
  CHECK(Tensor(jit::replay(*run, same).at(0)).to_vector<float>() == drawn);
  jit::ReplayBindings next{{}, run->scalars, {{run->random[0].first, run->random[0].second + 1000}}};
  CHECK(Tensor(jit::replay(*run, next).at(0)).to_vector<float>() != drawn);
}

TEST_CASE("replay: a binding of another type, or a dropped plan, is an Error", "[jit][replay]") {
  Tensor x = rand({4, 8}).realize();
  Tensor y = exp(x) + 1.0;
  std::string why;
  std::optional<jit::CapturedRun> run = jit::realize_captured({y.node()}, why);
  REQUIRE(run);
  REQUIRE(run->externals.size() == 1);
  jit::ReplayBindings wrong{{rand({4, 9}).realize().node()}, run->scalars, run->random};
  CHECK_THROWS_WITH(jit::replay(*run, wrong), Catch::Contains("[4, 9]") && Catch::Contains("capture the step again"));
  jit::ReplayBindings pending{{(rand({4, 8}) * 2.0).node()}, run->scalars, run->random};
  CHECK_THROWS_WITH(jit::replay(*run, pending), Catch::Contains("not realized"));
  jit::ReplayBindings right{{rand({4, 8}).realize().node()}, run->scalars, run->random};
  CHECK_NOTHROW(jit::replay(*run, right));
  jit::clear_plan_cache();
  CHECK_THROWS_WITH(jit::replay(*run, right), Catch::Contains("clear_plan_cache"));
}

TEST_CASE("replay: nothing pending is not captured", "[jit][replay]") {
  Tensor x = rand({3}).realize();
  std::string why;
  CHECK_FALSE(jit::realize_captured({x.node()}, why));
  CHECK(why == "nothing was pending");
}
