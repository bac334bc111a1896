#include "backends/cuda/render_cuda.h"

#include <fmt/format.h>

#include <algorithm>
#include <unordered_map>

#include "core/error.h"
#include "core/flags.h"
#include "backends/cuda/attention_cuda.h"
#include "backends/cuda/cuda_prelude.h"
#include "jit/canonical_kernel.h"
#include "jit/math_prelude.h"
#include "jit/random_prelude.h"
#include "jit/render_common.h"

namespace kiln::cuda {
using namespace kiln::jit;  // the kernel IR and the render tables this renderer fills in

namespace {

constexpr int kThreads = 256;              // threads per block (row reductions may use fewer)
constexpr int kColumnWarps = kThreads / 32;  // column reduce: warps sharing one tile's rows
constexpr int64_t kMaxBlocks = 1 << 16;    // grid-stride loops cover the rest
constexpr int64_t kThreadPerOutput = 32;   // row reductions this short fold in one thread
constexpr int64_t kVectorMinimum = 2048;   // smaller elementwise kernels are latency-bound: no vector path
constexpr int64_t kSplitBlocks = 1024;     // split row reductions aim at this many blocks in all
constexpr int64_t kSplitMinimum = 2048;    // and give each part at least this many elements
constexpr int64_t kMaxParts = 1024;        // the fold of the parts is one block per output

// Parts each output's row is split into when there are too few outputs to fill the GPU with a
// block each (1: no split; a split costs a second launch, so it takes 4 parts or more).
int64_t split_parts(int64_t outputs, int64_t extent) {
  if (outputs == 0) return 1;
  const int64_t parts = std::min({(kSplitBlocks + outputs - 1) / outputs, extent / kSplitMinimum, kMaxParts});
  return parts >= 4 ? parts : 1;
}

// CUDA's math library (IEEE sqrt and division, no fast-math approximations).
constexpr OpPatterns kCudaPatterns = with_math(kSharedPatterns, {
    {Op::Exp, "expf({0})", "exp({0})"},
    {Op::Log, "logf({0})", "log({0})"},
    {Op::Sqrt, "sqrtf({0})", "sqrt({0})"},
    {Op::Rsqrt, "(1.0f / sqrtf({0}))", "(1.0 / sqrt({0}))"},
    {Op::Sin, "sinf({0})", "sin({0})"},
    {Op::Cos, "cosf({0})", "cos({0})"},
    {Op::Tanh, "tanhf({0})", "tanh({0})"},
    {Op::Erf, "erff({0})", "erf({0})"},
    {Op::Floor, "floorf({0})", "floor({0})"},
    {Op::Pow, "powf({0}, {1})", "pow({0}, {1})"},
});
static_assert(covers_every_op(kCudaPatterns), "every primitive in core/op.h needs a CUDA renderer entry, in enum order");

// Threads of a block that folds or maps one row: the row's length rounded up to whole warps, so
// short rows leave no thread idle. Loops over the row step by this constant, not blockDim.x, so
// the compiler knows their trip counts and unrolls them (several loads in flight per thread).
int row_threads(int64_t row) { return static_cast<int>(std::clamp<int64_t>((row + 31) / 32 * 32, 32, kThreads)); }

int64_t blocks_for(int64_t work, int64_t per_block) {
  return std::clamp<int64_t>((work + per_block - 1) / per_block, 1, kMaxBlocks);
}

// sc, isc, err and scratch (see render_cuda.h), after the buffers of every function.
const std::vector<std::string> kTrailingTypes = {"const double*", "const int64_t*", "int64_t*", "void*"};
constexpr const char* kTrailingParameters = "const double* sc, const int64_t* isc, int64_t* err, void* plan_scratch";

const char* kGridStride = "(int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < {0}LL; t += (int64_t)gridDim.x * blockDim.x";

// The parameter types every function of kernel `k` takes, in order ("float*", "const kiln_half*",
// ..., "const double*", "const int64_t*", "int64_t*", "void*").
std::vector<std::string> cuda_parameter_types(const Kernel& k) {
  std::vector<std::string> types;
  for (size_t b = 0; b < k.buffers.size(); ++b)
    types.push_back(fmt::format("{}{}*", b == 0 || k.buffers[b].written ? "" : "const ", storage_type(k.buffers[b].dtype)));
  types.insert(types.end(), kTrailingTypes.begin(), kTrailingTypes.end());
  return types;
}

class CudaKernelRenderer {
 public:
  explicit CudaKernelRenderer(const Kernel& k) : k_(k) {}
  // Appends the kernel's functions to `out` and returns their launches.
  std::vector<CudaLaunch> render(std::string& out);
  // Bytes of the plan's scratch buffer the kernel's functions use (a split reduction's parts).
  int64_t scratch_bytes() const;

 private:
  std::string signature(const std::string& function) const;
  void elementwise(std::string& out, std::vector<CudaLaunch>& launches) const;
  void row_reduce(std::string& out, std::vector<CudaLaunch>& launches) const;
  void split_row_reduce(std::string& out, std::vector<CudaLaunch>& launches, int64_t parts) const;
  void column_reduce(std::string& out, std::vector<CudaLaunch>& launches) const;
  int64_t column_parts() const;
  // A row reduction's shape: the parallel loop `o` over outputs (if any; loops from `first` are
  // reduced), the output count, and the elements folded into each.
  struct Rows {
    bool has_outer;
    size_t first;
    int64_t outer, extent;
  };
  Rows rows() const;
  void scatter(std::string& out, std::vector<CudaLaunch>& launches) const;
  void attention(std::string& out, std::vector<CudaLaunch>& launches) const;

 public:
  // One row-group phase (render_row_group): this kernel's work for row `t` by the whole block.
  void row_phase(std::string& out, int index, int threads) const;

 private:
  // `const int64_t <var> = ...;` for the reduce loops [first, last) from their flat index `rf`.
  std::string unflatten_reduce(size_t first, size_t last, const std::string& indent) const;
  int64_t reduce_extent(size_t first, size_t last) const;
  std::string combine(const std::string& acc, const std::string& value) const;

  const Kernel& k_;
  ValueRenderer values_{k_, kCudaPatterns};
};

std::string CudaKernelRenderer::signature(const std::string& function) const {
  std::string s = fmt::format("extern \"C\" __global__ void __launch_bounds__({}) {}(", kThreads, function);
  const std::vector<std::string> types = cuda_parameter_types(k_);
  for (size_t b = 0; b < k_.buffers.size(); ++b) s += fmt::format("{} {}, ", types[b], values_.buf(static_cast<int>(b)));
  s += fmt::format("{}) {{\n", kTrailingParameters);
  for (const Expr& e : k_.exprs)
    if (e.kind == Expr::Kind::Scalar)
      s += fmt::format("  {}\n", scalar_declaration(e.dtype, e.slot));
  return s;
}

std::string CudaKernelRenderer::combine(const std::string& acc, const std::string& value) const {
  return k_.reduce_op == Op::ReduceSum ? fmt::format("{0} += {1};", acc, value)
                                       : fmt::format("{0} = KILN_MAX({1}, {0});", acc, value);
}

int64_t CudaKernelRenderer::reduce_extent(size_t first, size_t last) const {
  int64_t n = 1;
  for (size_t l = first; l < last; ++l) n *= k_.loops[l].extent;
  return n;
}

std::string CudaKernelRenderer::unflatten_reduce(size_t first, size_t last, const std::string& indent) const {
  std::string s;
  for (size_t l = first; l < last; ++l) {
    const int64_t below = reduce_extent(l + 1, last);
    std::string value = below == 1 ? "rf" : fmt::format("rf / {}LL", below);
    if (l != first) value = fmt::format("({}) % {}LL", value, k_.loops[l].extent);
    s += fmt::format("{}const int64_t {} = {};\n", indent, k_.loops[l].var, value);
  }
  return s;
}

// Which loads of an elementwise kernel read V consecutive elements for V consecutive outputs
// (and so may be one vector load), and V: 16 bytes of the widest such element.
struct VectorPlan {
  int width = 0;           // 0: no vector path
  std::vector<bool> load;  // per expr
};

// An index moves with the last loop by 1. With two loops (o, i), V outputs in a row (i % V == 0
// to i + V - 1) read V neighbours when the row extent and o's coefficient are multiples of V, or
// the row continues into the next (coefficient == row extent: the flat index plus a constant).
VectorPlan vector_plan(const Kernel& k) {
  VectorPlan plan;
  const Loop& last = k.loops.back();
  auto along_last = [&](const IndexExpr& e) { return k.ctx.is_affine(e) && k.ctx.coefficient(e, last.var) == 1; };
  auto candidate = [&](const Expr& e) { return e.kind == Expr::Kind::Load && e.guards.empty() && along_last(e.index); };
  size_t widest = dtype_size(k.buffers[0].dtype);
  for (const Expr& e : k.exprs)
    if (candidate(e)) widest = std::max(widest, dtype_size(k.buffers[e.buffer].dtype));
  const int v = static_cast<int>(16 / widest);
  auto contiguous = [&](const IndexExpr& e) {
    if (!along_last(e)) return false;
    if (k.loops.size() == 1) return true;
    const int64_t c0 = k.ctx.coefficient(e, k.loops[0].var);
    return c0 == last.extent || (last.extent % v == 0 && c0 % v == 0);
  };
  // (Side outputs take the scalar path: they are rare, an update and a copy of its result.)
  if (v < 2 || k.out_numel < kVectorMinimum || !contiguous(k.store_index) || !k.side_stores.empty()) return plan;
  plan.width = v;
  for (const Expr& e : k.exprs) plan.load.push_back(candidate(e) && contiguous(e.index));
  return plan;
}

// Elementwise kernels take one of two paths, chosen at run time for the whole grid:
// - vector: when every pointer a vector touches is aligned to its vector's size, a thread takes
//   V consecutive outputs, reads each contiguous operand with one 16-byte (or narrower) load and
//   writes with one store, two such groups a grid-stride apart per trip; the remainder of n / V
//   is done element by element;
// - scalar: a thread takes kUnroll elements a grid-stride apart per trip.
// Either way a thread issues all its loads before any store, so it keeps several loads in flight
// (one at a time leaves too few bytes in flight to cover DRAM latency on a big GPU, and the
// compiler cannot hoist a later element's loads above an earlier store through pointers that may
// alias). A second loop level is unflattened from the flat index.
void CudaKernelRenderer::elementwise(std::string& out, std::vector<CudaLaunch>& launches) const {
  constexpr int kUnroll = 4, kVectors = 2;
  const int64_t n = k_.out_numel;
  auto vars_at = [&](const std::string& flat) {
    if (k_.loops.size() == 1) return fmt::format("const int64_t {} = {};", k_.loops[0].var, flat);
    return fmt::format("const int64_t {0} = {2} / {3}LL, {1} = {2} % {3}LL;", k_.loops[0].var, k_.loops[1].var, flat,
                       k_.loops[1].extent);
  };
  const std::string out_t = storage_type(k_.buffers[0].dtype);
  const std::string store = store_value(k_.buffers[0].dtype, values_.v(k_.value));
  out += signature(k_.name);
  out += "  const int64_t stride = (int64_t)gridDim.x * blockDim.x;\n";
  out += "  const int64_t thread = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;\n";
  // Elements a thread takes per trip, which sizes the grid: V * kVectors on the vector path (the
  // scalar fallback then loops more often), kUnroll otherwise.
  int64_t per_thread = kUnroll;
  if (const VectorPlan plan = vector_plan(k_); plan.width > 0) {
    const int v = plan.width;
    per_thread = int64_t{v} * kVectors;
    const int64_t vectored = n / v * v;
    std::string aligned = fmt::format("(uint64_t)({}) % {}", values_.buf(0), v * dtype_size(k_.buffers[0].dtype));
    std::string declare, address, elements;
    std::vector<std::string> lanes(k_.exprs.size());
    for (size_t i = 0; i < k_.exprs.size(); ++i) {
      if (!plan.load[i]) continue;
      const Expr& e = k_.exprs[i];
      const DType t = k_.buffers[e.buffer].dtype;
      aligned += fmt::format(" | (uint64_t)({} + {}) % {}", values_.buf(e.buffer), k_.ctx.offset(e.index), v * dtype_size(t));
      declare += fmt::format("        kiln_vec<{}, {}> l{};\n", storage_type(t), v, i);
      address += fmt::format("          l{} = kiln_vload<{}>({} + ({}));\n", i, v, values_.buf(e.buffer), values_.idx(e.index));
      lanes[i] = fmt::format("l{}.v[u]", i);
    }
    out += fmt::format("  if (({}) == 0) {{\n", aligned);
    out += fmt::format("    for (int64_t first0 = thread * {0}; first0 < {1}LL; first0 += {2} * {0} * stride) {{\n", v, vectored, kVectors);
    out += fmt::format("      kiln_vec<{}, {}> result[{}];\n      {}* dst[{}];\n", out_t, v, kVectors, out_t, kVectors);
    out += fmt::format("#pragma unroll\n      for (int w = 0; w < {}; ++w) {{\n", kVectors);
    out += fmt::format("        const int64_t first = first0 + w * {} * stride;\n        if (first >= {}LL) break;\n", v, vectored);
    out += declare + "        {\n          " + vars_at("first") + "\n" + address;
    out += fmt::format("          dst[w] = {} + ({});\n        }}\n", values_.buf(0), values_.idx(k_.store_index));
    out += fmt::format("#pragma unroll\n        for (int u = 0; u < {}; ++u) {{\n", v);
    out += "          const int64_t t = first + u;\n          " + vars_at("t") + "\n";
    values_.emit_values(out, "          ", lanes);
    out += fmt::format("          result[w].v[u] = {};\n        }}\n      }}\n", store);
    out += fmt::format("#pragma unroll\n      for (int w = 0; w < {}; ++w) {{\n", kVectors);
    out += fmt::format("        if (first0 + w * {} * stride >= {}LL) break;\n", v, vectored);
    out += fmt::format("        kiln_vstore<{}>(dst[w], result[w]);\n      }}\n    }}\n", v);
    out += fmt::format("    for (int64_t t = {}LL + thread; t < {}LL; t += stride) {{\n      {}\n", vectored, n, vars_at("t"));
    values_.emit_values(out, "      ");
    out += fmt::format("      {}[{}] = {};\n    }}\n    return;\n  }}\n", values_.buf(0), values_.idx(k_.store_index), store);
  }
  const std::string element = fmt::format("      const int64_t t = first + u * stride;\n      if (t >= {}LL) break;\n      {}\n",
                                          n, vars_at("t"));
  out += fmt::format("  for (int64_t first = thread; first < {}LL; first += {} * stride) {{\n", n, kUnroll);
  out += fmt::format("    {} result[{}];\n", out_t, kUnroll);
  for (size_t j = 0; j < k_.side_stores.size(); ++j)
    out += fmt::format("    {} side{}[{}];\n", storage_type(k_.buffers[k_.side_stores[j].buffer].dtype), j, kUnroll);
  out += fmt::format("#pragma unroll\n    for (int u = 0; u < {}; ++u) {{\n", kUnroll) + element;
  values_.emit_values(out, "      ");
  out += fmt::format("      result[u] = {};\n", store);
  for (size_t j = 0; j < k_.side_stores.size(); ++j) {
    const SideStore& side = k_.side_stores[j];
    out += fmt::format("      side{}[u] = {};\n", j, store_value(k_.buffers[side.buffer].dtype, values_.v(side.value)));
  }
  out += "    }\n";
  out += fmt::format("#pragma unroll\n    for (int u = 0; u < {}; ++u) {{\n", kUnroll) + element;
  out += fmt::format("      {}[{}] = result[u];\n", values_.buf(0), values_.idx(k_.store_index));
  for (size_t j = 0; j < k_.side_stores.size(); ++j)
    out += fmt::format("      {}[{}] = side{}[u];\n", values_.buf(k_.side_stores[j].buffer), values_.idx(k_.store_index), j);
  out += "    }\n  }\n}\n";
  launches.push_back({k_.name, blocks_for(n, kThreads * per_thread), kThreads});
}

// Rows: the parallel loop `o` (if any) over outputs, then the reduce loops. A block folds one
// output at a time (grid-stride over outputs); short rows fold in one thread each instead.
void CudaKernelRenderer::row_reduce(std::string& out, std::vector<CudaLaunch>& launches) const {
  const DType out_t = k_.buffers[0].dtype;
  const char* acc_t = compute_type(out_t);
  const bool is_sum = k_.reduce_op == Op::ReduceSum;
  const std::string init = reduce_init(out_t, is_sum, "KILN_INF");
  const auto [has_outer, first, outer, extent] = rows();
  if (const int64_t parts = split_parts(outer, extent); parts > 1) return split_row_reduce(out, launches, parts);
  const std::string store = fmt::format("{}[{}] = {};", values_.buf(0), values_.idx(k_.store_index), store_value(out_t, "acc"));
  out += signature(k_.name);
  if (has_outer && extent <= kThreadPerOutput) {
    out += fmt::format("  for (int64_t t = {}) {{\n", fmt::format(fmt::runtime(kGridStride), outer));
    out += fmt::format("    const int64_t {} = t;\n    {} acc = {};\n", k_.loops[0].var, acc_t, init);
    out += fmt::format("    for (int64_t rf = 0; rf < {}LL; ++rf) {{\n", extent);
    out += unflatten_reduce(first, k_.loops.size(), "      ");
    values_.emit_values(out, "      ");
    out += fmt::format("      {}\n    }}\n    {}\n  }}\n}}\n", combine("acc", values_.v(k_.value)), store);
    launches.push_back({k_.name, blocks_for(outer, kThreads), kThreads});
    return;
  }
  const int threads = row_threads(extent);
  out += fmt::format("  __shared__ {} scratch[32];\n", acc_t);
  out += fmt::format("  for (int64_t t = blockIdx.x; t < {}LL; t += gridDim.x) {{\n", outer);
  if (has_outer) out += fmt::format("    const int64_t {} = t;\n", k_.loops[0].var);
  out += fmt::format("    {} acc = {};\n", acc_t, init);
  out += fmt::format("#pragma unroll 4\n    for (int64_t rf = threadIdx.x; rf < {}LL; rf += {}) {{\n", extent, threads);
  out += unflatten_reduce(first, k_.loops.size(), "      ");
  values_.emit_values(out, "      ");
  out += fmt::format("      {}\n    }}\n", combine("acc", values_.v(k_.value)));
  out += fmt::format("    acc = kiln_block_fold<{}>(acc, scratch);\n", is_sum ? "true" : "false");
  out += fmt::format("    if (threadIdx.x == 0) {}\n  }}\n}}\n", store);
  launches.push_back({k_.name, std::clamp<int64_t>(outer, 1, kMaxBlocks), threads});
}

// Few outputs with long rows (a full reduction, a sum over a huge axis): each row is split into
// `parts` consecutive parts, a block folds one part into the scratch buffer (acc type), then a
// second function folds each output's parts in order and stores it. The order of the sums is
// fixed, so results do not change from run to run.
void CudaKernelRenderer::split_row_reduce(std::string& out, std::vector<CudaLaunch>& launches, int64_t parts) const {
  const DType out_t = k_.buffers[0].dtype;
  const char* acc_t = compute_type(out_t);
  const bool is_sum = k_.reduce_op == Op::ReduceSum;
  const std::string init = reduce_init(out_t, is_sum, "KILN_INF");
  const auto [has_outer, first, outer, extent] = rows();
  const int64_t chunk = (extent + parts - 1) / parts;
  out += signature(k_.name);
  out += fmt::format("  __shared__ {} fold[32];\n  {}* partial = ({}*)plan_scratch;\n", acc_t, acc_t, acc_t);
  out += fmt::format("  for (int64_t task = blockIdx.x; task < {}LL; task += gridDim.x) {{\n", outer * parts);
  if (has_outer) out += fmt::format("    const int64_t {} = task / {}LL;\n", k_.loops[0].var, parts);
  out += fmt::format("    const int64_t begin = (task % {0}LL) * {1}LL, end = begin + {1}LL < {2}LL ? begin + {1}LL : {2}LL;\n",
                     parts, chunk, extent);
  out += fmt::format("    {} acc = {};\n", acc_t, init);
  out += fmt::format("#pragma unroll 4\n    for (int64_t rf = begin + threadIdx.x; rf < end; rf += {}) {{\n", kThreads);
  out += unflatten_reduce(first, k_.loops.size(), "      ");
  values_.emit_values(out, "      ");
  out += fmt::format("      {}\n    }}\n", combine("acc", values_.v(k_.value)));
  out += fmt::format("    acc = kiln_block_fold<{}>(acc, fold);\n", is_sum ? "true" : "false");
  out += "    if (threadIdx.x == 0) partial[task] = acc;\n  }\n}\n";
  launches.push_back({k_.name, std::min(outer * parts, kMaxBlocks), kThreads});

  const std::string fold_name = k_.name + "_parts";
  out += signature(fold_name);
  out += fmt::format("  __shared__ {} fold[32];\n  const {}* partial = (const {}*)plan_scratch;\n", acc_t, acc_t, acc_t);
  out += fmt::format("  for (int64_t t = blockIdx.x; t < {}LL; t += gridDim.x) {{\n", outer);
  if (has_outer) out += fmt::format("    const int64_t {} = t;\n", k_.loops[0].var);
  out += fmt::format("    {} acc = {};\n", acc_t, init);
  out += fmt::format("    for (int64_t j = threadIdx.x; j < {0}LL; j += blockDim.x) {{ {1} }}\n", parts,
                     combine("acc", fmt::format("partial[t * {}LL + j]", parts)));
  out += fmt::format("    acc = kiln_block_fold<{}>(acc, fold);\n", is_sum ? "true" : "false");
  out += fmt::format("    if (threadIdx.x == 0) {}[{}] = {};\n  }}\n}}\n", values_.buf(0), values_.idx(k_.store_index),
                     store_value(out_t, "acc"));
  const int threads = static_cast<int>(std::clamp<int64_t>((parts + 31) / 32 * 32, 32, kThreads));
  launches.push_back({fold_name, std::min(outer, kMaxBlocks), threads});
}

CudaKernelRenderer::Rows CudaKernelRenderer::rows() const {
  const bool has_outer = !k_.loops.empty() && k_.loops[0].role == Loop::Role::Parallel;
  const size_t first = has_outer ? 1 : 0;
  return {has_outer, first, has_outer ? k_.loops[0].extent : 1, reduce_extent(first, k_.loops.size())};
}

int64_t CudaKernelRenderer::scratch_bytes() const {
  if (k_.kind == KernelKind::Attention) {  // the backward's delta per query row
    const AttentionCall& a = k_.attention;
    return a.backward ? a.B * a.H * a.Tq * static_cast<int64_t>(dtype_size(k_.buffers[0].dtype)) : 0;
  }
  if (k_.kind != KernelKind::Reduce) return 0;
  const DType t = k_.buffers[0].dtype;
  const auto acc = static_cast<int64_t>(t == DType::Float16 || t == DType::BFloat16 ? sizeof(float) : dtype_size(t));
  if (k_.column) {
    const int64_t parts = column_parts();
    const int64_t tiles = k_.loops.front().extent * ((k_.loops.back().extent + 31) / 32);
    return parts == 1 ? 0 : tiles * parts * 32 * acc;
  }
  const Rows r = rows();
  const int64_t parts = split_parts(r.outer, r.extent);
  return parts == 1 ? 0 : r.outer * parts * acc;
}

// Columns: loops `o` (parallel), the reduce loops, then `i` (the contiguous last axis). A block
// takes a tile of 32 neighbouring `i` of one `o` (one per lane, so loads coalesce); its 8 warps
// each fold every 8th reduced row, and warp 0 adds up the 8 partial results.
void CudaKernelRenderer::column_reduce(std::string& out, std::vector<CudaLaunch>& launches) const {
  const DType out_t = k_.buffers[0].dtype;
  const char* acc_t = compute_type(out_t);
  const std::string init = reduce_init(out_t, k_.reduce_op == Op::ReduceSum, "KILN_INF");
  const Loop& outer = k_.loops.front();
  const Loop& inner = k_.loops.back();
  const int64_t tiles_per_row = (inner.extent + 31) / 32, tiles = outer.extent * tiles_per_row;
  const int64_t extent = reduce_extent(1, k_.loops.size() - 1);
  const int64_t parts = column_parts(), chunk = (extent + parts - 1) / parts;
  const std::string tile_vars = fmt::format("const int64_t {0} = t / {2}LL, {1} = (t % {2}LL) * 32 + lane;", outer.var,
                                            inner.var, tiles_per_row);
  const std::string store = fmt::format("{}[{}] = {};", values_.buf(0), values_.idx(k_.store_index), store_value(out_t, "acc"));
  out += signature(k_.name);
  out += fmt::format("  __shared__ {} scratch[{}][33];\n", acc_t, kColumnWarps);
  if (parts > 1) out += fmt::format("  {}* partial = ({}*)plan_scratch;\n", acc_t, acc_t);
  out += "  const int lane = threadIdx.x & 31, row = threadIdx.x >> 5;\n";
  out += fmt::format("  for (int64_t task = blockIdx.x; task < {}LL; task += gridDim.x) {{\n", tiles * parts);
  out += fmt::format("    const int64_t t = task / {0}LL, begin = (task % {0}LL) * {1}LL;\n", parts, chunk);
  out += fmt::format("    const int64_t end = begin + {0}LL < {1}LL ? begin + {0}LL : {1}LL;\n", chunk, extent);
  out += "    " + tile_vars + "\n";
  out += fmt::format("    {} acc = {};\n", acc_t, init);
  out += fmt::format("    if ({} < {}LL) {{\n", inner.var, inner.extent);
  out += fmt::format("      for (int64_t rf = begin + row; rf < end; rf += {}) {{\n", kColumnWarps);
  out += unflatten_reduce(1, k_.loops.size() - 1, "        ");
  values_.emit_values(out, "        ");
  out += fmt::format("        {}\n      }}\n    }}\n", combine("acc", values_.v(k_.value)));
  out += "    scratch[row][lane] = acc;\n    __syncthreads();\n";
  out += fmt::format("    if (row == 0 && {} < {}LL) {{\n", inner.var, inner.extent);
  out += fmt::format("      for (int w = 1; w < {}; ++w) {}\n", kColumnWarps, combine("acc", "scratch[w][lane]"));
  out += parts > 1 ? "      partial[task * 32 + lane] = acc;\n    }\n" : "      " + store + "\n    }\n";
  out += "    __syncthreads();\n  }\n}\n";
  launches.push_back({k_.name, std::clamp<int64_t>(tiles * parts, 1, kMaxBlocks), kThreads});
  if (parts == 1) return;

  // The parts of each output in order: a thread per output, neighbouring lanes reading
  // neighbouring partial sums.
  const std::string fold_name = k_.name + "_parts";
  out += signature(fold_name);
  out += fmt::format("  const {}* partial = (const {}*)plan_scratch;\n", acc_t, acc_t);
  out += fmt::format("  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < {}LL; "
                     "q += (int64_t)gridDim.x * blockDim.x) {{\n", tiles * 32);
  out += "    const int64_t t = q / 32;\n    const int lane = (int)(q % 32);\n    " + tile_vars + "\n";
  out += fmt::format("    if ({} >= {}LL) continue;\n", inner.var, inner.extent);
  out += fmt::format("    {} acc = {};\n", acc_t, init);
  out += fmt::format("    for (int64_t p = 0; p < {}LL; ++p) {}\n", parts,
                     combine("acc", fmt::format("partial[(t * {}LL + p) * 32 + lane]", parts)));
  out += "    " + store + "\n  }\n}\n";
  launches.push_back({fold_name, blocks_for(tiles * 32, kThreads), kThreads});
}

// Parts the reduced rows of a column reduction are split into: few tiles of 32 columns over many
// rows leave most of the GPU idle with a block per tile.
int64_t CudaKernelRenderer::column_parts() const {
  const int64_t tiles = k_.loops.front().extent * ((k_.loops.back().extent + 31) / 32);
  const int64_t rows = reduce_extent(1, k_.loops.size() - 1);
  return split_parts(tiles, rows * std::min<int64_t>(k_.loops.back().extent, 32));
}

// Two functions: <name>_zero clears the output, then <name> adds every value at its index: with
// atomics (the order of the additions is the hardware's), or in a fixed order under KILN_DETERMINISTIC.
void CudaKernelRenderer::scatter(std::string& out, std::vector<CudaLaunch>& launches) const {
  const DType out_t = k_.buffers[0].dtype;
  const std::string zero = k_.name + "_zero";
  out += signature(zero);
  out += fmt::format("  for (int64_t t = {}) {}[t] = {};\n}}\n", fmt::format(fmt::runtime(kGridStride), k_.out_numel),
                     values_.buf(0), store_value(out_t, "0"));
  launches.push_back({zero, blocks_for(k_.out_numel, kThreads), kThreads});

  const Loop& l0 = k_.loops[0];
  const Loop& l1 = k_.loops[1];
  const std::string at = fmt::format("    const int64_t at = {} + {}LL * kiln_check_index((int64_t){}, {}LL, err);\n",
                                     values_.idx(k_.store_index), k_.scatter_stride, values_.v(k_.scatter_index),
                                     k_.scatter_extent);
  out += "\n" + signature(k_.name);
  if (flags().deterministic) {
    // KILN_DETERMINISTIC: no atomics. The outputs of one position of loop 0 get all their
    // additions from one thread, in the order of loop 1: the CPU kernel's order, so the same bits.
    out += fmt::format("  for (int64_t {0} = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; {0} < {1}LL; "
                       "{0} += (int64_t)gridDim.x * blockDim.x)\n", l0.var, l0.extent);
    out += fmt::format("  for (int64_t {0} = 0; {0} < {1}LL; ++{0}) {{\n", l1.var, l1.extent);
    values_.emit_values(out, "    ");
    out += at;
    out += fmt::format("    {0}[at] = {1};\n  }}\n}}\n", values_.buf(0),
                       store_value(out_t, fmt::format("{} + {}", load_value(out_t, values_.buf(0) + "[at]"),
                                                      values_.v(k_.value))));
    launches.push_back({k_.name, blocks_for(l0.extent, kThreads), kThreads});
    return;
  }
  const int64_t work = l0.extent * l1.extent;
  out += fmt::format("  for (int64_t t = {}) {{\n", fmt::format(fmt::runtime(kGridStride), work));
  out += fmt::format("    const int64_t {0} = t / {2}LL, {1} = t % {2}LL;\n", l0.var, l1.var, l1.extent);
  values_.emit_values(out, "    ");
  out += at;
  out += fmt::format("    kiln_atomic_add(&{}[at], ({})({}));\n  }}\n}}\n", values_.buf(0), compute_type(out_t),
                     values_.v(k_.value));
  launches.push_back({k_.name, blocks_for(work, kThreads), kThreads});
}

// Calls of backends/cuda/attention_cuda.h's templates with every size and stride constant: the
// forward in one function, the backward in two (query rows, then key rows).
void CudaKernelRenderer::attention(std::string& out, std::vector<CudaLaunch>& launches) const {
  const AttentionCall& a = k_.attention;
  const char* t = compute_type(k_.buffers[0].dtype);
  auto view = [&](const AttentionOperand& op) {
    const KernelBuffer& buffer = k_.buffers[static_cast<size_t>(op.buffer)];
    // Inputs are const pointers; bfloat16 ones (q, k, v under autocast) keep their storage type.
    const char* element = buffer.dtype == DType::BFloat16 ? storage_type(buffer.dtype) : t;
    return fmt::format("KilnAttnView<{}{}, {}LL, {}LL, {}LL, {}LL>{{{} + {}LL}}", buffer.written ? "" : "const ",
                       element, op.strides[0], op.strides[1], op.strides[2], op.strides[3], values_.buf(op.buffer),
                       op.offset);
  };
  const std::string sizes = fmt::format("{}, {}LL, {}LL, {}LL, {}LL, {}LL, {}LL, {}", t, a.B, a.H, a.Tq, a.Tk, a.D,
                                        a.Dv, a.causal ? "true" : "false");
  const std::string qkv = view(a.q) + ", " + view(a.k) + ", " + view(a.v);
  auto function = [&](const std::string& name, const std::string& call, int64_t rows) {
    out += "\n" + signature(name) + "  " + call + "\n}\n";
    launches.push_back({name, blocks_for(rows, kThreads), kThreads});
  };
  if (!a.backward) {
    function(k_.name, fmt::format("kiln_attention_forward<{}>({}, {}, {}, ({}){:.17g});", sizes, qkv, view(a.o),
                                  view(a.lse), t, a.scale),
             a.B * a.H * a.Tq);
    return;
  }
  function(k_.name + "_q",
           fmt::format("kiln_attention_backward_q<{}>({}, {}, {}, {}, {}, ({}*)plan_scratch, ({}){:.17g});", sizes, qkv,
                       view(a.o), view(a.lse), view(a.dout), view(a.dq), t, t, a.scale),
           a.B * a.H * a.Tq);
  function(k_.name + "_kv",
           fmt::format("kiln_attention_backward_kv<{}>({}, {}, {}, {}, {}, (const {}*)plan_scratch, ({}){:.17g});",
                       sizes, qkv, view(a.lse), view(a.dout), view(a.dk), view(a.dv), t, t, a.scale),
           a.B * a.H * a.Tk);
}

// A reduce kernel's row `t`: the block folds it and thread 0 stores the result, which the
// barrier after the phase makes visible to the rest of the block. An elementwise kernel's row:
// the block's threads take its elements in turn.
void CudaKernelRenderer::row_phase(std::string& out, int index, int threads) const {
  const DType out_t = k_.buffers[0].dtype;
  out += fmt::format("    {{  // {}\n      const int64_t {} = t;\n", k_.summary, k_.loops[0].var);
  if (k_.kind == KernelKind::Reduce) {
    const bool is_sum = k_.reduce_op == Op::ReduceSum;
    out += fmt::format("      {} acc = {};\n", compute_type(out_t), reduce_init(out_t, is_sum, "KILN_INF"));
    out += fmt::format("#pragma unroll 4\n      for (int64_t rf = threadIdx.x; rf < {}LL; rf += {}) {{\n",
                       reduce_extent(1, k_.loops.size()), threads);
    out += unflatten_reduce(1, k_.loops.size(), "        ");
    values_.emit_values(out, "        ");
    out += fmt::format("        {}\n      }}\n", combine("acc", values_.v(k_.value)));
    out += fmt::format("      acc = kiln_block_fold<{}>(acc, scratch{});\n", is_sum ? "true" : "false", index);
    out += fmt::format("      if (threadIdx.x == 0) {}[{}] = {};\n    }}\n    __syncthreads();\n", values_.buf(0),
                       values_.idx(k_.store_index), store_value(out_t, "acc"));
    return;
  }
  out += fmt::format("#pragma unroll 4\n      for (int64_t j = threadIdx.x; j < {}LL; j += {}) {{\n", k_.loops[1].extent, threads);
  out += fmt::format("        const int64_t {} = j;\n", k_.loops[1].var);
  values_.emit_values(out, "        ");
  out += fmt::format("        {}[{}] = {};\n      }}\n    }}\n", values_.buf(0), values_.idx(k_.store_index),
                     store_value(out_t, values_.v(k_.value)));
}

std::vector<CudaLaunch> CudaKernelRenderer::render(std::string& out) {
  std::vector<CudaLaunch> launches;
  if (!is_library(k_.kind)) out += "\n";
  switch (k_.kind) {
    case KernelKind::Elementwise: elementwise(out, launches); break;
    case KernelKind::Reduce:
      if (k_.column) column_reduce(out, launches);
      else row_reduce(out, launches);
      break;
    case KernelKind::Scatter: scatter(out, launches); break;
    case KernelKind::Attention: attention(out, launches); break;
    case KernelKind::Matmul:
    case KernelKind::Conv:
    case KernelKind::Pool:
    case KernelKind::Collective:
    case KernelKind::QuantizedMatmul:
    case KernelKind::Transfer: break;
  }
  return launches;
}

// Whether kernel `k` can be a phase of a row group over rows of `rows` x `cols`: row `o` of its
// output depends on row `o` of what it reads (checked by the group for earlier outputs).
bool row_shaped(const Kernel& k, int64_t rows, int64_t cols) {
  if (k.loops.empty() || k.loops[0].role != Loop::Role::Parallel || k.loops[0].extent != rows) return false;
  if (!k.side_stores.empty()) return false;  // a phase writes one output
  for (const Expr& e : k.exprs)
    if (e.kind == Expr::Kind::GatherLoad) return false;  // index errors are reported per kernel
  if (k.kind == KernelKind::Elementwise)
    return k.loops.size() == 2 && k.loops[1].extent == cols && k.ctx.render(k.store_index) == fmt::format("{}*{} + {}", cols, k.loops[0].var, k.loops[1].var);
  if (k.kind != KernelKind::Reduce || k.column || k.ctx.render(k.store_index) != k.loops[0].var) return false;
  int64_t extent = 1;
  for (size_t l = 1; l < k.loops.size(); ++l) extent *= k.loops[l].extent;
  return extent == cols;
}

// Whether kernel `k` reads the outputs of `earlier` (slots) only at its own row.
bool reads_rows_only(const Kernel& k, const std::vector<int>& earlier) {
  for (const Expr& e : k.exprs) {
    if (e.kind != Expr::Kind::Load) continue;
    const int slot = k.buffers[e.buffer].slot;
    if (std::find(earlier.begin(), earlier.end(), slot) == earlier.end()) continue;
    if (!e.guards.empty() || k.ctx.render(e.index) != k.loops[0].var) return false;
  }
  return true;
}

}  // namespace

std::vector<int> cuda_row_groups(const std::vector<Kernel>& kernels) {
  std::vector<int> start(kernels.size());
  for (size_t k = 0; k < kernels.size(); ++k) start[k] = static_cast<int>(k);
  size_t a = 0;
  while (a < kernels.size()) {
    const Kernel& first = kernels[a];
    size_t b = a;  // the group is [a, b]
    if (first.kind == KernelKind::Reduce && !first.loops.empty()) {
      const int64_t rows = first.loops[0].extent;
      int64_t cols = 1;
      for (size_t l = 1; l < first.loops.size(); ++l) cols *= first.loops[l].extent;
      std::vector<int> outputs;
      // Only reductions of one value per row hand on to later phases; any kernel may end it.
      while (b < kernels.size() && row_shaped(kernels[b], rows, cols) && reads_rows_only(kernels[b], outputs)) {
        outputs.push_back(kernels[b].buffers[0].slot);
        ++b;
        if (kernels[b - 1].kind != KernelKind::Reduce) break;
      }
      b = b > a ? b - 1 : a;
      // A row group pays off when a later phase rereads the rows an earlier one read. Rows of up
      // to kThreadPerOutput fold in one thread each on their own (row_reduce) but as a block's
      // tree in a group: a different order of the sums, so bits that would depend on which
      // kernels happen to stand next to each other (recomputed copies move them).
      if (b > a && cols <= kThreadPerOutput) b = a;
      // Too few rows to fill the GPU with a block each: the reductions split their rows instead.
      if (split_parts(rows, cols) > 1) b = a;
    }
    for (size_t k = a; k <= b; ++k) start[k] = static_cast<int>(a);
    a = b + 1;
  }
  return start;
}

namespace {

// `kernels` (a row group's canonical forms) as one function: a block per row (grid-stride over
// rows), each kernel a phase of the row in turn. Its parameters are every slot the kernels touch,
// in order of first use, which canonical slots 0, 1, ... are. Appends the function to `out`;
// returns its launch and sets `types` to its parameter types.
CudaLaunch render_row_group(const std::vector<Kernel>& kernels, std::string& out, std::vector<std::string>& types) {
  const Kernel& first = kernels.front();
  const std::string name = first.name + "_rows";
  std::vector<int> slots;
  std::string params, scalars, scratch;
  std::vector<int> scalar_slots;
  for (size_t k = 0; k < kernels.size(); ++k) {
    for (const KernelBuffer& buf : kernels[k].buffers) {
      if (std::find(slots.begin(), slots.end(), buf.slot) != slots.end()) continue;
      slots.push_back(buf.slot);
      types.push_back(fmt::format("{}*", storage_type(buf.dtype)));
      params += fmt::format("{} b{}, ", types.back(), buf.slot);
    }
    for (const Expr& e : kernels[k].exprs)
      if (e.kind == Expr::Kind::Scalar && std::find(scalar_slots.begin(), scalar_slots.end(), e.slot) == scalar_slots.end()) {
        scalar_slots.push_back(e.slot);
        scalars += fmt::format("  {}\n", scalar_declaration(e.dtype, e.slot));
      }
    if (kernels[k].kind == KernelKind::Reduce)
      scratch += fmt::format("  __shared__ {} scratch{}[32];\n", compute_type(kernels[k].buffers[0].dtype), k);
  }
  types.insert(types.end(), kTrailingTypes.begin(), kTrailingTypes.end());
  const int64_t rows = first.loops[0].extent;
  int64_t cols = 1;
  for (size_t l = 1; l < first.loops.size(); ++l) cols *= first.loops[l].extent;
  out += fmt::format("\n// row group: {} kernels over {} rows of {}\n", kernels.size(), rows, cols);
  out += fmt::format("extern \"C\" __global__ void __launch_bounds__({}) {}({}{}) {{\n", kThreads, name, params,
                     kTrailingParameters);
  out += scalars + scratch;
  out += fmt::format("  for (int64_t t = blockIdx.x; t < {}LL; t += gridDim.x) {{\n", rows);
  const int threads = row_threads(cols);
  for (size_t k = 0; k < kernels.size(); ++k) CudaKernelRenderer(kernels[k]).row_phase(out, static_cast<int>(k), threads);
  out += "  }\n}\n";
  return {name, std::clamp<int64_t>(rows, 1, kMaxBlocks), threads};
}

// The functions of one launch unit (a kernel, or a row group as one function) in canonical form.
struct UnitText {
  std::string text;
  std::vector<CudaLaunch> launches;  // named after kCanonicalName
  std::vector<std::string> types;
  int64_t scratch_bytes = 0;
};

UnitText render_unit(const std::vector<Kernel>& canonical) {
  UnitText unit;
  if (canonical.size() > 1) {
    unit.launches.push_back(render_row_group(canonical, unit.text, unit.types));
    return unit;
  }
  CudaKernelRenderer renderer(canonical.front());
  unit.launches = renderer.render(unit.text);
  unit.scratch_bytes = renderer.scratch_bytes();
  unit.types = cuda_parameter_types(canonical.front());
  return unit;
}

}  // namespace

CudaSource render_cuda(const std::vector<Kernel>& kernels, const std::vector<int>& groups, bool share) {
  CudaSource result;
  // Only a plan with attention pays for compiling its templates.
  if (std::any_of(kernels.begin(), kernels.end(), [](const Kernel& k) { return k.kind == KernelKind::Attention; }))
    result.functions += kCudaAttention;
  result.launches.resize(kernels.size());
  result.parameter_slots.resize(kernels.size());
  result.parameter_types.resize(kernels.size());
  result.scalar_slots.resize(kernels.size());
  result.rand_slots.resize(kernels.size());
  // Per distinct unit (its text and launches): the kernel whose launches name its functions.
  std::unordered_map<std::string, size_t> first_with;
  for (size_t k = 0; k < kernels.size(); ++k) {
    const size_t start = groups.empty() ? k : static_cast<size_t>(groups[k]);
    if (start != k || is_library(kernels[k].kind)) continue;  // a later phase of a row group, or a library call
    size_t end = k;
    while (end + 1 < kernels.size() && !groups.empty() && static_cast<size_t>(groups[end + 1]) == k) ++end;
    jit::KernelBinding binding;
    std::vector<Kernel> canonical;
    for (size_t i = k; i <= end; ++i) canonical.push_back(canonical_kernel(kernels[i], &binding));
    const UnitText unit = render_unit(canonical);
    if (unit.launches.empty()) continue;
    result.parameter_slots[k] = binding.buffer_slots;
    result.scalar_slots[k] = binding.scalar_slots;
    result.rand_slots[k] = binding.rand_slots;
    result.parameter_types[k] = unit.types;
    result.scratch_bytes = std::max(result.scratch_bytes, unit.scratch_bytes);

    std::string key = unit.text;
    for (const CudaLaunch& l : unit.launches) key += fmt::format("\n{} {} {}", l.function, l.blocks, l.threads);
    auto found = share ? first_with.find(key) : first_with.end();
    if (found != first_with.end()) {
      result.launches[k] = result.launches[found->second];
      continue;
    }
    if (share) first_with.emplace(std::move(key), k);
    for (const CudaLaunch& l : unit.launches)
      result.launches[k].push_back({rename_function(l.function, kernels[k].name), l.blocks, l.threads});
    result.functions += fmt::format("\n// {}{}", kernels[k].summary, rename_function(unit.text, kernels[k].name));
    result.function_count += static_cast<int>(unit.launches.size());
  }
  result.source = std::string(kCudaTypes) + kCudaPrelude + kMathPrelude + kRandomPrelude + result.functions;
  return result;
}

}  // namespace kiln::cuda
