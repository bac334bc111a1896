// bench_memory: memory of one SGD training step (forward + backward + update, one plan) of two
// MLPs, for kiln with its planner and pool, kiln with KILN_MEMORY_POOL=none, and PyTorch on the
// same model in the same run (bench/pytorch_memory.py, run through python3 when torch imports).
//
//   model a: MLP 784-512-512-10, batch 128
//   model b: 16 layers, 1024 wide (1024 -> 1024 x 15 -> 10), batch 256
//
// Figures (all measured on the third step; the first two compile and warm up):
//   kiln, planner + pool   the plan's arena (every intermediate: activations, gradients and
//                          temporaries of the step) against its lower bound, the output bytes
//                          (new parameters and the loss) and the pool's peak reserve;
//   kiln, budget 0.5       the arena with KILN_MEMORY_BUDGET=0.5 (recomputation; --budget X), the
//                          FLOPs recomputed, and the median step time against the planned one's;
//   kiln, int8             the arena with KILN_COMPRESS_ACTIVATIONS=int8 (memory/compress.h) and
//                          what the plan keeps compressed;
//   kiln, pool none        peak allocated tensor bytes above what was held before the step, and
//                          the step's peak RSS delta (the planner stays on: it has no switch);
//   PyTorch                bytes autograd saves for backward (saved_tensors_hooks; unique
//                          storages; activations only = without parameters and the input) and
//                          the step's peak RSS delta.
// The compared figure: kiln's arena / PyTorch's saved activations; goal <= 0.7. RSS deltas are
// measured with freed large blocks unmapped (M_MMAP_THRESHOLD fixed at 128 KiB in both
// processes) and the peak reset through /proc/self/clear_refs before the step.
//
// Build and run (from the repository root):
//   cmake -S . -B build-bench -DKILN_BUILD_TESTS=OFF && cmake --build build-bench -j2 --target bench_memory
//   ./build-bench/bench/bench_memory [--models a,b] [--budget 0.5] [--svg PREFIX] [--trace PREFIX] [--report]
//     --svg PREFIX writes PREFIX_a.svg, PREFIX_b.svg (arena pictures of the planned step),
//     --trace PREFIX writes PREFIX_a.json, ... (Chrome traces of the measured steps; open in
//     ui.perfetto.dev), --report prints kiln::memory::report() after each planned step
#include <fmt/format.h>
#include <kiln/kiln.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#ifndef KILN_BENCH_PYTORCH_SCRIPT
#define KILN_BENCH_PYTORCH_SCRIPT "bench/pytorch_memory.py"
#endif

namespace {

using kiln::memory::format_bytes;

struct Model {
  std::string name, title;
  std::vector<int64_t> widths;
  int64_t batch;
};

std::vector<Model> all_models() {
  std::vector<int64_t> deep(16, 1024);
  deep.push_back(10);
  return {{"a", "MLP 784-512-512-10, batch 128", {784, 512, 512, 10}, 128},
          {"b", "MLP 16 layers 1024 wide, batch 256", deep, 256}};
}

// ---- RSS of this process (Linux /proc) ----
int64_t status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  std::string prefix = std::string(field) + ":";
  while (std::getline(in, line))
    if (line.rfind(prefix, 0) == 0) return std::atoll(line.c_str() + prefix.size());
  return -1;
}
bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return f.good();
}

// ---- the step, as in tests/memory/test_planner.cpp ----
std::vector<kiln::Tensor> make_mlp(const std::vector<int64_t>& widths) {
  std::vector<kiln::Tensor> params;
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    params.push_back((kiln::randn({widths[i], widths[i + 1]}) * 0.05).realize().requires_grad_());  // (in, out)
    params.push_back(kiln::zeros({widths[i + 1]}).realize().requires_grad_());                      // (out)
  }
  return params;
}

void train_step(std::vector<kiln::Tensor>& params, const kiln::Tensor& x, const kiln::Tensor& y, double lr) {
  kiln::Tensor h = x;  // (B, widths[0])
  for (size_t i = 0; i + 1 < params.size(); i += 2) {
    h = kiln::matmul(h, params[i]) + params[i + 1];  // (B, widths[i/2 + 1])
    if (i + 2 < params.size()) h = kiln::relu(h);
  }
  kiln::Tensor loss = kiln::cross_entropy(h, y);
  {
    // The gradients go out of scope before the step is realized, as in a training loop: they
    // are intermediates of the plan, not outputs kept for the caller.
    std::vector<kiln::Tensor> grads = kiln::grad(loss, params);
    kiln::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].assign(params[i] - lr * grads[i]);
  }
  std::vector<kiln::Tensor> outputs = params;
  outputs.push_back(loss);
  kiln::sync(outputs);
}

// Steps timed after the measured one (the planned and the budgeted configurations).
constexpr int kTimedSteps = 5;

struct KilnFigures {
  kiln::memory::PlanLayout plan;
  int64_t held_before = 0;        // tensor bytes before the step (parameters, batch)
  int64_t peak_tensor_delta = 0;  // peak tensor bytes during the step minus held_before
  int64_t reserved_before = 0, reserved_peak = 0;
  int64_t rss_delta = -1;  // bytes; -1 when the peak could not be reset
  double step_ms = 0;      // median time of the steps after it, when timed
  std::string error;       // what kiln::Error said, if the step threw
};

// One configuration: the pool flag, the memory budget ("" = none), compression of saved
// activations and where to write a trace; `timed_steps` more steps give the median step time.
KilnFigures measure_kiln(const Model& m, kiln::MemoryPool pool, const std::string& budget, bool compress,
                         const std::string& trace_path, int timed_steps = 0) {
  kiln::FlagsGuard guard;
  kiln::flags().memory_pool = pool;
  kiln::flags().memory_budget = budget;
  kiln::flags().compress_activations = compress ? "int8" : "";
  kiln::manual_seed(1);
  std::vector<kiln::Tensor> params = make_mlp(m.widths);
  kiln::Tensor x = kiln::randn({m.batch, m.widths.front()}).realize();  // (B, in)
  std::vector<int64_t> labels(m.batch);
  for (int64_t i = 0; i < m.batch; ++i) labels[i] = i % m.widths.back();
  kiln::Tensor y = kiln::from_vector<int64_t>(labels, {m.batch});  // (B)
  y.realize();
  KilnFigures f;
  try {
    for (int i = 0; i < 2; ++i) train_step(params, x, y, 0.01);
    if (pool == kiln::MemoryPool::None) kiln::empty_cache();
    kiln::memory::reset_peak_stats();
    f.held_before = kiln::memory::allocated_bytes();
    f.reserved_before = kiln::memory::pool_stats().reserved.current;
    int64_t rss_before = status_kib("VmRSS");
    bool reset = reset_peak_rss();
    if (!trace_path.empty()) kiln::memory::start_trace();
    train_step(params, x, y, 0.01);
    if (!trace_path.empty()) {
      kiln::memory::stop_trace();
      kiln::memory::export_trace(trace_path);
    }
    if (reset) f.rss_delta = (status_kib("VmHWM") - rss_before) * 1024;
    f.peak_tensor_delta = kiln::memory::peak_allocated_bytes() - f.held_before;
    f.reserved_peak = kiln::memory::pool_stats().reserved.peak;
    if (auto plan = kiln::memory::last_plan()) f.plan = *plan;
    std::vector<double> times;
    for (int i = 0; i < timed_steps; ++i) {
      const auto start = std::chrono::steady_clock::now();
      train_step(params, x, y, 0.01);
      times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    if (!times.empty()) {
      std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
      f.step_ms = times[times.size() / 2];
    }
  } catch (const kiln::Error& e) {
    kiln::memory::stop_trace();
    f.error = e.what();
  }
  return f;
}

// PyTorch's figures per model from bench/pytorch_memory.py, or null with the reason printed.
nlohmann::json run_pytorch(const std::string& models) {
  if (std::system("python3 -c 'import torch' > /dev/null 2>&1") != 0) {
    fmt::print(
        "PyTorch: not installed (python3 -c 'import torch' failed), so no PyTorch column.\n"
        "  install it with:  pip install torch --index-url https://download.pytorch.org/whl/cpu\n\n");
    return nullptr;
  }
  std::string command =
      fmt::format("MALLOC_MMAP_THRESHOLD_=131072 python3 {} --json --models {}", KILN_BENCH_PYTORCH_SCRIPT, models);
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return nullptr;
  std::string text;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof buffer, pipe)) text.append(buffer, n);
  int status = pclose(pipe);
  size_t start = text.rfind("\n{");
  start = start == std::string::npos ? text.find('{') : start + 1;
  if (status != 0 || start == std::string::npos) {
    fmt::print("PyTorch: `{}` failed:\n{}\n", command, text);
    return nullptr;
  }
  return nlohmann::json::parse(text.substr(start));
}

std::string ratio(int64_t a, int64_t b) { return b > 0 ? fmt::format("{:.2f}x", double(a) / double(b)) : "-"; }

}  // namespace

int main(int argc, char** argv) {
  std::string models = "a,b", svg_prefix, trace_prefix, budget = "0.5";
  bool print_reports = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--models" && i + 1 < argc)
      models = argv[++i];
    else if (arg == "--budget" && i + 1 < argc)
      budget = argv[++i];
    else if (arg == "--svg" && i + 1 < argc)
      svg_prefix = argv[++i];
    else if (arg == "--trace" && i + 1 < argc)
      trace_prefix = argv[++i];
    else if (arg == "--report")
      print_reports = true;
  }
  // Freed blocks above 128 KiB go back to the OS at once, so a step's peak RSS delta is its own.
  mallopt(M_MMAP_THRESHOLD, 128 * 1024);

  nlohmann::json torch = run_pytorch(models);
  if (!torch.is_null())
    fmt::print("PyTorch {} ({} threads), CPU\n\n", torch["torch"].get<std::string>(), torch["threads"].get<int>());

  auto opt = [](int64_t v) { return v >= 0 ? format_bytes(v) : std::string("-"); };
  std::vector<std::string> rows, details;
  for (const Model& m : all_models()) {
    if (models.find(m.name) == std::string::npos) continue;
    std::string trace_path = trace_prefix.empty() ? "" : fmt::format("{}_{}.json", trace_prefix, m.name);
    KilnFigures planned = measure_kiln(m, kiln::MemoryPool::Pool, "", false, trace_path, kTimedSteps);
    if (print_reports) fmt::print("{}\n", kiln::memory::report());
    KilnFigures budgeted = measure_kiln(m, kiln::MemoryPool::Pool, budget, false, "", kTimedSteps);
    KilnFigures compressed = measure_kiln(m, kiln::MemoryPool::Pool, "", true, "");
    KilnFigures plain = measure_kiln(m, kiln::MemoryPool::None, "", false, "");
    if (!planned.error.empty() || !plain.error.empty() || !compressed.error.empty()) {
      fmt::print("model {}: kiln failed: {}{}{}\n", m.name, planned.error, plain.error, compressed.error);
      return 1;
    }
    int64_t saved = -1, saved_act = -1, torch_rss = -1;
    if (!torch.is_null() && torch["models"].contains(m.name)) {
      const auto& t = torch["models"][m.name];
      saved = t["saved_bytes"];
      saved_act = t["saved_activation_bytes"];
      torch_rss = t["rss_delta_bytes"];
    }
    int64_t arena = planned.plan.arena_bytes;
    int64_t budget_arena = budgeted.error.empty() ? budgeted.plan.arena_bytes : -1;
    rows.push_back(fmt::format("{:<6}{:>11}{:>11}{:>11}{:>11}{:>11} |{:>11}{:>11}{:>11} |{:>9}{:>9}{:>9}", m.name,
                               format_bytes(arena), opt(budget_arena), format_bytes(compressed.plan.arena_bytes),
                               format_bytes(plain.peak_tensor_delta),
                               opt(plain.rss_delta), opt(saved), opt(saved_act), opt(torch_rss),
                               ratio(arena, saved_act), budget_arena >= 0 ? ratio(budget_arena, saved_act) : "-",
                               ratio(plain.peak_tensor_delta, torch_rss)));

    std::string d = fmt::format("model {}: {}\n", m.name, m.title);
    d += fmt::format(
        "  kiln, planner + pool: {} kernels, {} buffers; arena {} ({} B), lower bound {} ({} B, {}), "
        "outputs {} ({} B)\n",
        planned.plan.kernels.size(), planned.plan.buffers.size(), format_bytes(arena), arena,
        format_bytes(planned.plan.lower_bound), planned.plan.lower_bound, ratio(arena, planned.plan.lower_bound),
        format_bytes(planned.plan.output_bytes), planned.plan.output_bytes);
    d += fmt::format(
        "    held before the step {} (parameters, batch); tensor bytes peak +{}; pool reserved {} "
        "before the step, peak {}\n",
        format_bytes(planned.held_before), format_bytes(planned.peak_tensor_delta),
        format_bytes(planned.reserved_before), format_bytes(planned.reserved_peak));
    if (budgeted.error.empty())
      d += fmt::format(
          "  kiln, KILN_MEMORY_BUDGET={}: arena {} (lower bound {}), {} kernels; tensor bytes peak +{}; recomputed "
          "{:.2f} GFLOP of the step's {:.2f}; step {:.1f} ms vs {:.1f} ms without a budget ({:.2f}x, medians of {})\n",
          budget, format_bytes(budget_arena), format_bytes(budgeted.plan.lower_bound), budgeted.plan.kernels.size(),
          format_bytes(budgeted.peak_tensor_delta), budgeted.plan.recomputed_flops * 1e-9,
          budgeted.plan.step_flops * 1e-9, budgeted.step_ms, planned.step_ms, budgeted.step_ms / planned.step_ms,
          kTimedSteps);
    else
      d += fmt::format("  kiln, KILN_MEMORY_BUDGET={}: {}\n", budget, budgeted.error);
    d += fmt::format("  kiln, KILN_COMPRESS_ACTIVATIONS=int8: arena {} (lower bound {}), {} kernels; {} saved values "
                     "compressed, {} kept as {}\n",
                     format_bytes(compressed.plan.arena_bytes), format_bytes(compressed.plan.lower_bound),
                     compressed.plan.kernels.size(), compressed.plan.compressed_values,
                     format_bytes(compressed.plan.compressed_from), format_bytes(compressed.plan.compressed_to));
    d += fmt::format("  kiln, KILN_MEMORY_POOL=none: tensor bytes peak +{} above {}; peak RSS delta {}\n",
                     format_bytes(plain.peak_tensor_delta), format_bytes(plain.held_before), opt(plain.rss_delta));
    if (saved >= 0) {
      d += fmt::format(
          "  PyTorch: saved for backward {} ({} B) in {} storages, activations only {} ({} B); "
          "peak RSS delta {}\n",
          format_bytes(saved), saved, torch["models"][m.name]["saved_tensors"].get<int64_t>(), format_bytes(saved_act),
          saved_act, opt(torch_rss));
      d += fmt::format(
          "  compared: kiln arena / PyTorch saved activations = {} (goal <= 0.70x: {}); with the "
          "budget {}; kiln arena / all PyTorch saved = {}\n",
          ratio(arena, saved_act), saved_act > 0 && arena * 10 <= saved_act * 7 ? "met" : "NOT met",
          budget_arena >= 0 ? ratio(budget_arena, saved_act) : "-", ratio(arena, saved));
    }
    if (!svg_prefix.empty()) {
      std::string path = fmt::format("{}_{}.svg", svg_prefix, m.name);
      kiln::memory::write_arena_svg(path, planned.plan);
      d += fmt::format("  arena picture: {}\n", path);
    }
    if (!trace_path.empty()) d += fmt::format("  trace of the planned step: {}\n", trace_path);
    details.push_back(d);
  }
  for (const std::string& d : details) fmt::print("{}\n", d);
  fmt::print("{:<6}{:>11}{:>11}{:>11}{:>11}{:>11} |{:>11}{:>11}{:>11} |{:>9}{:>9}{:>9}\n", "model", "arena",
             fmt::format("budget {}", budget), "int8", "none peak", "none RSS", "pt saved", "pt act", "pt RSS", "ar/act",
             "bud/act", "none/RSS");
  for (const std::string& r : rows) fmt::print("{}\n", r);
  fmt::print(
      "\narena = kiln's planned arena (every intermediate of the step: activations, gradients, "
      "temporaries); pt act = bytes PyTorch\nsaves for backward without parameters and input. Compared: "
      "ar/act, goal <= 0.70x. none/RSS = kiln's peak tensor bytes\nwith KILN_MEMORY_POOL=none / PyTorch's "
      "peak RSS delta (whole step, both with freed blocks unmapped).\n");
  return 0;
}
