#include "memory/profile.h"

#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>

namespace kiln::memory {

namespace {
constexpr size_t kKeptPlans = 32;

std::mutex g_mutex;
std::deque<std::shared_ptr<PlanLayout>> g_plans;
std::shared_ptr<PlanLayout> g_last;
std::atomic<bool> g_tracing{false};
std::chrono::steady_clock::time_point g_trace_start;
std::vector<KernelEvent> g_events;
std::string g_process_name = "kiln";
}  // namespace

void note_plan(std::shared_ptr<PlanLayout> layout) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_plans.push_back(std::move(layout));
  if (g_plans.size() > kKeptPlans) g_plans.pop_front();
}

void note_plan_run(const std::shared_ptr<PlanLayout>& layout) {
  std::lock_guard<std::mutex> lock(g_mutex);
  layout->runs++;
  g_last = layout;
}

std::vector<std::shared_ptr<const PlanLayout>> recent_plans() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return {g_plans.begin(), g_plans.end()};
}

std::shared_ptr<const PlanLayout> last_plan() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_last;
}

void start_trace() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_events.clear();
  g_trace_start = std::chrono::steady_clock::now();
  g_tracing = true;
}

void stop_trace() { g_tracing = false; }
bool tracing() { return g_tracing; }

double trace_clock_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - g_trace_start).count();
}

void record_kernel(KernelEvent event) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_events.push_back(std::move(event));
}

void set_trace_process_name(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_process_name = name;
}

std::string trace_process_name() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_process_name;
}

std::vector<KernelEvent> trace_events() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_events;
}

}  // namespace kiln::memory
