// What the samples' --trace FILE and --memory-report DIR record of a training step: steps 3 to 5
// (compiled and cached by then) as a Chrome trace, and with --memory-report the step plan's
// report, arena picture and live-bytes timeline, for people to look at. Under mpirun each process
// writes its own files (trace.json -> trace.rank1.json, DIR -> DIR/rank1).
#pragma once
#include <kiln/kiln.h>

#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <memory>
#include <string>

namespace kiln::samples {

class StepRecorder {
 public:
  // Empty paths: off. The report folder is made (and checked) now, not after the training.
  StepRecorder(std::string trace_path, std::string report_dir) : trace_path_(std::move(trace_path)) {
    const int world = distributed::world_size(), rank = distributed::rank();
    if (!trace_path_.empty() && world > 1) {
      std::filesystem::path p(trace_path_);
      trace_path_ = ((p.parent_path() / p.stem()).string() + fmt::format(".rank{}", rank) + p.extension().string());
    }
    if (report_dir.empty()) return;
    report_dir_ = world > 1 ? (std::filesystem::path(report_dir) / fmt::format("rank{}", rank)).string() : report_dir;
    std::error_code error;
    std::filesystem::create_directories(report_dir_, error);
    KILN_CHECK(!error && std::ofstream(std::filesystem::path(report_dir_) / "report.txt").good(), "--memory-report",
               "cannot write into {}{}; pass a folder you can create files in", report_dir_,
               error ? fmt::format(" ({})", error.message()) : "");
  }
  void before(int64_t step) {  // step: 0 for the first
    if (step == 2 && tracing_wanted()) memory::start_trace();
  }
  void after(int64_t steps_done) {
    // The step's plan: the largest one run since (a loss scaler's update is a small plan of its own).
    if (auto plan = memory::last_plan(); !report_dir_.empty() && plan && plan->kernels.size() > 1 &&
                                         (!step_plan_ || plan->kernels.size() >= step_plan_->kernels.size()))
      step_plan_ = plan;
    if (steps_done == 5) finish();
  }
  // Writes what was recorded, once (a run of fewer than 5 steps: its last step).
  void finish() {
    if (done_ || (!tracing_wanted())) return;
    done_ = true;
    if (memory::tracing()) {
      memory::stop_trace();
      for (const std::string& path : trace_paths()) memory::export_trace(path);
    }
    if (!report_dir_.empty() && step_plan_) {
      const std::filesystem::path dir(report_dir_);
      std::ofstream(dir / "report.txt") << memory::report();
      memory::write_arena_svg((dir / "arena.svg").string(), *step_plan_);
      memory::write_timeline_svg((dir / "timeline.svg").string(), *step_plan_);
    }
    if (!trace_path_.empty()) fmt::print("\nwrote the trace of steps 3 to 5 to {}\n", trace_path_);
    if (!report_dir_.empty())
      fmt::print("\nwrote the training step's memory to {}: report.txt, trace.json (ui.perfetto.dev), arena.svg, "
                 "timeline.svg\n", report_dir_);
  }

 private:
  bool tracing_wanted() const { return !trace_path_.empty() || !report_dir_.empty(); }
  std::vector<std::string> trace_paths() const {
    std::vector<std::string> paths;
    if (!trace_path_.empty()) paths.push_back(trace_path_);
    if (!report_dir_.empty()) paths.push_back((std::filesystem::path(report_dir_) / "trace.json").string());
    return paths;
  }

  std::string trace_path_, report_dir_;
  std::shared_ptr<const memory::PlanLayout> step_plan_;
  bool done_ = false;
};

}  // namespace kiln::samples
