// Where memory goes, for humans: a report table, a Chrome trace of kernels and memory, and an SVG
// picture of a plan's arena. Everything here reads memory/profile.h and the pool's stats; nothing
// changes what the executor does.
//
//   kiln::memory::print_report();                      // pool stats, plans, biggest buffers
//   kiln::memory::start_trace();                        // (memory/profile.h)
//   step();                                             // realize something
//   kiln::memory::stop_trace();
//   kiln::memory::export_trace("step.json");            // open in ui.perfetto.dev or chrome://tracing
//   kiln::memory::write_last_plan_svg("arena.svg");     // open in a browser; hover a buffer
//   kiln::memory::write_timeline_svg("live.svg", *kiln::memory::last_plan());  // live bytes per kernel
#pragma once
#include <string>

#include "memory/profile.h"

namespace kiln::memory {

// A readable table: the CPU pool's stats (allocated, reserved, active, requested: current and
// peak; segments, retries, OOMs, largest free block, fragmentation), one line per recent plan
// (kernels, arena vs lower bound, output bytes, runs), what is live at the last plan's peak kernel
// (grouped by the kernel that made it), and the 10 largest buffers of the last plan with the
// kernel that made each and its lifetime.
std::string report();
void print_report();  // report() to stdout

// Writes the kernels recorded since start_trace() as Chrome trace-event JSON: one complete event
// ("ph": "X", ts and dur in µs) per kernel, and counter events ("ph": "C") for allocated tensor
// bytes and the pool's reserved bytes after each kernel. Throws kiln::Error if `path` cannot be
// written.
void export_trace(const std::string& path);

// An SVG picture of a plan's arena: x = kernel index, y = arena offset; each buffer a rectangle
// from kernel `first` to `last + 1` and from `offset` to `offset + bytes`, with a tooltip. Buffers
// that take over another's memory in place share its hue and have a dashed outline; a dashed line
// marks the lower bound. Besides one <rect class="buffer"> per buffer, the picture has exactly
// two other rects: the background and the plot frame (class "frame").
std::string arena_svg(const PlanLayout& layout);
void write_arena_svg(const std::string& path, const PlanLayout& layout);
// arena_svg of last_plan(); throws kiln::Error if nothing has been realized yet.
void write_last_plan_svg(const std::string& path);

// An SVG timeline of a plan's memory, as PyTorch's memory_viz draws one: the bytes of
// intermediates live during each kernel (in-place pairs counted once, so the peak is the plan's
// lower bound), the peak marked with its kernel, and the largest buffers live at the peak (up to
// six) as coloured bands over their lifetimes, named by the kernel that makes each (one
// <polygon class="buffer"> per named buffer, with a legend line and a hover title).
std::string timeline_svg(const PlanLayout& layout);
void write_timeline_svg(const std::string& path, const PlanLayout& layout);

}  // namespace kiln::memory
