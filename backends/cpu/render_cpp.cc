#include "backends/cpu/render_cpp.h"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "core/flags.h"
#include "backends/cpu/attention_prelude.h"
#include "backends/cpu/compiler.h"
#include "backends/cpu/cpu_prelude.h"
#include "jit/canonical_kernel.h"
#include "jit/math_prelude.h"
#include "jit/random_prelude.h"
#include "jit/render_common.h"

namespace kiln::cpu {
using namespace kiln::jit;  // the kernel IR and the render tables this renderer fills in

namespace {

// Work below this many elements is not worth waking the OpenMP team for.
constexpr int64_t kParallelThreshold = 32768;

// The host compiler's math: the prelude's vectorizable float functions, GCC builtins for double.
constexpr OpPatterns kCppPatterns = with_math(kSharedPatterns, {
    {Op::Exp, "kiln_expf({0})", "__builtin_exp({0})"},
    {Op::Log, "kiln_logf({0})", "__builtin_log({0})"},
    {Op::Sqrt, "__builtin_sqrtf({0})", "__builtin_sqrt({0})"},
    {Op::Rsqrt, "(1.0f / __builtin_sqrtf({0}))", "(1.0 / __builtin_sqrt({0}))"},
    {Op::Sin, "__builtin_sinf({0})", "__builtin_sin({0})"},
    {Op::Cos, "__builtin_cosf({0})", "__builtin_cos({0})"},
    {Op::Tanh, "kiln_tanhf({0})", "__builtin_tanh({0})"},
    {Op::Erf, "kiln_erff({0})", "__builtin_erf({0})"},
    {Op::Floor, "__builtin_floorf({0})", "__builtin_floor({0})"},
    {Op::Pow, "__builtin_powf({0}, {1})", "__builtin_pow({0}, {1})"},
});
static_assert(covers_every_op(kCppPatterns), "every primitive in core/op.h needs a renderer entry, in enum order");

class CppKernelRenderer {
 public:
  explicit CppKernelRenderer(const Kernel& k) : k_(k) {
    if (!runtime_extent(k)) return;
    // The extent follows the kernel's Rand pairs (canonical: isc[0, 1], isc[2, 3], ...).
    int rand_ints = 0;
    for (const Expr& e : k.exprs)
      if (e.kind == Expr::Kind::Rand) rand_ints = std::max(rand_ints, e.slot + 2);
    extent_from_ = rand_ints;
  }
  std::string render();

 private:
  std::string buf(int b) const { return values_.buf(b); }
  std::string idx(const IndexExpr& e) const { return values_.idx(e); }
  void emit_values(std::string& out, const std::string& indent) const { values_.emit_values(out, indent); }
  std::string v(int id) const { return values_.v(id); }
  // Store of value `id` into a buffer of type `t`: a bfloat16 value that is exact already only
  // loses its low half (rounding it again would cost a dozen integer ops per element).
  std::string store(DType t, int id) const {
    if (t == DType::BFloat16 && k_.exprs[id].dtype == DType::BFloat16 && values_.exact(id))
      return fmt::format("kiln_f2bf_exact({})", v(id));
    return store_value(t, v(id));
  }
  void render_column_reduce(std::string& out, const char* acc_t, const std::string& init, bool is_sum,
                            bool parallel) const;
  void render_lane_sum(std::string& out, const std::string& indent, const char* acc_t, size_t first_reduce,
                       const std::string& lo, const std::string& hi) const;
  void render_blocked_sum(std::string& out, const char* acc_t, bool parallel) const;
  std::string attention_view(const AttentionOperand& op) const;
  void render_attention(std::string& out) const;
  void render_streamed(std::string& out) const;

  // Loop l's extent in the text: a constant, or the run-time argument of a flat kernel.
  std::string extent(size_t l) const {
    return extent_from_ >= 0 ? std::string("kiln_n") : fmt::format("{}LL", k_.loops[l].extent);
  }

  const Kernel& k_;
  int extent_from_ = -1;  // where in isc a flat kernel's extent is; -1: sizes are constants
  ValueRenderer values_{k_, kCppPatterns};
};

// Loops: chunks of the output's last axis (parallel) x reduce axes x the chunk (vectorized),
// with an accumulator array per chunk, so every load in the inner loop is contiguous.
void CppKernelRenderer::render_column_reduce(std::string& out, const char* acc_t, const std::string& init,
                                             bool is_sum, bool parallel) const {
  constexpr int64_t kChunk = 128;
  const Loop& outer = k_.loops.front();
  const Loop& inner = k_.loops.back();
  const int64_t chunks = (inner.extent + kChunk - 1) / kChunk;
  if (parallel) out += "  #pragma omp parallel for\n";
  out += fmt::format("  for (int64_t t = 0; t < {}LL; ++t) {{\n", outer.extent * chunks);
  out += fmt::format("    const int64_t {} = t / {}LL, c0 = (t % {}LL) * {}LL;\n", outer.var, chunks, chunks, kChunk);
  out += fmt::format("    const int64_t cn = {}LL - c0 < {}LL ? {}LL - c0 : {}LL;\n", inner.extent, kChunk, inner.extent, kChunk);
  out += fmt::format("    {} acc[{}];\n    for (int64_t j = 0; j < cn; ++j) acc[j] = {};\n", acc_t, kChunk, init);
  std::string indent = "    ";
  for (size_t l = 1; l + 1 < k_.loops.size(); ++l) {
    out += fmt::format("{0}for (int64_t {1} = 0; {1} < {2}LL; ++{1}) {{\n", indent, k_.loops[l].var, k_.loops[l].extent);
    indent += "  ";
  }
  out += indent + "#pragma omp simd\n";
  out += fmt::format("{}for (int64_t j = 0; j < cn; ++j) {{\n", indent);
  out += fmt::format("{}  const int64_t {} = c0 + j;\n", indent, inner.var);
  emit_values(out, indent + "  ");
  std::string result = v(k_.value);
  out += fmt::format("{}  {}\n", indent,
                     is_sum ? fmt::format("acc[j] += {};", result) : fmt::format("acc[j] = KILN_MAX({}, acc[j]);", result));
  out += indent + "}\n";
  for (size_t l = 1; l + 1 < k_.loops.size(); ++l) {
    indent.resize(indent.size() - 2);
    out += indent + "}\n";
  }
  out += "    for (int64_t j = 0; j < cn; ++j) {\n";
  out += fmt::format("      const int64_t {} = c0 + j;\n", inner.var);
  out += fmt::format("      {}[{}] = {};\n", buf(0), idx(k_.store_index), store_value(k_.buffers[0].dtype, "acc[j]"));
  out += "    }\n  }\n";
}

// A float sum in a fixed order, whatever the vector width, the fusion or the thread count
// (issue 18's one result): element r of the innermost reduce loop goes to lane r % 16, each lane
// adds its elements in order, and the 16 lanes are folded by halves. Vectorized or not (a fused
// producer GCC cannot vectorize, AVX2 or AVX-512), the additions are the same. Reads loops
// [first_reduce, end) with the innermost over [lo, hi); leaves the sum in `part[0]`.
void CppKernelRenderer::render_lane_sum(std::string& out, const std::string& indent, const char* acc_t,
                                        size_t first_reduce, const std::string& lo, const std::string& hi) const {
  constexpr int kLanes = 16;
  out += fmt::format("{}{} kiln_part[{}];\n{}for (int kiln_j = 0; kiln_j < {}; ++kiln_j) kiln_part[kiln_j] = 0;\n", indent, acc_t, kLanes, indent,
                     kLanes);
  std::string in = indent;
  for (size_t l = first_reduce; l + 1 < k_.loops.size(); ++l) {
    out += fmt::format("{0}for (int64_t {1} = 0; {1} < {2}LL; ++{1}) {{\n", in, k_.loops[l].var, k_.loops[l].extent);
    in += "  ";
  }
  const std::string& r = k_.loops.back().var;
  const std::string result = v(k_.value);
  out += fmt::format("{}const int64_t kiln_full = {} + ({} - {}) / {} * {};\n", in, lo, hi, lo, kLanes, kLanes);
  out += fmt::format("{}for (int64_t kiln_base = {}; kiln_base < kiln_full; kiln_base += {}) {{\n", in, lo, kLanes);
  out += fmt::format("{}  #pragma omp simd\n{}  for (int64_t kiln_j = 0; kiln_j < {}; ++kiln_j) {{\n", in, in, kLanes);
  out += fmt::format("{}    const int64_t {} = kiln_base + kiln_j;\n", in, r);
  emit_values(out, in + "    ");
  out += fmt::format("{}    kiln_part[kiln_j] += {};\n{}  }}\n{}}}\n", in, result, in, in);
  // The tail as one masked step (the same lanes): as a scalar loop it cost more than the full
  // steps of a 28-wide row, and all of a 14-wide one.
  out += fmt::format("{}if (kiln_full < {}) {{\n", in, hi);
  out += fmt::format("{}  #pragma omp simd\n{}  for (int64_t kiln_j = 0; kiln_j < {}; ++kiln_j) {{\n", in, in, kLanes);
  out += fmt::format("{}    if (kiln_full + kiln_j < {}) {{\n", in, hi);
  out += fmt::format("{}      const int64_t {} = kiln_full + kiln_j;\n", in, r);
  emit_values(out, in + "      ");
  out += fmt::format("{}      kiln_part[kiln_j] += {};\n{}    }}\n{}  }}\n{}}}\n", in, result, in, in, in);
  for (size_t l = first_reduce; l + 1 < k_.loops.size(); ++l) {
    in.resize(in.size() - 2);
    out += in + "}\n";
  }
  out += fmt::format("{}for (int kiln_w = {}; kiln_w > 0; kiln_w /= 2)\n{}  for (int kiln_j = 0; kiln_j < kiln_w; ++kiln_j) kiln_part[kiln_j] += kiln_part[kiln_j + kiln_w];\n",
                     indent, kLanes / 2, indent);
}

// A whole 1-d float sum: fixed blocks summed in lanes (render_lane_sum), on any thread, then the
// block sums added in order, so the thread count does not move the result either.
void CppKernelRenderer::render_blocked_sum(std::string& out, const char* acc_t, bool parallel) const {
  // Blocks of 16384 elements, at most 4096 of them (longer blocks beyond 64M elements).
  out += fmt::format("  const int64_t kiln_len = {};\n", extent(0));
  out += "  const int64_t kiln_block = (kiln_len + 16383) / 16384 > 4096 ? ((kiln_len + 4095) / 4096 + 15) / 16 * 16 : 16384;\n";
  out += "  const int64_t kiln_blocks = kiln_len > kiln_block ? (kiln_len + kiln_block - 1) / kiln_block : 1;\n";
  out += fmt::format("  {} kiln_block_sum[kiln_blocks];\n", acc_t);
  if (parallel) out += "  #pragma omp parallel for\n";
  out += "  for (int64_t kiln_b = 0; kiln_b < kiln_blocks; ++kiln_b) {\n";
  out += "    const int64_t kiln_lo = kiln_b * kiln_block, kiln_hi = kiln_lo + kiln_block < kiln_len ? kiln_lo + kiln_block : kiln_len;\n";
  render_lane_sum(out, "    ", acc_t, 0, "kiln_lo", "kiln_hi");
  out += "    kiln_block_sum[kiln_b] = kiln_part[0];\n  }\n";
  out += fmt::format("  {} acc = 0;\n  for (int64_t kiln_b = 0; kiln_b < kiln_blocks; ++kiln_b) acc += kiln_block_sum[kiln_b];\n", acc_t);
  out += fmt::format("  {}[{}] = {};\n", buf(0), idx(k_.store_index), store_value(k_.buffers[0].dtype, "acc"));
}

// bfloat16 operands (q, k, v under autocast) are read through the prelude's KilnBf16.
std::string CppKernelRenderer::attention_view(const AttentionOperand& op) const {
  const bool bf16 = k_.buffers[static_cast<size_t>(op.buffer)].dtype == DType::BFloat16;
  const char* element = bf16 ? "KilnBf16" : compute_type(k_.buffers[static_cast<size_t>(op.buffer)].dtype);
  return fmt::format("KilnAttnView<{0}, {1}LL, {2}LL, {3}LL, {4}LL>{{({0}*){5} + {6}LL}}", element, op.strides[0],
                     op.strides[1], op.strides[2], op.strides[3], buf(op.buffer), op.offset);
}

// A call of the prelude's template (backends/cpu/attention_prelude.h) with every size constant.
// Tiles of up to 64 query rows by 64 keys; the key tile is a multiple of 16 (one AVX-512 vector
// of floats) so its rows vectorize without a remainder. A causal backward takes 32 x 32 tiles,
// which skip more of the hidden half (measured 1.14x faster at T = 64, d = 32).
void CppKernelRenderer::render_attention(std::string& out) const {
  const AttentionCall& a = k_.attention;
  const int64_t tile = a.backward && a.causal ? 32 : 64;
  const int64_t br = std::min<int64_t>(tile, a.Tq), bc = std::min<int64_t>(tile, (a.Tk + 15) / 16 * 16);
  const char* t = compute_type(k_.buffers[0].dtype);
  out += fmt::format("  kiln_attention_{}<{}, {}LL, {}LL, {}LL, {}LL, {}LL, {}LL, {}LL, {}LL, {}>(\n",
                     a.backward ? "backward" : "forward", t, a.B, a.H, a.Tq, a.Tk, a.D, a.Dv, br, bc,
                     a.causal ? "true" : "false");
  std::vector<const AttentionOperand*> ops = {&a.q, &a.k, &a.v, &a.o, &a.lse};
  if (a.backward) ops.insert(ops.end(), {&a.dout, &a.dq, &a.dk, &a.dv});
  for (const AttentionOperand* op : ops) out += "      " + attention_view(*op) + ",\n";
  out += fmt::format("      ({}){:.17g});\n", t, a.scale);
}

// A flat elementwise kernel whose output is at least KILN_STREAM_BYTES (flags().stream_bytes:
// the last-level cache) writes it with non-temporal stores: each thread computes 1024 elements
// into a tile on its stack and streams the tile out (kiln_stream), so the output's lines are not
// read into the cache first only to be evicted. Smaller outputs stay cached for their readers and
// take the plain loop after this block. The values are those of the plain loop, element by element.
void CppKernelRenderer::render_streamed(std::string& out) const {
  const Loop& l0 = k_.loops[0];
  const char* t = storage_type(k_.buffers[0].dtype);
  // Without AVX kiln_stream is a plain copy: the tile would only add one.
  out += "#if defined(__AVX__)\n";
  out += fmt::format("  if ({0} * (int64_t)sizeof({1}) >= KILN_STREAM_BYTES && ((uintptr_t){2} & 63) == 0) {{\n",
                     extent(0), t, buf(0));
  out += "    #pragma omp parallel\n    {\n";
  out += "      #pragma omp for schedule(static) nowait\n";
  out += fmt::format("      for (int64_t kiln_c = 0; kiln_c < {0}; kiln_c += 1024) {{\n", extent(0));
  out += fmt::format("        {} kiln_tile[1024] __attribute__((aligned(64)));\n", t);
  out += fmt::format("        const int64_t kiln_end = {0} - kiln_c < 1024 ? {0} : kiln_c + 1024;\n", extent(0));
  out += "        #pragma omp simd\n";
  out += fmt::format("        for (int64_t {0} = kiln_c; {0} < kiln_end; ++{0}) {{\n", l0.var);
  emit_values(out, "          ");
  out += fmt::format("          kiln_tile[{} - kiln_c] = {};\n", l0.var, store(k_.buffers[0].dtype, k_.value));
  out += "        }\n";
  out += fmt::format("        kiln_stream({} + kiln_c, kiln_tile, (kiln_end - kiln_c) * (int64_t)sizeof({}));\n", buf(0), t);
  out += "      }\n";
  out += "      kiln_sfence();  // the streamed lines are visible before the team's barrier\n";
  out += "    }\n    return;\n  }\n#endif\n";
}

std::string CppKernelRenderer::render() {
  std::string out;
  if (!k_.summary.empty()) out += fmt::format("// {}\n", k_.summary);
  // An elementwise kernel that evaluates exp, erf, tanh, ... or rounds values to float16 /
  // bfloat16 (a handful of integer operations each) is compute-bound: the widest vectors are
  // worth it there (1.6x on a GELU chain, 1.4x on a bfloat16 concatenation, with AVX-512), while
  // memory-bound kernels keep GCC's narrower default, measured slightly faster for them. Each
  // element's value is the same at any width; reductions keep one width, so their order of
  // additions does not move.
  const bool wide = k_.kind == KernelKind::Elementwise &&
                    std::any_of(k_.exprs.begin(), k_.exprs.end(), [](const Expr& e) {
                      return e.kind == Expr::Kind::Compute &&
                             (e.op == Op::Exp || e.op == Op::Erf || e.op == Op::Tanh || e.op == Op::Log ||
                              e.op == Op::Pow || e.dtype == DType::BFloat16 || e.dtype == DType::Float16);
                    });
  // A kernel with a tiled operand runs over a range of its loop 0 per tile (cpu_backend.cc).
  const bool tiled = k_.tiles.buffer >= 0;
  out += fmt::format("extern \"C\" {}void {}(void* const* bufs, const double* sc, const int64_t* isc, int64_t* err{}) {{\n",
                     wide ? "__attribute__((target(\"prefer-vector-width=512\"))) " : "", k_.name,
                     tiled ? ", int64_t lo, int64_t hi" : "");
  for (size_t b = 0; b < k_.buffers.size(); ++b)
    out += fmt::format("  {}* {} = ({}*)bufs[{}];\n", storage_type(k_.buffers[b].dtype), buf(static_cast<int>(b)),
                       storage_type(k_.buffers[b].dtype), k_.buffers[b].slot);
  for (const Expr& e : k_.exprs)
    if (e.kind == Expr::Kind::Scalar)
      out += fmt::format("  {}\n", scalar_declaration(e.dtype, e.slot));
  if (extent_from_ >= 0) out += fmt::format("  const int64_t kiln_n = isc[{}];\n", extent_from_);
  out += "  (void)sc; (void)isc; (void)err;\n";

  DType out_t = k_.buffers[0].dtype;
  std::string result = v(k_.value);
  int64_t work = tiled ? k_.out_numel / k_.loops[0].extent * k_.tiles.loop_per_tile : k_.out_numel;
  for (const Loop& l : k_.loops)
    if (l.role == Loop::Role::Reduce) work *= l.extent;
  // Small kernels run on the calling thread with no parallel region at all: `parallel ... if(0)`
  // still costs a GOMP_parallel call, and on a combined `parallel for simd` an unqualified if()
  // also switches off the simd part (OpenMP 5.0), leaving the loop unvectorized.
  const bool parallel = work > kParallelThreshold;
  const std::string parallel_for = parallel ? "parallel for " : "";

  if (k_.kind == KernelKind::Attention) {
    render_attention(out);
  } else if (k_.kind == KernelKind::Elementwise) {
    const Loop& l0 = k_.loops[0];
    const std::string l0_from = tiled ? "lo" : "0", l0_to = tiled ? "hi" : extent(0);
    if (k_.loops.size() == 1) {
      if (parallel && !tiled && k_.side_stores.empty() && idx(k_.store_index) == l0.var && stream_threshold_bytes() > 0)
        render_streamed(out);
      out += fmt::format("  #pragma omp {}simd\n", parallel_for);
      out += fmt::format("  for (int64_t {0} = {1}; {0} < {2}; ++{0}) {{\n", l0.var, l0_from, l0_to);
      emit_values(out, "    ");
    } else {
      const Loop& l1 = k_.loops[1];
      if (parallel) out += "  #pragma omp parallel for\n";
      out += fmt::format("  for (int64_t {0} = {1}; {0} < {2}; ++{0}) {{\n", l0.var, l0_from, l0_to);
      // Output elements are independent; without the pragma GCC -O2 will not vectorize a loop
      // that needs a run-time alias check.
      out += "  #pragma omp simd\n";
      out += fmt::format("  for (int64_t {0} = 0; {0} < {1}LL; ++{0}) {{\n", l1.var, l1.extent);
      emit_values(out, "    ");
    }
    out += fmt::format("    {}[{}] = {};\n", buf(0), idx(k_.store_index), store(out_t, k_.value));
    for (const SideStore& side : k_.side_stores)
      out += fmt::format("    {}[{}] = {};\n", buf(side.buffer), idx(k_.store_index),
                         store(k_.buffers[side.buffer].dtype, side.value));
    out += k_.loops.size() == 1 ? "  }\n" : "  }}\n";
  } else if (k_.kind == KernelKind::Reduce) {
    bool is_sum = k_.reduce_op == Op::ReduceSum;
    DType acc_dtype = out_t;
    const char* acc_t = compute_type(acc_dtype);
    std::string init = reduce_init(acc_dtype, is_sum, "__builtin_inff()");
    std::string combine = is_sum ? fmt::format("acc += {};", result) : fmt::format("acc = KILN_MAX({}, acc);", result);
    // OpenMP's built-in max drops NaN when it combines partial results (and GCC's simd version
    // can lose every element): floats use the prelude's NaN-propagating kiln_max reduction.
    std::string clause = is_sum ? "reduction(+:acc)"
                                : (is_floating(acc_dtype) ? "reduction(kiln_max:acc)" : "reduction(max:acc)");
    if (k_.column) {
      render_column_reduce(out, acc_t, init, is_sum, parallel);
      out += "}\n";
      return out;
    }
    bool has_outer = !k_.loops.empty() && k_.loops[0].role == Loop::Role::Parallel;
    std::string indent = "  ";
    // A few elements per output (pooling windows): vectorize across outputs instead; the
    // constant-trip reduce loops unroll inside the vector body.
    int64_t reduce_extent = 1;
    for (size_t l = has_outer ? 1 : 0; l < k_.loops.size(); ++l) reduce_extent *= k_.loops[l].extent;
    const bool simd_outer = has_outer && reduce_extent <= 16;
    const bool lanes = is_sum && is_floating(acc_dtype) && !simd_outer && k_.loops.size() > (has_outer ? 1u : 0u);
    if (lanes && !has_outer && k_.loops.size() == 1) {
      render_blocked_sum(out, acc_t, parallel);
      out += "}\n";
      return out;
    }
    if (has_outer) {
      if (parallel || simd_outer) out += fmt::format("  #pragma omp {}{}\n", parallel_for, simd_outer ? "simd" : "");
      out += fmt::format("  for (int64_t {0} = 0; {0} < {1}LL; ++{0}) {{\n", k_.loops[0].var, k_.loops[0].extent);
      indent = "    ";
    }
    out += fmt::format("{}{} acc = {};\n", indent, acc_t, init);
    size_t first_reduce = has_outer ? 1 : 0;
    if (lanes) {
      render_lane_sum(out, indent, acc_t, first_reduce, "0", fmt::format("{}LL", k_.loops.back().extent));
      out += fmt::format("{}acc = kiln_part[0];\n", indent);
      out += fmt::format("{}{}[{}] = {};\n", indent, buf(0), idx(k_.store_index), store_value(out_t, "acc"));
      if (has_outer) out += "  }\n";
      out += "}\n";
      return out;
    }
    std::string inner_indent = indent;
    for (size_t l = first_reduce; l < k_.loops.size(); ++l) {
      const Loop& loop = k_.loops[l];
      bool innermost = l + 1 == k_.loops.size();
      if (!has_outer && l == first_reduce && k_.loops.size() == 1)
        out += fmt::format("{}#pragma omp {}simd {}\n", inner_indent, parallel_for, clause);
      else if (innermost && is_sum && is_floating(acc_dtype))
        out += fmt::format("{}#pragma omp simd {}\n", inner_indent, clause);
      out += fmt::format("{0}for (int64_t {1} = 0; {1} < {2}LL; ++{1}) {{\n", inner_indent, loop.var, loop.extent);
      inner_indent += "  ";
    }
    emit_values(out, inner_indent);
    out += inner_indent + combine + "\n";
    for (size_t l = first_reduce; l < k_.loops.size(); ++l) {
      inner_indent.resize(inner_indent.size() - 2);
      out += inner_indent + "}\n";
    }
    out += fmt::format("{}{}[{}] = {};\n", indent, buf(0), idx(k_.store_index), store_value(out_t, "acc"));
    if (has_outer) out += "  }\n";
  } else if (k_.kind == KernelKind::Scatter) {
    out += fmt::format("  #pragma omp {}simd\n", k_.out_numel > kParallelThreshold ? "parallel for " : "");
    out += fmt::format("  for (int64_t z = 0; z < {}LL; ++z) {}[z] = {};\n", k_.out_numel, buf(0),
                       store_value(out_t, "0"));
    const Loop& l0 = k_.loops[0];
    const Loop& l1 = k_.loops[1];
    // Along a leading axis (an embedding's gradient: rows of the source scattered into rows of
    // the table), neighbouring outputs `o` are neighbouring columns of the source: take them 16 at
    // a time per row, a cache line, instead of walking each column down all the rows. Each output
    // still gets its additions from one thread, in the same order.
    constexpr int64_t kColumns = 16;
    const bool blocked = k_.scatter_stride > 1 && l0.extent >= 2 * kColumns;
    if (parallel) out += "  #pragma omp parallel for\n";
    if (blocked) {
      out += fmt::format("  for (int64_t {0}b = 0; {0}b < {1}LL; ++{0}b) {{\n", l0.var,
                         (l0.extent + kColumns - 1) / kColumns);
      out += fmt::format("  for (int64_t {0} = 0; {0} < {1}LL; ++{0})\n", l1.var, l1.extent);
      out += fmt::format("  for (int64_t {0} = {0}b * {1}LL; {0} < {0}b * {1}LL + {1}LL && {0} < {2}LL; ++{0}) {{\n",
                         l0.var, kColumns, l0.extent);
    } else {
      out += fmt::format("  for (int64_t {0} = 0; {0} < {1}LL; ++{0}) {{\n", l0.var, l0.extent);
      out += fmt::format("  for (int64_t {0} = 0; {0} < {1}LL; ++{0}) {{\n", l1.var, l1.extent);
    }
    emit_values(out, "    ");
    out += fmt::format("    const int64_t at = {} + {}LL * kiln_check_index((int64_t){}, {}LL, err);\n", idx(k_.store_index),
                       k_.scatter_stride, v(k_.scatter_index), k_.scatter_extent);
    out += fmt::format("    {0}[at] = {1};\n", buf(0),
                       store_value(out_t, fmt::format("{} + {}", load_value(out_t, buf(0) + "[at]"), result)));
    out += "  }}\n";
  }
  out += "}\n";
  return out;
}

}  // namespace

int64_t stream_threshold_bytes() {
  const int64_t flag = flags().stream_bytes;
  if (flag >= 0) return flag;
  static const int64_t llc = [] {
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE), l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return static_cast<int64_t>(l3 > 0 ? l3 : l2 > 0 ? 8 * l2 : 32L << 20);
  }();
  return llc;
}

bool runtime_extent(const Kernel& k) {
  if (k.loops.size() != 1 || k.tiles.buffer >= 0) return false;
  if (k.kind == KernelKind::Elementwise) return true;
  // A whole float sum (render_blocked_sum); other reductions keep their constant trip counts.
  return k.kind == KernelKind::Reduce && !k.column && k.reduce_op == Op::ReduceSum &&
         is_floating(k.buffers[0].dtype) && k.loops[0].role != Loop::Role::Parallel;
}

// What instantiating an attention template costs the host compiler, in characters of ordinary
// kernel text that take it as long (measured with GCC 12 at -O2: ~0.16 s, as ~24 KB of
// elementwise and reduction kernels). Only used to balance translation units.
constexpr size_t kAttentionCost = 24000;

CppSource render_cpp(const std::vector<Kernel>& kernels, bool share) {
  CppSource cpp;
  cpp.prelude = std::string(kCpuPrelude) + kMathPrelude + kRandomPrelude +
                fmt::format("#define KILN_STREAM_BYTES {}LL\n", stream_threshold_bytes());
  // Only a plan with attention pays for compiling its templates.
  if (std::any_of(kernels.begin(), kernels.end(), [](const Kernel& k) { return k.kind == KernelKind::Attention; }))
    cpp.prelude += kAttentionPrelude;
  const FunctionSharing sharing = share_functions(
      kernels, [](const Kernel& canonical) { return CppKernelRenderer(canonical).render(); }, share, &cpp.bindings);
  cpp.function_of = sharing.function_of;
  for (const Kernel& k : kernels)
    cpp.extents.push_back(!is_library(k.kind) && runtime_extent(k) ? k.loops[0].extent : -1);
  // Each function is named after the first kernel it runs; its comment lists every kernel.
  std::vector<std::string> users(sharing.texts.size());
  for (size_t k = 0; k < kernels.size(); ++k)
    if (sharing.function_of[k] >= 0) users[sharing.function_of[k]] += " " + kernels[k].name;
  for (size_t f = 0; f < sharing.texts.size(); ++f) {
    const Kernel& first = kernels[sharing.first_kernel[f]];
    cpp.names.push_back(first.name);
    cpp.functions.push_back(fmt::format("{}{} (kernels:{})\n{}", kNotePrefix, first.summary, users[f],
                                        rename_function(sharing.texts[f], first.name)));
    cpp.costs.push_back(sharing.texts[f].size() + (first.kind == KernelKind::Attention ? kAttentionCost : 0));
  }
  return cpp;
}

std::vector<std::string> CppSource::translation_units(int count) const {
  const size_t units = std::max<size_t>(1, std::min<size_t>(static_cast<size_t>(std::max(count, 1)), functions.size()));
  // Longest first, each to the unit with the least work so far: the compilers finish together.
  std::vector<size_t> order(functions.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return costs[a] > costs[b]; });
  std::vector<size_t> load(units, 0), unit_of(functions.size(), 0);
  for (size_t f : order) {
    const size_t u = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    unit_of[f] = u;
    load[u] += costs[f];
  }
  std::vector<std::string> sources(units, prelude);
  for (size_t f = 0; f < functions.size(); ++f) sources[unit_of[f]] += "\n" + functions[f];
  return sources;
}

}  // namespace kiln::cpu
