// The closed set of primitive ops every graph is made of (docs/architecture.md, "Recording").
// Everything else (softmax, layer norm, losses, ...) is a composite of these and gets its gradient
// for free.
// Each table indexed by Op (names here, grad rules in ops/, renderer cases in jit/) is checked
// at compile time to cover every op.
#pragma once
#include <cstdint>
#include <string_view>

namespace kiln {

// X(name, kind)
#define KILN_OP_LIST(X)                                                                 \
  /* leaves: realized data, constants and generators */                                 \
  X(Input, Leaf) X(Full, Leaf) X(Iota, Leaf) X(RandUniform, Leaf) X(RandNormal, Leaf)   \
  /* elementwise unary */                                                               \
  X(Neg, Unary) X(Exp, Unary) X(Log, Unary) X(Sqrt, Unary) X(Rsqrt, Unary)              \
  X(Sin, Unary) X(Cos, Unary) X(Tanh, Unary) X(Erf, Unary) X(Abs, Unary)                \
  X(Reciprocal, Unary) X(Sign, Unary) X(Floor, Unary) X(Not, Unary) X(Cast, Unary)      \
  /* elementwise binary (operands already broadcast to one shape) */                    \
  X(Add, Binary) X(Sub, Binary) X(Mul, Binary) X(Div, Binary) X(Pow, Binary)            \
  X(Max, Binary) X(Min, Binary) X(Lt, Binary) X(Le, Binary) X(Gt, Binary)               \
  X(Ge, Binary) X(Eq, Binary) X(Ne, Binary) X(And, Binary) X(Or, Binary)                \
  /* elementwise ternary */                                                             \
  X(Where, Ternary)                                                                     \
  /* movement: views, fused into the index expressions of their consumers */            \
  X(Reshape, Movement) X(Permute, Movement) X(Expand, Movement) X(Slice, Movement)      \
  X(Pad, Movement)                                                                      \
  /* reductions over axes (the node keeps reduced dims as size 1) */                    \
  X(ReduceSum, Reduce) X(ReduceMax, Reduce)                                             \
  /* reindexing */                                                                      \
  X(Gather, Index) X(ScatterAdd, Index)                                                 \
  /* library ops: kernel boundaries computed by oneDNN / cuBLAS */                      \
  X(Matmul, Library) X(Conv2d, Library) X(Conv2dBackwardData, Library)                  \
  X(Conv2dBackwardWeight, Library)                                                      \
  /* max pooling's window arg-max where windows tile the input (ops/pooling.cc) */      \
  X(MaxPoolOffsets, Library) X(MaxPoolGather, Library) X(MaxPoolScatter, Library)       \
  /* collectives: a kernel the executor starts and waits for (jit/collective.h) */      \
  X(AllReduce, Library) X(Send, Library) X(Recv, Library)                               \
  /* int8: the matmul of a dynamically quantized Linear (nn/quantize.h) */              \
  X(QuantizedMatmul, Library)                                                           \
  /* fused attention and its backward: kernels rendered from a template (jit/kernel_ir.h) */ \
  X(Attention, Library) X(AttentionBackward, Library)

enum class Op : uint8_t {
#define KILN_OP_ENUM(name, kind) name,
  KILN_OP_LIST(KILN_OP_ENUM)
#undef KILN_OP_ENUM
};

enum class OpKind : uint8_t { Leaf, Unary, Binary, Ternary, Movement, Reduce, Index, Library };

inline constexpr int kNumOps = 0
#define KILN_OP_COUNT(name, kind) +1
    KILN_OP_LIST(KILN_OP_COUNT)
#undef KILN_OP_COUNT
    ;

inline constexpr std::string_view kOpNames[] = {
#define KILN_OP_NAME(name, kind) #name,
    KILN_OP_LIST(KILN_OP_NAME)
#undef KILN_OP_NAME
};
inline constexpr OpKind kOpKinds[] = {
#define KILN_OP_KIND(name, kind) OpKind::kind,
    KILN_OP_LIST(KILN_OP_KIND)
#undef KILN_OP_KIND
};
static_assert(std::size(kOpNames) == kNumOps && std::size(kOpKinds) == kNumOps);

constexpr std::string_view op_name(Op op) { return kOpNames[static_cast<int>(op)]; }
constexpr OpKind op_kind(Op op) { return kOpKinds[static_cast<int>(op)]; }
constexpr bool is_elementwise(Op op) {
  OpKind k = op_kind(op);
  return k == OpKind::Unary || k == OpKind::Binary || k == OpKind::Ternary;
}

}  // namespace kiln
