// Elementwise ops of the user API: dtype promotion and broadcasting, then one primitive.
#include <cmath>

#include "ops/autocast.h"
#include "ops/ops.h"
#include "ops/primitive.h"

namespace kiln {

namespace {
// Broadcasts both operands to one shape and one dtype.
std::pair<Tensor, Tensor> align(const Tensor& a, const Tensor& b, const char* op) {
  DType t = promote(a.dtype(), b.dtype());
  Shape s = broadcast_shapes(a.shape(), b.shape(), op);
  return {broadcast_to(prim::cast(a, t), s), broadcast_to(prim::cast(b, t), s)};
}

Tensor binary(Op op, const Tensor& a, const Tensor& b, const char* name) {
  auto [x, y] = align(a, b, name);
  return prim::binary(op, x, y);
}

Tensor float_unary(Op op, const Tensor& a) {
  // Integer inputs of transcendental ops compute in float32, as in PyTorch.
  return prim::unary(op, is_floating(a.dtype()) ? a : prim::cast(a, DType::Float32));
}
}  // namespace

Tensor neg(const Tensor& a) { return prim::unary(Op::Neg, a); }
Tensor exp(const Tensor& a) {
  AutocastScope amp("exp");
  return float_unary(Op::Exp, amp(a));
}
Tensor log(const Tensor& a) {
  AutocastScope amp("log");
  return float_unary(Op::Log, amp(a));
}
Tensor sqrt(const Tensor& a) { return float_unary(Op::Sqrt, a); }
Tensor rsqrt(const Tensor& a) { return float_unary(Op::Rsqrt, a); }
Tensor sin(const Tensor& a) { return float_unary(Op::Sin, a); }
Tensor cos(const Tensor& a) { return float_unary(Op::Cos, a); }
Tensor tanh(const Tensor& a) { return float_unary(Op::Tanh, a); }
Tensor erf(const Tensor& a) { return float_unary(Op::Erf, a); }
Tensor abs(const Tensor& a) { return prim::unary(Op::Abs, a); }
Tensor reciprocal(const Tensor& a) { return float_unary(Op::Reciprocal, a); }
Tensor sign(const Tensor& a) { return prim::unary(Op::Sign, a); }
Tensor floor(const Tensor& a) { return is_floating(a.dtype()) ? prim::unary(Op::Floor, a) : a; }
Tensor logical_not(const Tensor& a) { return prim::unary(Op::Not, a); }
Tensor cast(const Tensor& a, DType dtype) { return prim::cast(a, dtype); }

Tensor add(const Tensor& a, const Tensor& b) { return binary(Op::Add, a, b, "add"); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary(Op::Sub, a, b, "sub"); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary(Op::Mul, a, b, "mul"); }
Tensor div(const Tensor& a, const Tensor& b) {
  // True division: integers divide as float32.
  if (is_integral(a.dtype()) && is_integral(b.dtype()))
    return binary(Op::Div, cast(a, DType::Float32), cast(b, DType::Float32), "div");
  return binary(Op::Div, a, b, "div");
}
Tensor pow(const Tensor& a, const Tensor& b) {
  AutocastScope amp("pow");
  auto [x, y] = align(amp(a), amp(b), "pow");
  if (!is_floating(x.dtype())) {
    x = cast(x, DType::Float32);
    y = cast(y, DType::Float32);
  }
  return prim::binary(Op::Pow, x, y);
}
Tensor pow(const Tensor& a_in, double exponent) {
  AutocastScope amp("pow");
  const Tensor a = amp(a_in);
  if (exponent == 1.0) return a;
  if (exponent == 2.0) return mul(a, a);
  if (exponent == 0.5) return sqrt(a);
  if (exponent == -1.0) return reciprocal(a);
  return pow(a, scalar_like(exponent, a));
}
Tensor maximum(const Tensor& a, const Tensor& b) { return binary(Op::Max, a, b, "maximum"); }
Tensor minimum(const Tensor& a, const Tensor& b) { return binary(Op::Min, a, b, "minimum"); }
Tensor lt(const Tensor& a, const Tensor& b) { return binary(Op::Lt, a, b, "lt"); }
Tensor le(const Tensor& a, const Tensor& b) { return binary(Op::Le, a, b, "le"); }
Tensor gt(const Tensor& a, const Tensor& b) { return binary(Op::Gt, a, b, "gt"); }
Tensor ge(const Tensor& a, const Tensor& b) { return binary(Op::Ge, a, b, "ge"); }
Tensor eq(const Tensor& a, const Tensor& b) { return binary(Op::Eq, a, b, "eq"); }
Tensor ne(const Tensor& a, const Tensor& b) { return binary(Op::Ne, a, b, "ne"); }
Tensor logical_and(const Tensor& a, const Tensor& b) {
  return binary(Op::And, cast(a, DType::Bool), cast(b, DType::Bool), "logical_and");
}
Tensor logical_or(const Tensor& a, const Tensor& b) {
  return binary(Op::Or, cast(a, DType::Bool), cast(b, DType::Bool), "logical_or");
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  Tensor c = cond.dtype() == DType::Bool ? cond : ne(cond, zeros_like(cond));
  auto [x, y] = align(a, b, "where");
  Shape s = broadcast_shapes(c.shape(), x.shape(), "where");
  return prim::where(broadcast_to(c, s), broadcast_to(x, s), broadcast_to(y, s));
}

Tensor clamp(const Tensor& a, double lo, double hi) {
  return minimum(maximum(a, scalar_like(lo, a)), scalar_like(hi, a));
}

Tensor scalar_like(double value, const Tensor& like) {
  DType t = like.dtype();
  if (is_integral(t) && (value != std::floor(value) || t == DType::Bool)) t = DType::Float32;
  return scalar(value, t);
}

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator-(const Tensor& a) { return neg(a); }
Tensor operator+(const Tensor& a, double b) { return add(a, scalar_like(b, a)); }
Tensor operator-(const Tensor& a, double b) { return sub(a, scalar_like(b, a)); }
Tensor operator*(const Tensor& a, double b) { return mul(a, scalar_like(b, a)); }
Tensor operator/(const Tensor& a, double b) { return div(a, scalar_like(b, a)); }
Tensor operator+(double a, const Tensor& b) { return add(scalar_like(a, b), b); }
Tensor operator-(double a, const Tensor& b) { return sub(scalar_like(a, b), b); }
Tensor operator*(double a, const Tensor& b) { return mul(scalar_like(a, b), b); }
Tensor operator/(double a, const Tensor& b) { return div(scalar_like(a, b), b); }
Tensor operator<(const Tensor& a, const Tensor& b) { return lt(a, b); }
Tensor operator>(const Tensor& a, const Tensor& b) { return gt(a, b); }
Tensor operator<=(const Tensor& a, const Tensor& b) { return le(a, b); }
Tensor operator>=(const Tensor& a, const Tensor& b) { return ge(a, b); }
Tensor operator==(const Tensor& a, const Tensor& b) { return eq(a, b); }
Tensor operator!=(const Tensor& a, const Tensor& b) { return ne(a, b); }

}  // namespace kiln
