#include "jit/index_expr.h"

#include <algorithm>
#include <map>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"

namespace kiln::jit {

namespace {
int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }
int64_t floor_mod(int64_t a, int64_t b) { return a - floor_div(a, b) * b; }
int64_t gcd(int64_t a, int64_t b) {
  a = a < 0 ? -a : a;
  b = b < 0 ? -b : b;
  while (b) {
    int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}
IndexExpr scale_down(const IndexExpr& a, int64_t g) {
  IndexExpr r = a;
  for (auto& t : r.terms) t.coeff /= g;
  r.constant /= g;
  return r;
}
// a = k*q + r: q from the terms whose coefficients k divides (and floor(constant / k)), r the rest.
std::pair<IndexExpr, IndexExpr> split(const IndexExpr& a, int64_t k) {
  IndexExpr q, r;
  for (auto& t : a.terms) {
    if (t.coeff % k == 0) q.terms.push_back({t.coeff / k, t.atom});
    else r.terms.push_back(t);
  }
  q.constant = floor_div(a.constant, k);
  r.constant = floor_mod(a.constant, k);
  return {q, r};
}
bool same(const IndexExpr& a, const IndexExpr& b) {
  if (a.constant != b.constant || a.terms.size() != b.terms.size()) return false;
  for (size_t i = 0; i < a.terms.size(); ++i)
    if (a.terms[i].coeff != b.terms[i].coeff || a.terms[i].atom != b.terms[i].atom) return false;
  return true;
}
}  // namespace

int IndexContext::intern(IndexAtom atom) {
  for (size_t i = 0; i < atoms_.size(); ++i) {
    const IndexAtom& o = atoms_[i];
    if (o.kind != atom.kind || o.divisor != atom.divisor) continue;
    if (atom.kind == IndexAtom::Kind::Var ? o.name == atom.name && o.shift == atom.shift && o.min == atom.min &&
                                                o.max == atom.max
                                          : same(inners_[o.inner], inners_[atom.inner]))
      return static_cast<int>(i);
  }
  atoms_.push_back(std::move(atom));
  return static_cast<int>(atoms_.size() - 1);
}

IndexExpr IndexContext::var(const std::string& name, int64_t extent) {
  const int64_t last = std::max<int64_t>(extent - 1, 0);
  IndexAtom a{IndexAtom::Kind::Var, name, -1, 1, 0, last, 0, 0, last};
  int id = intern(a);
  if (extent <= 1) return constant(0);
  return IndexExpr{{{1, id}}, 0};
}

IndexExpr IndexContext::var_in(const std::string& name, int64_t extent, int64_t lo, int64_t hi) {
  const int64_t last = std::max<int64_t>(extent - 1, 0);
  lo = std::max<int64_t>(lo, 0), hi = std::min(hi, last);
  if ((lo == 0 && hi == last) || lo > hi) return var(name, extent);  // nothing to narrow, or never read
  if (lo == hi) return constant(lo);  // the only value that is read
  IndexAtom a{IndexAtom::Kind::Var, name, -1, 1, 0, hi - lo, lo, -lo, last - lo};
  return IndexExpr{{{1, intern(a)}}, lo};
}

std::pair<int64_t, int64_t> IndexContext::whole_range(const IndexAtom& atom) const {
  if (atom.kind == IndexAtom::Kind::Var) return {atom.whole_min, atom.whole_max};
  const IndexExpr& inner = inners_[atom.inner];
  const int64_t lo = whole_min(inner), hi = whole_max(inner), d = atom.divisor;
  if (atom.kind == IndexAtom::Kind::Div) return {floor_div(lo, d), floor_div(hi, d)};
  if (lo >= 0) return {0, std::min(d - 1, hi)};
  return {-(d - 1), d - 1};
}

std::pair<int64_t, int64_t> IndexContext::whole_bounds(const IndexExpr& a) const {
  int64_t lo = a.constant, hi = a.constant;
  for (auto& t : a.terms) {
    const auto [atom_lo, atom_hi] = whole_range(atoms_[t.atom]);
    lo += t.coeff > 0 ? t.coeff * atom_lo : t.coeff * atom_hi;
    hi += t.coeff > 0 ? t.coeff * atom_hi : t.coeff * atom_lo;
  }
  return {lo, hi};
}

int64_t IndexContext::whole_min(const IndexExpr& a) const { return whole_bounds(a).first; }
int64_t IndexContext::whole_max(const IndexExpr& a) const { return whole_bounds(a).second; }

IndexExpr IndexContext::add(const IndexExpr& a, const IndexExpr& b) const {
  std::map<int, int64_t> acc;
  for (auto& t : a.terms) acc[t.atom] += t.coeff;
  for (auto& t : b.terms) acc[t.atom] += t.coeff;
  // Fold c*d*(e/d) + c*(e%d) back into c*e (C's / and % satisfy e == (e/d)*d + e%d for any
  // sign): a reshape's div/mod decomposition, linearized again, becomes affine. The div may be
  // stored merged with an inner one, e/d == x/(k*d) when e is x/k.
  for (bool folded = true; folded;) {
    folded = false;
    for (auto& [m, cm] : acc) {
      if (m < 0 || cm == 0 || atoms_[m].kind != IndexAtom::Kind::Mod) continue;
      const IndexAtom& mod_atom = atoms_[m];
      const IndexExpr& e = inners_[mod_atom.inner];
      const int64_t d = mod_atom.divisor;
      const IndexAtom* inner_div = nullptr;  // e is x/k
      if (e.constant == 0 && e.terms.size() == 1 && e.terms[0].coeff == 1 &&
          atoms_[e.terms[0].atom].kind == IndexAtom::Kind::Div)
        inner_div = &atoms_[e.terms[0].atom];
      for (auto& [q, cq] : acc) {
        if (q < 0 || cq != cm * d || atoms_[q].kind != IndexAtom::Kind::Div) continue;
        const IndexAtom& div_atom = atoms_[q];
        bool partner = (div_atom.divisor == d && same(inners_[div_atom.inner], e)) ||
                       (inner_div && div_atom.divisor == inner_div->divisor * d &&
                        same(inners_[div_atom.inner], inners_[inner_div->inner]));
        if (!partner) continue;
        int64_t c = cm;
        cq = 0;
        acc[m] = 0;
        for (auto& t : e.terms) acc[t.atom] += c * t.coeff;
        acc[-1] += c * e.constant;  // constants ride on a sentinel key
        folded = true;
        break;
      }
      if (folded) break;
    }
  }
  IndexExpr r;
  r.constant = a.constant + b.constant;
  for (auto& [atom, c] : acc) {
    if (atom == -1) r.constant += c;
    else if (c != 0) r.terms.push_back({c, atom});
  }
  return r;
}

IndexExpr IndexContext::scale(const IndexExpr& a, int64_t c) const {
  if (c == 0) return constant(0);
  IndexExpr r = a;
  for (auto& t : r.terms) t.coeff *= c;
  r.constant *= c;
  return r;
}

int64_t IndexContext::min(const IndexExpr& a) const {
  int64_t v = a.constant;
  for (auto& t : a.terms) v += t.coeff > 0 ? t.coeff * atoms_[t.atom].min : t.coeff * atoms_[t.atom].max;
  return v;
}

int64_t IndexContext::max(const IndexExpr& a) const {
  int64_t v = a.constant;
  for (auto& t : a.terms) v += t.coeff > 0 ? t.coeff * atoms_[t.atom].max : t.coeff * atoms_[t.atom].min;
  return v;
}

IndexExpr IndexContext::div(const IndexExpr& a, int64_t d) {
  // d is 0 only for strides of zero-size tensors, whose loops never run.
  if (d == 0) return constant(0);
  if (d == 1) return a;
  if (a.terms.empty()) return constant(floor_div(a.constant, d));
  // (x/k)/d == x/(k*d): one atom, which add() can pair with (x/k)%d.
  if (a.constant == 0 && a.terms.size() == 1 && a.terms[0].coeff == 1 && d > 0) {
    const IndexAtom& inner = atoms_[a.terms[0].atom];
    if (inner.kind == IndexAtom::Kind::Div && inner.divisor > 0) {
      IndexExpr x = inners_[inner.inner];  // copy: div() may grow inners_
      return div(x, inner.divisor * d);
    }
  }
  // a = d*q + r, r holding the terms whose coefficients d does not divide: a/d == q when
  // 0 <= r < d.
  if (auto [q, r] = split(a, d); min(r) >= 0 && max(r) < d) {
    return q;
  } else if (!q.terms.empty() && !r.terms.empty() && min(q) >= 0 && min(r) >= 0) {
    return add(q, div(r, d));  // (d*q + r)/d == q + r/d, all non-negative: (28*o + i)/2 = 14*o + i/2
  }
  // a = k*q + r with 0 <= r < k for a factor k of d: a/d == q/(d/k). E.g. (28*o + i)/784 with
  // i < 28 is o/28.
  for (auto& t : a.terms) {
    int64_t k = gcd(t.coeff, d);
    if (k <= 1 || k == d) continue;
    if (auto [q, r] = split(a, k); min(r) >= 0 && max(r) < k) return div(q, d / k);
  }
  // Common factor of every coefficient, the constant and d: (g*x)/(g*k) = x/k.
  int64_t g = d;
  for (auto& t : a.terms) g = gcd(g, t.coeff);
  g = gcd(g, a.constant);
  if (g > 1) return div(scale_down(a, g), d / g);
  IndexAtom atom{IndexAtom::Kind::Div, "", static_cast<int>(inners_.size()), d, floor_div(min(a), d),
                 floor_div(max(a), d)};
  inners_.push_back(a);
  int id = intern(atom);
  if (id != static_cast<int>(atoms_.size()) - 1) inners_.pop_back();
  return IndexExpr{{{1, id}}, 0};
}

IndexExpr IndexContext::mod(const IndexExpr& a, int64_t d) {
  if (d == 1 || d == 0) return constant(0);
  if (a.terms.empty()) return constant(floor_mod(a.constant, d));
  if (min(a) >= 0 && max(a) < d) return a;
  IndexExpr r;
  for (auto& t : a.terms)
    if (t.coeff % d != 0) r.terms.push_back(t);
  r.constant = floor_mod(a.constant, d);
  if (min(r) >= 0) {
    if (max(r) < d) return r;
    if (r.terms.size() < a.terms.size()) return mod(r, d);
  }
  int64_t g = d;
  for (auto& t : a.terms) g = gcd(g, t.coeff);
  g = gcd(g, a.constant);
  if (g > 1 && min(a) >= 0) return scale(mod(scale_down(a, g), d / g), g);
  IndexAtom atom{IndexAtom::Kind::Mod, "", static_cast<int>(inners_.size()), d, 0, d - 1};
  if (min(a) >= 0) atom.max = std::min(d - 1, max(a));
  else atom.min = -(d - 1);
  inners_.push_back(a);
  int id = intern(atom);
  if (id != static_cast<int>(atoms_.size()) - 1) inners_.pop_back();
  return IndexExpr{{{1, id}}, 0};
}

bool IndexContext::is_affine(const IndexExpr& a) const {
  for (auto& t : a.terms)
    if (atoms_[t.atom].kind != IndexAtom::Kind::Var) return false;
  return true;
}

bool IndexContext::affine_in(const IndexExpr& a, const std::string& var) const {
  for (auto& t : a.terms) {
    const IndexAtom& atom = atoms_[t.atom];
    if (atom.kind != IndexAtom::Kind::Var && uses_var(inners_[atom.inner], var)) return false;
  }
  return true;
}

bool IndexContext::uses_var(const IndexExpr& a, const std::string& var) const {
  for (auto& t : a.terms) {
    const IndexAtom& atom = atoms_[t.atom];
    if (atom.kind == IndexAtom::Kind::Var ? atom.name == var : uses_var(inners_[atom.inner], var)) return true;
  }
  return false;
}

int64_t IndexContext::offset(const IndexExpr& a) const {
  int64_t c = a.constant;
  for (auto& t : a.terms) {
    const IndexAtom& atom = atoms_[t.atom];
    if (atom.kind == IndexAtom::Kind::Var) c -= t.coeff * atom.shift;
  }
  return c;
}

int64_t IndexContext::coefficient(const IndexExpr& a, const std::string& name) const {
  int64_t c = 0;  // a variable and a narrowed copy of it (var_in) may both appear
  for (auto& t : a.terms)
    if (atoms_[t.atom].kind == IndexAtom::Kind::Var && atoms_[t.atom].name == name) c += t.coeff;
  return c;
}

int64_t IndexContext::evaluate(const IndexExpr& a, const std::vector<std::pair<std::string, int64_t>>& vars) const {
  int64_t v = a.constant;
  for (auto& t : a.terms) {
    const IndexAtom& atom = atoms_[t.atom];
    int64_t x = 0;
    if (atom.kind == IndexAtom::Kind::Var) {
      for (auto& [name, value] : vars)
        if (name == atom.name) x = value - atom.shift;
    } else {
      // Generated C uses truncating / and %; only non-negative operands reach them.
      int64_t inner = evaluate(inners_[atom.inner], vars);
      x = atom.kind == IndexAtom::Kind::Div ? inner / atom.divisor : inner % atom.divisor;
    }
    v += t.coeff * x;
  }
  return v;
}

std::string IndexContext::render(const IndexExpr& a) const {
  std::string s;
  for (auto& t : a.terms) {
    const IndexAtom& atom = atoms_[t.atom];
    std::string name = atom.kind == IndexAtom::Kind::Var
                           ? (atom.shift == 0 ? atom.name : fmt::format("({} - {})", atom.name, atom.shift))
                           : fmt::format("(({}){}{})", render(inners_[atom.inner]),
                                         atom.kind == IndexAtom::Kind::Div ? "/" : "%", atom.divisor);
    std::string term = t.coeff == 1 ? name : fmt::format("{}*{}", t.coeff, name);
    if (s.empty()) s = term;
    else if (t.coeff < 0) s += fmt::format(" - {}", t.coeff == -1 ? name : fmt::format("{}*{}", -t.coeff, name));
    else s += " + " + term;
  }
  if (s.empty()) return std::to_string(a.constant);
  if (a.constant > 0) s += fmt::format(" + {}", a.constant);
  if (a.constant < 0) s += fmt::format(" - {}", -a.constant);
  return s;
}

IndexExpr linear_index(IndexContext& ctx, const std::vector<IndexExpr>& idx, const Shape& shape) {
  IndexExpr r = ctx.constant(0);
  auto strides = contiguous_strides(shape);
  for (size_t d = 0; d < idx.size(); ++d) r = ctx.add(r, ctx.scale(idx[d], strides[d]));
  return r;
}

std::vector<IndexExpr> unflatten(IndexContext& ctx, const IndexExpr& flat, const Shape& shape) {
  std::vector<IndexExpr> idx(shape.size());
  auto strides = contiguous_strides(shape);
  for (size_t d = 0; d < shape.size(); ++d)
    idx[d] = d == 0 ? ctx.div(flat, strides[0]) : ctx.mod(ctx.div(flat, strides[d]), shape[d]);
  return idx;
}

std::vector<IndexExpr> view_source_index(IndexContext& ctx, const Node& view, const std::vector<IndexExpr>& idx,
                                         std::vector<Guard>* guards) {
  const Shape& src = view.inputs[0]->shape;
  const size_t r = src.size();
  std::vector<IndexExpr> in(r, ctx.constant(0));
  switch (view.op) {
    case Op::Reshape:
      in = unflatten(ctx, linear_index(ctx, idx, view.shape), src);
      // Under a pad, idx may range past the shape; keep the outermost index inside the input.
      if (r > 0 && ctx.max(in[0]) >= src[0]) in[0] = ctx.mod(in[0], src[0]);
      break;
    case Op::Permute:
      for (size_t d = 0; d < idx.size(); ++d) in[view.ints[d]] = idx[d];
      break;
    case Op::Expand:
      for (size_t d = 0; d < idx.size(); ++d) in[d] = src[d] == 1 ? ctx.constant(0) : idx[d];
      break;
    case Op::Slice:
      for (size_t d = 0; d < r; ++d) in[d] = ctx.add(ctx.scale(idx[d], view.ints[r + d]), ctx.constant(view.ints[d]));
      break;
    case Op::Pad:
      KILN_CHECK(guards != nullptr, "jit", "a pad cannot be read as a strided view");
      for (size_t d = 0; d < r; ++d) {
        in[d] = ctx.add(idx[d], ctx.constant(-view.ints[d]));
        if (view.ints[d] == 0 && view.ints[r + d] == 0) continue;
        guards->push_back({in[d], 0, src[d]});
        // What the pad's input sees of a loop variable is only the part the guard lets through:
        // narrowed, its reshapes fold (a concatenation's pieces read as plain rows).
        // x may already be a narrowed copy (an enclosing pad's): the variable minus its shift.
        const IndexExpr& x = idx[d];
        if (x.constant == 0 && x.terms.size() == 1 && x.terms[0].coeff == 1) {
          const IndexAtom atom = ctx.atoms()[x.terms[0].atom];
          const int64_t shift = atom.shift, before = view.ints[d];
          if (atom.kind == IndexAtom::Kind::Var)
            in[d] = ctx.add(ctx.var_in(atom.name, shift + atom.whole_max + 1, shift + std::max(atom.min, before),
                                       shift + std::min(atom.max, before + src[d] - 1)),
                            ctx.constant(-shift - before));
        }
      }
      break;
    default: KILN_FAIL("jit", "{} is not a view", op_name(view.op));
  }
  return in;
}

}  // namespace kiln::jit
