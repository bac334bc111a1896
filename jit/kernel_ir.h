// The backend-neutral description of one kernel: a loop nest over an output, SSA values of one
// element, and where the result goes. Each backend's renderer (C++ on the host, CUDA) turns it
// into source text.
#pragma once
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/op.h"
#include "jit/index_expr.h"
#include "ops/conv_geometry.h"

namespace kiln::jit {

enum class KernelKind : uint8_t {
  Elementwise,  // out[i] = value(i) over every output element
  Reduce,       // out[o] = fold over the reduce loops of value(o, r)
  Scatter,      // out = 0; out[.. index(i) ..] += value(i)
  Matmul,       // library calls; no generated code
  Conv,
  Pool,         // max pooling's window arg-max on the host (PoolCall)
  Collective,   // started by the executor, waited for before its first reader (jit/collective.h)
  QuantizedMatmul,  // oneDNN's int8 matmul (host only)
  Attention,    // fused attention, forward or backward: rendered from a fixed template (AttentionCall)
  Transfer,     // a copy of an offloaded activation between device and host memory (jit/offload.h)
};

constexpr bool is_library(KernelKind k) {
  return k == KernelKind::Matmul || k == KernelKind::Conv || k == KernelKind::Pool || k == KernelKind::Collective ||
         k == KernelKind::QuantizedMatmul || k == KernelKind::Transfer;
}

// One SSA value of the per-element computation.
struct Expr {
  enum class Kind : uint8_t {
    Load,        // buffers[buffer][index], or [0] where a guard fails (index may be out of range)
    Scalar,      // a bound floating scalar: scalars[slot]
    Iota,        // the integer `index`
    Rand,        // Philox value at element `index`; seed/offset in int_scalars[slot], [slot + 1]
    Compute,     // primitive `op` applied to args (unary, binary, where, cast)
    Select,      // guards hold ? args[0] : 0
    GatherLoad,  // buffers[buffer][index + stride * checked(args[0] < extent)]
  };
  explicit Expr(Kind k) : kind(k) {}
  Kind kind;
  Op op = Op::Input;
  DType dtype = DType::Float32;
  std::vector<int> args;
  int buffer = -1;
  int slot = -1;
  IndexExpr index;
  std::vector<Guard> guards;
  int64_t stride = 0, extent = 0;
};

struct Loop {
  enum class Role : uint8_t { Parallel, Inner, Reduce };
  std::string var;
  int64_t extent;
  Role role;
};

// A buffer as the kernel sees it: which plan slot and which element type.
struct KernelBuffer {
  int slot;
  DType dtype;
  bool written = false;
};

struct MatmulCall {
  int a_buffer = -1, b_buffer = -1;        // kernel buffers
  int64_t a_strides[3], b_strides[3];      // element strides {batch, row, col}
  int64_t a_offset = 0, b_offset = 0;      // element offsets into the buffers
  int64_t batch = 0, M = 0, K = 0, N = 0;
};

// a @ b summed in int32, both contiguous buffers: a (M, K) int8, b (K, N) int8 (or, b_packed, the
// bytes of prim::pack_quantized_weight); the output (M, N) float32.
struct QuantizedMatmulCall {
  int a_buffer = -1, b_buffer = -1;  // kernel buffers
  int64_t M = 0, K = 0, N = 0;
  bool b_packed = false;
};

// Both operands are contiguous buffers in the layouts of ops/conv_geometry.h.
struct ConvCall {
  ConvPass pass = ConvPass::Forward;
  int a_buffer = -1, b_buffer = -1;  // kernel buffers
  ConvGeometry geometry;
};

// Max pooling over windows that tile the input: x is a contiguous (planes, OH * kh, OW * kw) buffer.
// Without offsets the output holds, per window, the offset a * W + b of its first maximum (int8 or
// int32); with them (a buffer of such offsets), the window's element there.
struct PoolCall {
  // The window arg-max (offsets_buffer < 0), the gather of x at the offsets, or (scatter) the
  // gather's gradient: x's pooled values, each back at its offset in its window.
  int x_buffer = -1, offsets_buffer = -1;  // kernel buffers
  int64_t planes = 0, OH = 0, OW = 0, kh = 0, kw = 0;  // the pooled grid (planes, OH, OW)
  bool scatter = false;
};

// Fused attention (ops/primitive.h prim::attention): softmax(scale q kᵀ [causal]) v without the
// (Tq, Tk) scores in memory. Operands are read through strides over (batch, head, position,
// feature) from an offset into a kernel buffer; the forward writes o and the log-sum-exp of each
// row (lse, feature stride 0), the backward dq, dk and dv, all regions of the output buffer.
struct AttentionOperand {
  int buffer = -1;
  int64_t strides[4] = {0, 0, 0, 0};
  int64_t offset = 0;
};
struct AttentionCall {
  bool backward = false;
  bool causal = false;
  double scale = 1;
  int64_t B = 0, H = 0, Tq = 0, Tk = 0, D = 0, Dv = 0;
  AttentionOperand q, k, v;
  AttentionOperand o, lse;  // written by the forward; read by the backward
  AttentionOperand dout;    // the backward's
  AttentionOperand dq, dk, dv;
};

// A collective. All-reduce: the input buffers' values laid end to end in the output buffer,
// reduced over the ranks there. Send: the one input's values go to rank `peer` (the output is a
// token). Recv: the output's values come from rank `peer`.
enum class CollectiveKind : uint8_t { AllReduce, Send, Recv };
struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::AllReduce;
  std::vector<int> in_buffers;  // kernel buffers, in order
  std::vector<int64_t> counts;  // elements of each
  int64_t op = 0;               // all-reduce: 0 sum, 2 max (as prim::all_reduce)
  int64_t group = 0;            // all-reduce: the communicator group (0: the world)
  int64_t peer = -1, tag = 0;   // send and recv
};

// One step of an offloaded activation's round trip (jit/offload.h). A start queues a copy on the
// device's copy queue, after the kernels before it, and later kernels overlap it; its join makes
// the kernels after it wait for the copy. Start: buffers[0] is written (the pinned host copy, or
// the device copy fetched back) from buffers[1]. Join: buffers[0] is the copy's source or
// destination, held live until here; nothing is written.
enum class TransferStage : uint8_t { OffloadStart, OffloadJoin, FetchStart, FetchJoin };
struct TransferCall {
  TransferStage stage = TransferStage::OffloadStart;
  int id = -1;        // the activation's number in its plan: a start and its join share it
  int64_t bytes = 0;
};
// A further output of an elementwise kernel: value `value` stored into buffer `buffer` (marked
// written) at the kernel's store index.
struct SideStore {
  int buffer = -1;
  int value = -1;
};

// Elementwise: a matmul run tile by tile inside the kernel (jit/tile_matmul.h), so that a whole
// product or operand never exists. The kernel's loop 0 runs over a range per tile
// (`loop_per_tile` iterations; the function takes the range). Two ways:
// - product (operand false): buffer `buffer` is the (M, N) product of the kernel's `matmul`, which
//   no other kernel reads; it is computed `rows` rows at a time into a scratch buffer of one tile,
//   each tile just before the loop runs over it: a weight gradient read only by its update.
// - operand: the kernel's own output, buffers[0], is the (K, N) B operand of `matmul`
//   (b_buffer 0), made `rows` rows at a time into a scratch buffer of one block, each block then
//   summed into the product, buffer `buffer` (written), in the steps of jit::matmul_k_block.
struct MatmulTiles {
  int buffer = -1;
  int64_t rows = 0;
  int64_t loop_per_tile = 0;
  bool operand = false;
};

struct Kernel {
  KernelKind kind = KernelKind::Elementwise;
  std::string name;
  IndexContext ctx;
  std::vector<KernelBuffer> buffers;  // buffers[0] is the output
  std::vector<Expr> exprs;            // in dependency order
  std::vector<Loop> loops;            // outermost first
  int value = -1;                     // expr stored / folded / scattered
  IndexExpr store_index;              // where value goes (Scatter: without the scattered axis)
  std::vector<SideStore> side_stores; // Elementwise: more outputs, stored where value is
  Op reduce_op = Op::ReduceSum;       // Reduce
  bool column = false;                // Reduce: loops o (parallel), reduce axes, then i (inner)
  int scatter_index = -1;             // Scatter: expr giving the position along the axis
  int64_t scatter_stride = 0, scatter_extent = 0;
  int64_t out_numel = 0;
  MatmulCall matmul;                  // Matmul; Elementwise with tiles: the tiles' product
  MatmulTiles tiles;                  // Elementwise
  QuantizedMatmulCall quantized;
  ConvCall conv;
  PoolCall pool;
  CollectiveCall collective;
  AttentionCall attention;
  TransferCall transfer;
  std::string summary;                // one line for KILN_LOG, e.g. "Exp Mul Add [1024, 1024]"
  uint32_t label = 0;                 // the trace label of the node it writes (core/trace_label.h)
  bool recompute = false;             // it writes a copy recomputed for the backward (memory/recompute.h)
  bool backward = false;              // recorded by a gradient rule, or a recomputation for the backward
};

// Whether buffers[0] is written: every kernel but a transfer's join.
inline bool writes_output(const Kernel& k) {
  return k.kind != KernelKind::Transfer ||
         k.transfer.stage == TransferStage::OffloadStart || k.transfer.stage == TransferStage::FetchStart;
}

// Whether the kernel checks an index it reads (gather) or writes (scatter) and may end a run with
// an error.
inline bool may_fail(const Kernel& k) {
  if (k.kind == KernelKind::Scatter) return true;
  for (const Expr& e : k.exprs)
    if (e.kind == Expr::Kind::GatherLoad) return true;
  return false;
}

}  // namespace kiln::jit
