#include "jit/render_common.h"

#include <fmt/format.h>

#include "core/error.h"

namespace kiln::jit {

const char* storage_type(DType t) {
  switch (t) {
    case DType::Bool: return "bool";
    case DType::UInt8: return "uint8_t";
    case DType::Int8: return "int8_t";
    case DType::Int32: return "int32_t";
    case DType::Int64: return "int64_t";
    case DType::Float16: return "kiln_half";
    case DType::BFloat16: return "kiln_bf16";
    case DType::Float32: return "float";
    case DType::Float64: return "double";
  }
  return "?";
}

const char* compute_type(DType t) {
  if (t == DType::Float16 || t == DType::BFloat16) return "float";
  return storage_type(t);
}

std::string load_value(DType t, const std::string& ref) {
  if (t == DType::Float16) return fmt::format("kiln_h2f({})", ref);
  if (t == DType::BFloat16) return fmt::format("kiln_bf2f({})", ref);
  return ref;
}

std::string store_value(DType t, const std::string& v) {
  if (t == DType::Float16) return fmt::format("kiln_f2h({})", v);
  if (t == DType::BFloat16) return fmt::format("kiln_f2bf({})", v);
  return fmt::format("({})({})", storage_type(t), v);
}

std::string round_to(DType t, const std::string& v) {
  if (t == DType::Float16) return fmt::format("kiln_round_h({})", v);
  if (t == DType::BFloat16) return fmt::format("kiln_round_bf({})", v);
  return v;
}

std::string scalar_declaration(DType t, int slot) {
  return fmt::format("const {0} s{1} = ({0})sc[{1}];", compute_type(t), slot);
}

namespace {
// Ops whose result is one of their operands, or its negation: exact when their operands are.
bool picks_an_operand(Op op) {
  return op == Op::Max || op == Op::Min || op == Op::Where || op == Op::Neg || op == Op::Abs || op == Op::Sign ||
         op == Op::Floor;
}

// A half-type product of an exact value of its type and a bool made a number (0 or 1): the
// value or a zero (a ReLU's backward mask), so exact without rounding. Infinity times 0 is a NaN
// as it is when rounded; a NaN comes out quiet from the multiply, as rounding makes it, so the CPU's
// stores (which keep an exact value's top bits) and CUDA's (which round) store the same bits. (On
// CUDA a float32 value made from a NaN product may keep another NaN payload than before.)
bool masks_a_value(const Kernel& k, const Expr& e, const std::vector<bool>& exact) {
  if (e.kind != Expr::Kind::Compute || e.op != Op::Mul || (e.dtype != DType::Float16 && e.dtype != DType::BFloat16))
    return false;
  auto zero_or_one = [&](int a) {
    const Expr& x = k.exprs[static_cast<size_t>(a)];
    return x.kind == Expr::Kind::Compute && x.op == Op::Cast && k.exprs[static_cast<size_t>(x.args[0])].dtype == DType::Bool;
  };
  auto of_type = [&](int a) { return exact[static_cast<size_t>(a)] && k.exprs[static_cast<size_t>(a)].dtype == e.dtype; };
  const int a = e.args[0], b = e.args[1];
  return (zero_or_one(a) && of_type(b)) || (zero_or_one(b) && of_type(a));
}
}  // namespace

std::vector<bool> exact_values(const Kernel& k) {
  std::vector<bool> exact(k.exprs.size(), true);
  for (size_t i = 0; i < k.exprs.size(); ++i) {
    const Expr& e = k.exprs[i];
    const bool half = e.dtype == DType::Float16 || e.dtype == DType::BFloat16;
    if (e.kind == Expr::Kind::Scalar) exact[i] = !half;
    if (e.kind == Expr::Kind::Select) exact[i] = exact[static_cast<size_t>(e.args[0])];
    // Every other op's result is rounded when an operand may not be exact (expr_text), or exact
    // without it (masks_a_value).
  }
  return exact;
}

std::string reduce_init(DType acc, bool is_sum, const char* infinity) {
  if (is_sum) return "0";
  if (is_floating(acc)) return fmt::format("-{}", infinity);
  // INT<bits>_MIN comes from each prelude (GCC predefines no __INT<bits>_MIN__).
  if (acc == DType::Bool) return "false";
  if (acc == DType::UInt8) return "0";
  return fmt::format("INT{}_MIN", dtype_size(acc) * 8);
}

std::string ValueRenderer::buf(int b) const { return fmt::format("b{}", k_.buffers[b].slot); }

std::string ValueRenderer::v(int id) const { return fmt::format("v{}", id); }

std::string ValueRenderer::guard_text(const std::vector<Guard>& guards) const {
  std::string cond;
  for (const Guard& g : guards) {
    std::string x = idx(g.expr);
    cond += fmt::format("{}({}) >= {} && ({}) < {}", cond.empty() ? "" : " && ", x, g.lo, x, g.hi);
  }
  return cond;
}

std::string ValueRenderer::expr_text(const Expr& e, const std::string& element) const {
  const char* ct = compute_type(e.dtype);
  bool f64 = e.dtype == DType::Float64;
  switch (e.kind) {
    case Expr::Kind::Load: {
      DType t = k_.buffers[e.buffer].dtype;
      if (!element.empty()) return load_value(t, element);
      if (e.guards.empty()) return load_value(t, fmt::format("{}[{}]", buf(e.buffer), idx(e.index)));
      return load_value(t, fmt::format("{}[({}) ? {} : 0]", buf(e.buffer), guard_text(e.guards), idx(e.index)));
    }
    case Expr::Kind::Scalar: return fmt::format("s{}", e.slot);
    case Expr::Kind::Iota: return round_to(e.dtype, fmt::format("({})({})", ct, idx(e.index)));
    case Expr::Kind::Rand: {
      const char* fn = e.op == Op::RandUniform ? (f64 ? "kiln_uniform_d" : "kiln_uniform_f")
                                               : (f64 ? "kiln_normal_d" : "kiln_normal_f");
      return round_to(e.dtype, fmt::format("{}((uint64_t)isc[{}], (uint64_t)isc[{}], {})", fn, e.slot, e.slot + 1, idx(e.index)));
    }
    case Expr::Kind::Select: return fmt::format("(({}) ? {} : ({})0)", guard_text(e.guards), v(e.args[0]), ct);
    case Expr::Kind::GatherLoad: {
      DType t = k_.buffers[e.buffer].dtype;
      return load_value(t, fmt::format("{}[{} + {}LL * kiln_check_index((int64_t){}, {}LL, err)]", buf(e.buffer),
                                       idx(e.index), e.stride, v(e.args[0]), e.extent));
    }
    case Expr::Kind::Compute: {
      if (e.op == Op::Cast) {
        const DType from = k_.exprs[e.args[0]].dtype;
        // Through int32: GCC 12 does not vectorize a loop that converts bool to float directly.
        std::string a = from == DType::Bool ? fmt::format("(int32_t)({})", v(e.args[0])) : v(e.args[0]);
        if (e.dtype == DType::Bool) return fmt::format("({} != 0)", a);
        if (e.dtype == DType::Float16 || e.dtype == DType::BFloat16) {
          // From a half type or an integer that fits, a cast needs no rounding.
          const bool exact = from == DType::Bool || from == DType::Int8 || from == DType::UInt8 ||
                             (from == DType::Float16 && e.dtype == DType::Float16) ||
                             (from == DType::BFloat16 && e.dtype == DType::BFloat16);
          std::string f = fmt::format("(float)({})", a);
          return exact ? f : round_to(e.dtype, f);
        }
        // A float outside a byte type's range converts through int32 on both backends (wraps
        // like x86 C casts; a GPU's direct float -> 8-bit conversion would clamp instead).
        if ((e.dtype == DType::Int8 || e.dtype == DType::UInt8) && is_floating(from))
          return fmt::format("({})(int32_t)({})", ct, a);
        return fmt::format("({})({})", ct, a);
      }
      // Comparisons are typed by their operands, not their bool result.
      DType operand = k_.exprs[e.args[0]].dtype;
      if (e.op == Op::Where) operand = k_.exprs[e.args[1]].dtype;
      const OpPattern& p = patterns_[static_cast<int>(e.op)];
      KILN_CHECK(p.f32 != nullptr, "jit", "op {} has no rendering", op_name(e.op));
      const char* pat = operand == DType::Float64 && p.f64 ? p.f64 : p.f32;
      // Half types compute in float and round every result, as if each op stored it: a fused
      // chain then gives the bits of the unfused one, and a value recomputed in two kernels (a
      // max and the comparison against it) is the same value in both. An op that returns one of
      // its operands (or its negation) rounds its operands instead, where they are scalars
      // (loop-invariant: the compiler hoists that), and its result needs nothing more; nor does a
      // product with a 0/1 mask (masks_a_value), which is exact already.
      const bool picks = picks_an_operand(e.op);
      auto arg = [&](size_t i) {
        if (i >= e.args.size()) return std::string();
        const int a = e.args[i];
        return picks && !exact_[static_cast<size_t>(a)] ? round_to(k_.exprs[a].dtype, v(a)) : v(a);
      };
      std::string r = fmt::format("({})({})", ct, fmt::format(fmt::runtime(pat), arg(0), arg(1), arg(2)));
      return picks || masks_a_value(k_, e, exact_) ? r : round_to(e.dtype, r);
    }
  }
  return "";
}

void ValueRenderer::emit_values(std::string& out, const std::string& indent, const std::vector<std::string>& elements) const {
  for (size_t i = 0; i < k_.exprs.size(); ++i) {
    const Expr& e = k_.exprs[i];
    const std::string element = i < elements.size() ? elements[i] : std::string();
    out += fmt::format("{}const {} {} = {};\n", indent, compute_type(e.dtype), v(static_cast<int>(i)), expr_text(e, element));
  }
}

}  // namespace kiln::jit
