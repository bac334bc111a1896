// What the C++ and CUDA renderers share: the op -> expression table and the text of a kernel's
// per-element SSA values. The two backends differ only in their preludes (which define the same
// helper names: kiln_half, kiln_h2f, kiln_check_index, KILN_MAX, kiln_uniform_f, ...), a few math
// function names, and the loop structure around the values.
//
//   constexpr OpPatterns kMyPatterns = with_math(kSharedPatterns, {{Op::Exp, "expf({0})", "exp({0})"}, ...});
//   ValueRenderer values(kernel, kMyPatterns);
//   values.emit_values(out, "    ");   // const float v0 = ...; const float v1 = ...;
#pragma once
#include <array>
#include <initializer_list>
#include <string>
#include <vector>

#include "jit/kernel_ir.h"

namespace kiln::jit {

// Element type names; kiln_half / kiln_bf16 are typedefs of each backend's prelude.
const char* storage_type(DType t);
// The type values of a dtype are computed in: half types compute in float.
const char* compute_type(DType t);
// A stored element as a compute value, and back.
std::string load_value(DType t, const std::string& ref);
std::string store_value(DType t, const std::string& v);
// `v` rounded to `t` when t is a half type. Half-type values are rounded wherever they are made
// (each op's result, an iota, a random number; not a product with a 0/1 mask, exact as it is), so
// that all but bound scalars, which keep float precision as PyTorch's numbers do, are exactly
// representable in their type.
std::string round_to(DType t, const std::string& v);
// Per value of `k`: exactly representable in its type (everything but a bound scalar of a half
// type, and what passes one on unrounded).
std::vector<bool> exact_values(const Kernel& k);
// The declaration of bound scalar `slot` of type `t`: `const float s3 = ...;`.
std::string scalar_declaration(DType t, int slot);

// Per-op expression pattern; {0} {1} {2} are operands. Ops rendered by kind (leaves, cast,
// views, reductions, indexing, library calls) have none.
struct OpPattern {
  Op op;
  const char* f32;  // float (and integer) operands
  const char* f64;  // double operands; nullptr: same as f32
};
using OpPatterns = std::array<OpPattern, kNumOps>;

// Operators both backends write alike. Math functions (nullptr here) come from each backend.
inline constexpr OpPatterns kSharedPatterns = {{
    {Op::Input, nullptr, nullptr}, {Op::Full, nullptr, nullptr}, {Op::Iota, nullptr, nullptr},
    {Op::RandUniform, nullptr, nullptr}, {Op::RandNormal, nullptr, nullptr},
    {Op::Neg, "(-{0})", nullptr},
    {Op::Exp, nullptr, nullptr}, {Op::Log, nullptr, nullptr}, {Op::Sqrt, nullptr, nullptr},
    {Op::Rsqrt, nullptr, nullptr}, {Op::Sin, nullptr, nullptr}, {Op::Cos, nullptr, nullptr},
    {Op::Tanh, nullptr, nullptr}, {Op::Erf, nullptr, nullptr},
    {Op::Abs, "({0} < 0 ? -{0} : {0})", nullptr},
    {Op::Reciprocal, "(1.0f / {0})", "(1.0 / {0})"},
    {Op::Sign, "(({0} > 0) - ({0} < 0))", nullptr},
    {Op::Floor, nullptr, nullptr},
    {Op::Not, "(!{0})", nullptr},
    {Op::Cast, nullptr, nullptr},
    {Op::Add, "({0} + {1})", nullptr}, {Op::Sub, "({0} - {1})", nullptr}, {Op::Mul, "({0} * {1})", nullptr},
    {Op::Div, "({0} / {1})", nullptr}, {Op::Pow, nullptr, nullptr},
    {Op::Max, "KILN_MAX({0}, {1})", nullptr}, {Op::Min, "KILN_MIN({0}, {1})", nullptr},
    {Op::Lt, "({0} < {1})", nullptr}, {Op::Le, "({0} <= {1})", nullptr}, {Op::Gt, "({0} > {1})", nullptr},
    {Op::Ge, "({0} >= {1})", nullptr}, {Op::Eq, "({0} == {1})", nullptr}, {Op::Ne, "({0} != {1})", nullptr},
    {Op::And, "({0} && {1})", nullptr}, {Op::Or, "({0} || {1})", nullptr},
    {Op::Where, "({0} ? {1} : {2})", nullptr},
    {Op::Reshape, nullptr, nullptr}, {Op::Permute, nullptr, nullptr}, {Op::Expand, nullptr, nullptr},
    {Op::Slice, nullptr, nullptr}, {Op::Pad, nullptr, nullptr},
    {Op::ReduceSum, nullptr, nullptr}, {Op::ReduceMax, nullptr, nullptr},
    {Op::Gather, nullptr, nullptr}, {Op::ScatterAdd, nullptr, nullptr},
    {Op::Matmul, nullptr, nullptr}, {Op::Conv2d, nullptr, nullptr}, {Op::Conv2dBackwardData, nullptr, nullptr},
    {Op::Conv2dBackwardWeight, nullptr, nullptr}, {Op::MaxPoolOffsets, nullptr, nullptr},
    {Op::MaxPoolGather, nullptr, nullptr}, {Op::MaxPoolScatter, nullptr, nullptr},
    {Op::AllReduce, nullptr, nullptr},
    {Op::Send, nullptr, nullptr}, {Op::Recv, nullptr, nullptr}, {Op::QuantizedMatmul, nullptr, nullptr},
    {Op::Attention, nullptr, nullptr}, {Op::AttentionBackward, nullptr, nullptr},
}};

// `table` with the entries of `math` replacing those of their ops.
constexpr OpPatterns with_math(OpPatterns table, std::initializer_list<OpPattern> math) {
  for (const OpPattern& p : math) table[static_cast<size_t>(p.op)] = p;
  return table;
}

// Entries in enum order, and a pattern for every elementwise op except Cast (rendered by kind).
constexpr bool covers_every_op(const OpPatterns& table) {
  for (size_t i = 0; i < table.size(); ++i) {
    if (static_cast<size_t>(table[i].op) != i) return false;
    if (is_elementwise(table[i].op) && table[i].op != Op::Cast && table[i].f32 == nullptr) return false;
  }
  return true;
}

// The initial value of a Reduce accumulator of `acc` type; `infinity` spells +inf in float.
std::string reduce_init(DType acc, bool is_sum, const char* infinity);

// Text of one kernel's buffers, indices and SSA values (`v<id>`), given a backend's op table.
class ValueRenderer {
 public:
  ValueRenderer(const Kernel& k, const OpPatterns& patterns) : k_(k), patterns_(patterns), exact_(exact_values(k)) {}
  bool exact(int id) const { return exact_[static_cast<size_t>(id)]; }
  std::string buf(int b) const;                    // "b<slot>"
  std::string idx(const IndexExpr& e) const { return k_.ctx.render(e); }
  std::string v(int id) const;                     // "v<id>"
  std::string guard_text(const std::vector<Guard>& guards) const;  // true where every guard holds
  // `element` (when not empty) is the text of the element a Load reads, instead of buf[index].
  std::string expr_text(const Expr& e, const std::string& element = {}) const;
  // `const <type> v<i> = <expr>;` for every value, in order. `elements[i]`, where present and
  // not empty, is the element Load i reads (a register the caller loaded, e.g. a vector lane).
  void emit_values(std::string& out, const std::string& indent, const std::vector<std::string>& elements = {}) const;

 private:
  const Kernel& k_;
  const OpPatterns& patterns_;
  std::vector<bool> exact_;
};

}  // namespace kiln::jit
