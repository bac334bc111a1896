// Trace labels: a process-wide table of names, a thread's current label. See trace_label.h.
#include "core/trace_label.h"

#include <mutex>
#include <unordered_map>
#include <vector>

namespace kiln {

namespace {

thread_local uint32_t t_current = 0;

struct Table {
  std::mutex mutex;
  std::vector<std::string> names{""};
  std::unordered_map<std::string, uint32_t> ids;
};
// Never destroyed: nodes (and their labels) may outlive static destruction order.
Table& table() {
  static Table* t = new Table;
  return *t;
}

uint32_t intern(const std::string& name) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto [it, added] = t.ids.emplace(name, static_cast<uint32_t>(t.names.size()));
  if (added) t.names.push_back(name);
  return it->second;
}

}  // namespace

TraceLabel::TraceLabel(const std::string& name) : previous_(t_current) { t_current = intern(name); }
TraceLabel::~TraceLabel() { t_current = previous_; }

uint32_t current_trace_label() { return t_current; }

std::string trace_label_name(uint32_t label) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  return label < t.names.size() ? t.names[label] : std::string();
}

}  // namespace kiln
