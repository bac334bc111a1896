// The memory report, the Chrome trace and the arena picture, on a real MLP training step: the
// report names the last plan's numbers, the trace parses back with one slice per kernel run and
// memory counters in time order, the SVG draws one rectangle per planned buffer.
#include <kiln/kiln.h>
#include "tests/support/mlp.h"
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

using namespace kiln;

using kiln::testing::make_mlp;
using kiln::testing::mlp_step;

namespace {

struct TrainedMlp {
  std::vector<Tensor> params;
  Tensor x, y;
};

TrainedMlp trained_mlp() {
  manual_seed(11);
  TrainedMlp m{make_mlp({32, 64, 64, 10}), randn({16, 32}).realize(),
               from_vector<int64_t>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5}, {16})};
  mlp_step(m.params, m.x, m.y, 0.1);
  return m;
}

// A file name in the temp folder that no other test process uses.
std::string temp_path(const std::string& name) {
  static int counter = 0;
  auto dir = std::filesystem::temp_directory_path();
  return (dir / fmt::format("kiln_report_{}_{}_{}", getpid(), counter++, name)).string();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

}  // namespace

TEST_CASE("report: names the last plan's arena and lower bound", "[report]") {
  TrainedMlp m = trained_mlp();
  auto last = memory::last_plan();
  REQUIRE(last != nullptr);
  REQUIRE(last->arena_bytes > 0);
  std::string text = memory::report();
  INFO(text);
  CHECK(text.find(fmt::format("arena {} B", last->arena_bytes)) != std::string::npos);
  CHECK(text.find(fmt::format("lower bound {} B", last->lower_bound)) != std::string::npos);
  CHECK(text.find(fmt::format("outputs {} B", last->output_bytes)) != std::string::npos);
  CHECK(text.find("reserved") != std::string::npos);
  CHECK(text.find("fragmentation") != std::string::npos);
  CHECK(text.find("largest buffers of the last plan") != std::string::npos);
  CHECK(text.find("peak of the last plan") != std::string::npos);
  // The largest buffer is listed with the kernel that made it.
  const memory::PlannedBuffer* largest = &last->buffers[0];
  for (const auto& b : last->buffers)
    if (b.bytes > largest->bytes) largest = &b;
  CHECK(text.find(largest->made_by) != std::string::npos);
}

TEST_CASE("report: export_trace writes Chrome trace events for every kernel run", "[report]") {
  TrainedMlp m = trained_mlp();
  int64_t kernels_before = jit::stats().kernels_run;
  memory::start_trace();
  for (int s = 0; s < 2; ++s) mlp_step(m.params, m.x, m.y, 0.1);
  memory::stop_trace();
  int64_t kernels_run = jit::stats().kernels_run - kernels_before;
  REQUIRE(kernels_run > 0);

  std::string path = temp_path("trace.json");
  memory::export_trace(path);
  nlohmann::json trace = nlohmann::json::parse(read_file(path));
  std::filesystem::remove(path);
  REQUIRE(trace.contains("traceEvents"));
  const auto& events = trace["traceEvents"];
  REQUIRE(events.is_array());
  int64_t slices = 0, counters = 0;
  double last_ts = -1;
  std::set<std::string> counter_names;
  for (const auto& e : events) {
    std::string ph = e.at("ph");
    if (ph == "M") continue;
    double ts = e.at("ts");
    CHECK(ts >= last_ts);  // the file is in time order
    last_ts = ts;
    CHECK(e.contains("pid"));
    if (ph == "X") {
      ++slices;
      CHECK(e.at("dur").get<double>() >= 0);
      CHECK(e.contains("tid"));
      CHECK(!e.at("name").get<std::string>().empty());
    } else if (ph == "C") {
      ++counters;
      counter_names.insert(e.at("name").get<std::string>());
      CHECK(e.at("args").at("bytes").get<int64_t>() >= 0);
    }
  }
  CHECK(slices == kernels_run);
  CHECK(counters == 2 * kernels_run);  // tensor bytes and pool reserved after every kernel
  CHECK(counter_names == std::set<std::string>{"tensor bytes", "pool reserved"});
}

TEST_CASE("report: export_trace to an unwritable path throws", "[report]") {
  CHECK_THROWS_AS(memory::export_trace("/nonexistent-kiln-dir/sub/trace.json"), Error);
  CHECK_THROWS_AS(memory::write_arena_svg("/nonexistent-kiln-dir/sub/arena.svg", memory::PlanLayout{}), Error);
}

TEST_CASE("report: the arena SVG draws one rectangle per planned buffer", "[report]") {
  TrainedMlp m = trained_mlp();
  auto last = memory::last_plan();
  REQUIRE(last != nullptr);
  REQUIRE(!last->buffers.empty());
  std::string svg = memory::arena_svg(*last);
  REQUIRE(svg.rfind("<svg", 0) == 0);
  std::string trimmed = svg.substr(0, svg.find_last_not_of(" \n") + 1);
  REQUIRE(trimmed.size() >= 6);
  CHECK(trimmed.substr(trimmed.size() - 6) == "</svg>");
  CHECK(count(svg, "<svg") == 1);
  // Every buffer is a rect; the frame adds exactly two (background and plot area).
  CHECK(count(svg, "<rect class=\"buffer\"") == last->buffers.size());
  CHECK(count(svg, "<rect class=\"frame\"") == 2);
  CHECK(count(svg, "<rect") == last->buffers.size() + 2);
  // Balanced tooltips, one per buffer at least, and the numbers in the title.
  CHECK(count(svg, "<title>") == count(svg, "</title>"));
  CHECK(count(svg, "</rect>") == last->buffers.size());
  CHECK(svg.find(memory::format_bytes(last->arena_bytes)) != std::string::npos);
  CHECK(svg.find("lower bound") != std::string::npos);

  std::string path = temp_path("arena.svg");
  memory::write_last_plan_svg(path);
  CHECK(read_file(path) == svg);
  std::filesystem::remove(path);
}

TEST_CASE("report: the arena SVG of an empty plan has only the frame", "[report]") {
  std::string svg = memory::arena_svg(memory::PlanLayout{});
  CHECK(count(svg, "<rect") == 2);
  CHECK(svg.find("no intermediates") != std::string::npos);
}

TEST_CASE("report: the timeline SVG peaks at the plan's lower bound and names the largest buffers there",
          "[report]") {
  TrainedMlp m = trained_mlp();
  auto last = memory::last_plan();
  REQUIRE(last != nullptr);
  REQUIRE(!last->buffers.empty());
  const std::string svg = memory::timeline_svg(*last);
  REQUIRE(svg.rfind("<svg", 0) == 0);
  CHECK(count(svg, "<svg") == 1);
  CHECK(count(svg, "<title>") == count(svg, "</title>"));
  // The peak is the planner's lower bound (the most bytes live during one kernel).
  CHECK(svg.find("peak " + memory::format_bytes(last->lower_bound) + " at kernel") != std::string::npos);
  // The largest buffers live at the peak, as many as are live there (at most six), each named by
  // the kernel that makes it.
  const size_t bands = count(svg, "<polygon class=\"buffer\"");
  CHECK(bands >= 1);
  CHECK(bands <= 6);
  CHECK(count(svg, "made by kernel") == 2 * bands);  // a hover title and a legend line each
  CHECK(count(svg, "<polygon class=\"live\"") == 1);
  CHECK(count(svg, "class=\"peak\"") == 1);

  const std::string path = temp_path("live.svg");
  memory::write_timeline_svg(path, *last);
  CHECK(read_file(path) == svg);
  std::filesystem::remove(path);
  CHECK_THROWS_AS(memory::write_timeline_svg("/nonexistent-kiln-dir/sub/live.svg", *last), Error);
  CHECK(memory::timeline_svg(memory::PlanLayout{}).find("no intermediates") != std::string::npos);
}
