#include "memory/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <numeric>
#include <utility>
#include <vector>

#include "core/error.h"
#include "memory/allocator.h"
#include "memory/pool.h"

namespace kiln::memory {

namespace {

// 1234567 -> "1.23 G": FLOP counts for people.
std::string format_count(int64_t n) {
  static const char* const units[] = {"", " k", " M", " G", " T", " P"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1000 && u < 5) v /= 1000, ++u;
  return u == 0 ? fmt::format("{}", n) : fmt::format("{:.2f}{}", v, units[u]);
}

constexpr size_t kTopBuffers = 10;

void write_text_file(const std::string& path, const std::string& text, const char* op) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  KILN_CHECK(out.is_open(), op, "cannot open '{}' for writing ({}); check that its folder exists and is writable", path,
             std::strerror(errno));
  out << text;
  out.close();
  KILN_CHECK(!out.fail(), op, "writing '{}' failed ({}); is the disk full?", path, std::strerror(errno));
}

// "1.04x", or "-" when there is no lower bound to compare with.
std::string ratio(int64_t value, int64_t bound) {
  return bound > 0 ? fmt::format("{:.2f}x", static_cast<double>(value) / static_cast<double>(bound)) : "-";
}

// The kernel where the most intermediate bytes are live, and the buffers live there. A buffer
// handed on in place at a kernel counts once there (its successor holds the same bytes).
struct Peak {
  int kernel = -1;
  int64_t bytes = 0;
  std::vector<size_t> live;
};

Peak peak_of(const PlanLayout& layout) {
  const std::vector<PlannedBuffer>& buffers = layout.buffers;
  std::vector<int> handed_on_at(buffers.size(), -1);
  for (const PlannedBuffer& b : buffers) {
    int p = b.in_place_of;
    if (p >= 0 && static_cast<size_t>(p) < buffers.size() && buffers[p].offset == b.offset &&
        buffers[p].last == b.first)
      handed_on_at[p] = b.first;
  }
  Peak peak;
  for (int k = 0; k < static_cast<int>(layout.kernels.size()); ++k) {
    int64_t bytes = 0;
    for (size_t i = 0; i < buffers.size(); ++i)
      if (buffers[i].first <= k && k <= buffers[i].last && handed_on_at[i] != k) bytes += buffers[i].bytes;
    if (bytes > peak.bytes) {
      peak.kernel = k;
      peak.bytes = bytes;
    }
  }
  for (size_t i = 0; i < buffers.size(); ++i)
    if (buffers[i].first <= peak.kernel && peak.kernel <= buffers[i].last && handed_on_at[i] != peak.kernel)
      peak.live.push_back(i);
  return peak;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Report table

std::string report() {
  std::string out;
  auto line = std::back_inserter(out);
  fmt::format_to(line, "kiln memory report\n\n");

  PoolStats s = pool_stats(Device::cpu());
  fmt::format_to(line, "pool (cpu)            current         peak\n");
  auto bytes_row = [&](const char* name, const Stat& stat) {
    fmt::format_to(line, "  {:<12} {:>12} {:>12}\n", name, format_bytes(stat.current), format_bytes(stat.peak));
  };
  bytes_row("allocated", s.allocated);
  bytes_row("reserved", s.reserved);
  bytes_row("active", s.active);
  bytes_row("requested", s.requested);
  fmt::format_to(line, "  {:<12} {:>12} {:>12}\n", "segments", s.segments.current, s.segments.peak);
  fmt::format_to(line, "  {:<12} {:>12} {:>12}\n", "allocations", s.allocations.current, s.allocations.peak);
  fmt::format_to(line, "  alloc retries {}, OOMs {}, largest free block {}, fragmentation {:.1f}%\n", s.alloc_retries,
                 s.ooms, format_bytes(s.largest_free_block), 100.0 * s.fragmentation());
  fmt::format_to(line, "  tensor bytes {} (peak {})\n\n", format_bytes(allocated_bytes()),
                 format_bytes(peak_allocated_bytes()));

  std::vector<std::shared_ptr<const PlanLayout>> plans = recent_plans();
  std::shared_ptr<const PlanLayout> last = last_plan();
  fmt::format_to(line, "plans (oldest first, * = last run)\n");
  fmt::format_to(line, "  {:>4} {:>8} {:>12} {:>12} {:>12} {:>12} {:>8}\n", "#", "kernels", "arena", "lower bound",
                 "arena/bound", "outputs", "runs");
  for (size_t i = 0; i < plans.size(); ++i) {
    const PlanLayout& p = *plans[i];
    fmt::format_to(line, "{} {:>4} {:>8} {:>12} {:>12} {:>12} {:>12} {:>8}\n", plans[i] == last ? " *" : "  ", i,
                   p.kernels.size(), format_bytes(p.arena_bytes), format_bytes(p.lower_bound),
                   ratio(p.arena_bytes, p.lower_bound), format_bytes(p.output_bytes), p.runs);
  }
  if (plans.empty()) fmt::format_to(line, "  (no plan has been built yet)\n");
  if (!last) return out;

  fmt::format_to(line, "\nlast plan: {} kernels, {} buffers, arena {} B, lower bound {} B ({}), outputs {} B\n",
                 last->kernels.size(), last->buffers.size(), last->arena_bytes, last->lower_bound,
                 ratio(last->arena_bytes, last->lower_bound), last->output_bytes);
  if (last->compressed_values > 0)
    fmt::format_to(line, "saved activations compressed: {} values, {} kept as {} ({:.2f}x)\n", last->compressed_values,
                   format_bytes(last->compressed_from), format_bytes(last->compressed_to),
                   static_cast<double>(last->compressed_to) / static_cast<double>(last->compressed_from));
  if (last->recomputed_values > 0) {
    fmt::format_to(line, "saved activations recomputed for the backward: {} values ({}); the copies cost {} FLOPs, "
                   "{:.1f}% of the step's {}",
                   last->recomputed_values, format_bytes(last->recomputed_bytes), format_count(last->recomputed_flops),
                   100.0 * static_cast<double>(last->recomputed_flops) / static_cast<double>(std::max<int64_t>(1, last->step_flops)),
                   format_count(last->step_flops));
    if (last->kernel_us > 0)
      fmt::format_to(line, "; measured {:.2f} ms of the step's {:.2f} ms of kernels ({:.1f}%)", last->recompute_us / 1e3,
                     last->kernel_us / 1e3, 100.0 * last->recompute_us / last->kernel_us);
    fmt::format_to(line, "\n");
  }
  if (last->offloaded_values > 0) {
    fmt::format_to(line, "saved activations offloaded to host memory: {} values ({}) in a {} host arena",
                   last->offloaded_values, format_bytes(last->offloaded_bytes), format_bytes(last->host_arena_bytes));
    if (last->kernel_us > 0)
      fmt::format_to(line, "; waits for the copies took {:.2f} ms of the step's {:.2f} ms", last->offload_wait_us / 1e3,
                     last->kernel_us / 1e3);
    fmt::format_to(line, "\n");
  }
  // What is live at the peak, grouped by the kernel summary and size that made it.
  Peak peak = peak_of(*last);
  if (peak.kernel >= 0) {
    fmt::format_to(line, "peak of the last plan: {} live at kernel {} ({}) in {} buffers\n", format_bytes(peak.bytes),
                   peak.kernel, last->kernels[peak.kernel], peak.live.size());
    std::vector<std::pair<std::pair<std::string, int64_t>, int>> groups;  // ((made_by, bytes), count)
    for (size_t i : peak.live) {
      std::pair<std::string, int64_t> key{last->buffers[i].made_by, last->buffers[i].bytes};
      auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
      if (it == groups.end())
        groups.push_back({key, 1});
      else
        it->second++;
    }
    std::stable_sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) {
      return a.first.second * a.second > b.first.second * b.second;
    });
    for (size_t g = 0; g < groups.size() && g < 6; ++g)
      fmt::format_to(line, "  {:>4} x {:>10}  {}\n", groups[g].second, format_bytes(groups[g].first.second),
                     groups[g].first.first);
    if (groups.size() > 6) fmt::format_to(line, "  ... and {} smaller groups\n", groups.size() - 6);
  }
  std::vector<size_t> order(last->buffers.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return last->buffers[a].bytes > last->buffers[b].bytes; });
  if (order.size() > kTopBuffers) order.resize(kTopBuffers);
  fmt::format_to(line, "largest buffers of the last plan\n");
  fmt::format_to(line, "  {:>4} {:>12} {:>12} {:>14} {:>8}  {}\n", "#", "bytes", "offset", "kernels", "in place",
                 "made by");
  for (size_t i : order) {
    const PlannedBuffer& b = last->buffers[i];
    std::string lifetime = fmt::format("{}..{} ({})", b.first, b.last, b.last - b.first + 1);
    std::string in_place = b.in_place_of >= 0 ? fmt::format("of {}", b.in_place_of) : "";
    fmt::format_to(line, "  {:>4} {:>12} {:>12} {:>14} {:>8}  {}\n", i, format_bytes(b.bytes), b.offset, lifetime,
                   in_place, b.made_by);
  }
  if (order.empty()) fmt::format_to(line, "  (no intermediates: every result is an output)\n");
  return out;
}

void print_report() { fmt::print("{}", report()); }

// ---------------------------------------------------------------------------------------------
// Chrome trace-event JSON (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU)

void export_trace(const std::string& path) {
  using nlohmann::json;
  constexpr int kPid = 1;
  std::vector<KernelEvent> events = trace_events();
  // Kernels ran one after another; keep the file in time order whatever order they were recorded.
  std::stable_sort(events.begin(), events.end(),
                   [](const KernelEvent& a, const KernelEvent& b) { return a.start_us < b.start_us; });
  json trace = json::array();
  trace.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", kPid}, {"args", {{"name", trace_process_name()}}}});
  // One row per kind of work: unlabelled kernels, each label's first word ("forward",
  // "backward"), and messages (collectives and the waits for them).
  std::vector<std::string> rows;
  auto row_of = [&](const KernelEvent& e) {
    std::string row = e.message ? "communication" : e.label.empty() ? "kernels" : e.label.substr(0, e.label.find(' '));
    auto at = std::find(rows.begin(), rows.end(), row);
    if (at != rows.end()) return static_cast<int>(at - rows.begin()) + 1;
    rows.push_back(row);
    trace.push_back({{"name", "thread_name"},
                     {"ph", "M"},
                     {"pid", kPid},
                     {"tid", static_cast<int>(rows.size())},
                     {"args", {{"name", row}}}});
    return static_cast<int>(rows.size());
  };
  auto microseconds = [](double us) { return std::round(us * 1000) / 1000; };  // to the ns
  for (const KernelEvent& e : events) {
    json args = {{"tensor_bytes", e.tensor_bytes}, {"reserved_bytes", e.reserved_bytes}};
    if (!e.label.empty()) args["label"] = e.label;
    const int tid = row_of(e);
    trace.push_back({{"name", e.name},
                     {"cat", e.message ? "message" : "kernel"},
                     {"ph", "X"},
                     {"ts", microseconds(e.start_us)},
                     {"dur", microseconds(e.duration_us)},
                     {"pid", kPid},
                     {"tid", tid},
                     {"args", args}});
    // Memory as it stands when the kernel has finished.
    double end = microseconds(e.start_us + e.duration_us);
    trace.push_back(
        {{"name", "tensor bytes"}, {"ph", "C"}, {"ts", end}, {"pid", kPid}, {"args", {{"bytes", e.tensor_bytes}}}});
    trace.push_back(
        {{"name", "pool reserved"}, {"ph", "C"}, {"ts", end}, {"pid", kPid}, {"args", {{"bytes", e.reserved_bytes}}}});
  }
  // The whole stream in time order (metadata first): viewers accept any order, readers of the file need not.
  std::stable_sort(trace.begin(), trace.end(),
                   [](const json& a, const json& b) { return a.value("ts", -1.0) < b.value("ts", -1.0); });
  // One event per line: small enough to read, grep and diff.
  std::string text = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  for (size_t i = 0; i < trace.size(); ++i) text += trace[i].dump() + (i + 1 < trace.size() ? ",\n" : "\n");
  text += "]}\n";
  write_text_file(path, text, "export_trace");
}

// ---------------------------------------------------------------------------------------------
// SVG picture of an arena

namespace {

std::string xml_escape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  return out;
}

// Picture geometry, in SVG user units.
constexpr double kWidth = 960, kHeight = 560;
constexpr double kLeft = 90, kRight = 20, kTop = 56, kBottom = 62;
constexpr double kPlotWidth = kWidth - kLeft - kRight, kPlotHeight = kHeight - kTop - kBottom;
constexpr double kGoldenAngle = 137.50776;  // degrees: consecutive hues stay far apart
constexpr size_t kTimelineNamed = 6;        // buffers the timeline names

}  // namespace

namespace {
// What both pictures share: the opening, the title, the background and plot frames (the two
// class="frame" rects) and the headings ...
std::string svg_begin(const std::string& heading, const std::string& subtitle) {
  std::string out;
  auto svg = std::back_inserter(out);
  fmt::format_to(svg,
                 "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
                 "font-family=\"sans-serif\" font-size=\"12\">\n",
                 kWidth, kHeight);
  fmt::format_to(svg, "<title>{}</title>\n", xml_escape(heading));
  fmt::format_to(svg, "<rect class=\"frame\" x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"white\"/>\n", kWidth,
                 kHeight);
  fmt::format_to(svg,
                 "<rect class=\"frame\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#f6f6f6\" "
                 "stroke=\"#444\"/>\n",
                 kLeft, kTop, kPlotWidth, kPlotHeight);
  fmt::format_to(svg,
                 "<text x=\"{}\" y=\"24\" text-anchor=\"middle\" font-size=\"15\" font-weight=\"bold\">{}</text>\n",
                 kWidth / 2, xml_escape(heading));
  fmt::format_to(svg, "<text x=\"{}\" y=\"42\" text-anchor=\"middle\" fill=\"#555\">{}</text>\n", kWidth / 2,
                 xml_escape(subtitle));
  return out;
}

// ... and the axes (kernel ticks below, hover for the kernel; byte ticks left) and the closing.
void svg_axes(std::string& out, const PlanLayout& layout, int kernels, int64_t top_bytes, const char* y_label) {
  auto svg = std::back_inserter(out);
  const int step = std::max(1, (kernels + 15) / 16);
  for (int k = 0; k <= kernels; k += step) {
    const double x = kLeft + kPlotWidth * k / kernels;
    std::string tip = k < static_cast<int>(layout.kernels.size()) ? xml_escape(layout.kernels[k]) : "end";
    fmt::format_to(svg,
                   "<line x1=\"{0:.2f}\" y1=\"{1}\" x2=\"{0:.2f}\" y2=\"{2}\" stroke=\"#444\"/>"
                   "<text x=\"{0:.2f}\" y=\"{3}\" text-anchor=\"middle\">{4}<title>{5}</title></text>\n",
                   x, kTop + kPlotHeight, kTop + kPlotHeight + 5, kTop + kPlotHeight + 18, k, tip);
  }
  for (int t = 0; t <= 4; ++t) {
    const int64_t bytes = top_bytes * t / 4;
    const double y = kTop + kPlotHeight - kPlotHeight * static_cast<double>(bytes) / top_bytes;
    fmt::format_to(svg,
                   "<line x1=\"{0}\" y1=\"{1:.2f}\" x2=\"{2}\" y2=\"{1:.2f}\" stroke=\"#444\"/>"
                   "<text x=\"{3}\" y=\"{4:.2f}\" text-anchor=\"end\">{5}</text>\n",
                   kLeft - 5, y, kLeft, kLeft - 8, y + 4, xml_escape(format_bytes(bytes)));
  }
  fmt::format_to(svg, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">kernel index (run order)</text>\n",
                 kLeft + kPlotWidth / 2, kHeight - 16);
  fmt::format_to(svg, "<text x=\"18\" y=\"{0}\" text-anchor=\"middle\" transform=\"rotate(-90 18 {0})\">{1}</text>\n",
                 kTop + kPlotHeight / 2, y_label);
  out += "</svg>\n";
}
}  // namespace

std::string arena_svg(const PlanLayout& layout) {
  const std::vector<PlannedBuffer>& buffers = layout.buffers;
  const size_t n = buffers.size();
  const int kernels = std::max<int>(1, static_cast<int>(layout.kernels.size()));
  int64_t top_bytes = std::max<int64_t>({layout.arena_bytes, layout.lower_bound, 1});
  for (const PlannedBuffer& b : buffers) top_bytes = std::max(top_bytes, b.offset + b.bytes);
  auto x_of = [&](int kernel) { return kLeft + kPlotWidth * kernel / kernels; };
  auto y_of = [&](int64_t offset) {
    return kTop + kPlotHeight - kPlotHeight * static_cast<double>(offset) / top_bytes;
  };

  // A buffer that took over another's memory (same offset) joins its chain: same hue, lighter
  // with each step, dashed outline.
  std::vector<int> root(n), depth(n, 0);
  std::vector<bool> chained(n, false);
  int roots = 0;
  std::vector<int> hue_index(n, 0);
  for (size_t i = 0; i < n; ++i) {
    int p = buffers[i].in_place_of;
    bool shares = p >= 0 && static_cast<size_t>(p) < i && buffers[p].offset == buffers[i].offset;
    if (shares) {
      root[i] = root[p];
      depth[i] = depth[p] + 1;
      chained[i] = chained[p] = true;
    } else {
      root[i] = static_cast<int>(i);
      hue_index[i] = roots++;
    }
  }

  int in_place = 0;
  for (size_t i = 0; i < n; ++i) in_place += depth[i] > 0;
  std::string heading = fmt::format("Plan arena {} (lower bound {}, {}): {} kernels, {} buffers, {} in place",
                                    format_bytes(layout.arena_bytes), format_bytes(layout.lower_bound),
                                    ratio(layout.arena_bytes, layout.lower_bound), layout.kernels.size(), n, in_place);
  std::string out = svg_begin(heading, "each rectangle is a buffer: kernels it lives through (x) by the arena bytes "
                                       "it holds (y); hover for details");
  auto svg = std::back_inserter(out);

  // Buffers.
  for (size_t i = 0; i < n; ++i) {
    const PlannedBuffer& b = buffers[i];
    double hue = std::fmod(hue_index[root[i]] * kGoldenAngle, 360.0);
    double lightness = 48 + 10 * (depth[i] % 4);
    double x0 = x_of(b.first), x1 = x_of(b.last + 1);
    double y0 = y_of(b.offset + b.bytes), y1 = y_of(b.offset);
    std::string outline =
        chained[i] ? fmt::format("stroke=\"hsl({:.0f},70%,25%)\" stroke-width=\"1.5\" stroke-dasharray=\"4 2\"", hue)
                   : std::string("stroke=\"white\" stroke-width=\"0.5\"");
    std::string tip = fmt::format("buffer {}: made by kernel {} ({})\n{} ({} B) at offset {}\nlives kernels {}..{}", i,
                                  b.first, b.made_by, format_bytes(b.bytes), b.bytes, b.offset, b.first, b.last);
    if (depth[i] > 0) tip += fmt::format("\nin place of buffer {}", b.in_place_of);
    fmt::format_to(svg,
                   "<rect class=\"buffer\" x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" "
                   "fill=\"hsl({:.0f},65%,{:.0f}%)\" {}><title>{}</title></rect>\n",
                   x0, y0, std::max(x1 - x0, 0.5), std::max(y1 - y0, 0.5), hue, lightness, outline, xml_escape(tip));
  }
  if (n == 0)
    fmt::format_to(svg, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#555\">no intermediates</text>\n",
                   kLeft + kPlotWidth / 2, kTop + kPlotHeight / 2);

  // Lower bound.
  if (layout.lower_bound > 0) {
    double y = y_of(layout.lower_bound);
    fmt::format_to(
        svg,
        "<line x1=\"{0}\" y1=\"{1:.2f}\" x2=\"{2}\" y2=\"{1:.2f}\" stroke=\"#c00\" stroke-dasharray=\"6 4\"/>\n"
        "<text x=\"{3}\" y=\"{4:.2f}\" text-anchor=\"end\" fill=\"#c00\">lower bound</text>\n",
        kLeft, y, kLeft + kPlotWidth, kLeft + kPlotWidth - 4, y - kTop < 16 ? y + 14 : y - 4);
  }

  svg_axes(out, layout, kernels, top_bytes, "arena offset");
  return out;
}

namespace {
// "#rrggbb" of a hue in degrees and saturation, lightness in [0, 1] (some SVG viewers lack hsl()).
std::string hsl_to_hex(double hue, double saturation, double lightness) {
  const double c = (1 - std::abs(2 * lightness - 1)) * saturation;
  const double h = hue / 60, x = c * (1 - std::abs(std::fmod(h, 2.0) - 1)), m = lightness - c / 2;
  double r = 0, g = 0, b = 0;
  if (h < 1) r = c, g = x;
  else if (h < 2) r = x, g = c;
  else if (h < 3) g = c, b = x;
  else if (h < 4) g = x, b = c;
  else if (h < 5) r = x, b = c;
  else r = c, b = x;
  auto byte = [m](double v) { return static_cast<int>(std::lround(255 * (v + m))); };
  return fmt::format("#{:02x}{:02x}{:02x}", byte(r), byte(g), byte(b));
}
}  // namespace

std::string timeline_svg(const PlanLayout& layout) {
  const std::vector<PlannedBuffer>& buffers = layout.buffers;
  const size_t n = buffers.size();
  const int kernels = std::max<int>(1, static_cast<int>(layout.kernels.size()));
  // Buffers that hand their memory on in place form one chain, live from its first buffer's
  // kernel to its last one's, holding its largest (aligned) size: as the planner counts them, so
  // the peak below is the plan's lower bound.
  struct Chain {
    int first = 0, last = 0;
    int64_t bytes = 0;
    std::vector<size_t> members;
  };
  std::vector<Chain> chains;
  std::vector<int> chain_of(n, -1);
  for (size_t i = 0; i < n; ++i) {
    const PlannedBuffer& b = buffers[i];
    const int p = b.in_place_of;
    const int64_t bytes = (b.bytes + 63) / 64 * 64;
    if (p >= 0 && static_cast<size_t>(p) < i && buffers[p].offset == b.offset && chain_of[p] >= 0) {
      Chain& c = chains[chain_of[p]];
      c.last = std::max(c.last, b.last);
      c.bytes = std::max(c.bytes, bytes);
      c.members.push_back(i);
      chain_of[i] = chain_of[p];
    } else {
      chain_of[i] = static_cast<int>(chains.size());
      chains.push_back({b.first, b.last, bytes, {i}});
    }
  }
  std::vector<int64_t> live(static_cast<size_t>(kernels) + 1, 0);
  for (const Chain& c : chains)
    for (int k = std::max(0, c.first); k <= std::min(c.last, kernels - 1); ++k) live[k] += c.bytes;
  const int peak = static_cast<int>(std::max_element(live.begin(), live.end() - 1) - live.begin());
  const int64_t top_bytes = std::max<int64_t>(live[peak], 1);
  // The largest chains live at the peak, largest first: drawn as bands from the bottom up.
  std::vector<int> named;
  for (size_t c = 0; c < chains.size(); ++c)
    if (chains[c].first <= peak && peak <= chains[c].last) named.push_back(static_cast<int>(c));
  std::stable_sort(named.begin(), named.end(), [&](int a, int b) { return chains[a].bytes > chains[b].bytes; });
  if (named.size() > kTimelineNamed) named.resize(kTimelineNamed);
  auto x_of = [&](double kernel) { return kLeft + kPlotWidth * kernel / kernels; };
  auto y_of = [&](int64_t bytes) { return kTop + kPlotHeight - kPlotHeight * static_cast<double>(bytes) / top_bytes; };
  // The buffer of a chain that is live at kernel k (its maker names the band).
  auto member_at = [&](const Chain& c, int k) {
    for (size_t i : c.members)
      if (buffers[i].first <= k && k <= buffers[i].last) return i;
    return c.members.front();
  };

  const std::string heading =
      n == 0 ? std::string("Live bytes per kernel: no intermediates")
             : fmt::format("Live bytes per kernel: peak {} at kernel {} of {} ({})", format_bytes(live[peak]), peak,
                           layout.kernels.size(), peak < static_cast<int>(layout.kernels.size()) ? layout.kernels[peak] : "");
  std::string out = svg_begin(heading, "the plan's intermediates live during each kernel (grey); in colour, the largest "
                                       "buffers live at the peak, named by the kernel that makes them");
  auto svg = std::back_inserter(out);
  if (n == 0) {
    fmt::format_to(svg, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#555\">no intermediates</text>\n",
                   kLeft + kPlotWidth / 2, kTop + kPlotHeight / 2);
    out += "</svg>\n";
    return out;
  }
  // Every live byte: a step outline over the kernels.
  std::string points = fmt::format("{:.2f},{:.2f}", x_of(0), y_of(0));
  for (int k = 0; k < kernels; ++k)
    points += fmt::format(" {0:.2f},{2:.2f} {1:.2f},{2:.2f}", x_of(k), x_of(k + 1), y_of(live[k]));
  points += fmt::format(" {:.2f},{:.2f}", x_of(kernels), y_of(0));
  fmt::format_to(svg, "<polygon class=\"live\" points=\"{}\" fill=\"#c8c8c8\" stroke=\"#888\"/>\n", points);
  // The named buffers, stacked from the bottom in order of size over their lifetimes.
  std::vector<int64_t> base(static_cast<size_t>(kernels), 0);
  for (size_t r = 0; r < named.size(); ++r) {
    const Chain& c = chains[named[r]];
    const int first = std::max(0, c.first), last = std::min(c.last, kernels - 1);
    std::string upper, lower;
    for (int k = first; k <= last; ++k) {
      upper += fmt::format("{0:.2f},{2:.2f} {1:.2f},{2:.2f} ", x_of(k), x_of(k + 1), y_of(base[k] + c.bytes));
      lower = fmt::format("{1:.2f},{2:.2f} {0:.2f},{2:.2f} ", x_of(k), x_of(k + 1), y_of(base[k])) + lower;
      base[k] += c.bytes;
    }
    const std::string colour = hsl_to_hex(std::fmod(static_cast<double>(r) * kGoldenAngle, 360.0), 0.65, 0.55);
    const PlannedBuffer& b = buffers[member_at(c, peak)];
    const std::string name = fmt::format("{} made by kernel {} ({}), live kernels {}..{}", format_bytes(b.bytes),
                                         b.first, b.made_by, c.first, c.last);
    fmt::format_to(svg,
                   "<polygon class=\"buffer\" points=\"{}{}\" fill=\"{}\" stroke=\"white\" "
                   "stroke-width=\"0.5\"><title>{}</title></polygon>\n",
                   upper, lower, colour, xml_escape(name));
    // Its legend line, top right.
    const double y = kTop + 18 + 16 * static_cast<double>(r);
    fmt::format_to(svg,
                   "<rect x=\"{}\" y=\"{:.2f}\" width=\"10\" height=\"10\" fill=\"{}\"/>"
                   "<text x=\"{}\" y=\"{:.2f}\" text-anchor=\"end\">{}</text>\n",
                   kLeft + kPlotWidth - 20, y - 9, colour, kLeft + kPlotWidth - 26, y, xml_escape(name));
  }
  // The peak.
  const double px = (x_of(peak) + x_of(peak + 1)) / 2;
  fmt::format_to(svg,
                 "<line class=\"peak\" x1=\"{0:.2f}\" y1=\"{1}\" x2=\"{0:.2f}\" y2=\"{2}\" stroke=\"#c00\" "
                 "stroke-dasharray=\"6 4\"/>\n<text x=\"{3:.2f}\" y=\"{4}\" text-anchor=\"{5}\" fill=\"#c00\">peak {6}</text>\n",
                 px, kTop, kTop + kPlotHeight, px + (px > kLeft + kPlotWidth * 0.8 ? -4 : 4), kTop + kPlotHeight - 6,
                 px > kLeft + kPlotWidth * 0.8 ? "end" : "start", xml_escape(format_bytes(live[peak])));
  svg_axes(out, layout, kernels, top_bytes, "live bytes");
  return out;
}

void write_timeline_svg(const std::string& path, const PlanLayout& layout) {
  write_text_file(path, timeline_svg(layout), "write_timeline_svg");
}

void write_arena_svg(const std::string& path, const PlanLayout& layout) {
  write_text_file(path, arena_svg(layout), "write_arena_svg");
}

void write_last_plan_svg(const std::string& path) {
  std::shared_ptr<const PlanLayout> layout = last_plan();
  KILN_CHECK(layout != nullptr, "write_last_plan_svg", "no plan has run yet; realize a tensor first");
  write_arena_svg(path, *layout);
}

}  // namespace kiln::memory
