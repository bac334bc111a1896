// Symbolic integer index expressions: affine sums of loop variables and of div/mod atoms, with
// value ranges, so that views (permute, expand, slice, pad, reshape) fold into one address
// computation and reshapes of contiguous data simplify back to affine form.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/node.h"

namespace kiln::jit {

struct IndexExpr;

// An atom is a loop variable or the quotient/remainder of an expression by a constant.
struct IndexAtom {
  enum class Kind { Var, Div, Mod } kind;
  std::string name;           // Var: the C name of the loop variable
  int inner = -1;             // Div/Mod: index of the inner expression in IndexContext::exprs
  int64_t divisor = 1;
  int64_t min = 0, max = 0;   // inclusive range
  // Var: the atom is the loop variable minus `shift`, and whole_min/whole_max its range over the
  // whole loop when [min, max] is narrower (read under a pad's guard: IndexContext::var_in).
  int64_t shift = 0;
  int64_t whole_min = 0, whole_max = 0;
};

struct IndexTerm {
  int64_t coeff;
  int atom;
};

struct IndexExpr {
  std::vector<IndexTerm> terms;  // sorted by atom, no zero coefficients
  int64_t constant = 0;
};

// Owns the atoms of one kernel; expressions refer to atoms by position.
class IndexContext {
 public:
  IndexExpr var(const std::string& name, int64_t extent);  // 0 <= v < extent
  // Loop variable `name` of a loop over [0, extent) where only lo <= v <= hi matters: under a
  // pad's guard. Returned as lo + (v - lo) with the atom v - lo in [0, hi - lo], so expressions
  // simplify as if the loop started at lo (what the guard lets through reads the right element);
  // whole_min/whole_max still bound them over the whole loop.
  IndexExpr var_in(const std::string& name, int64_t extent, int64_t lo, int64_t hi);
  IndexExpr constant(int64_t c) const { return IndexExpr{{}, c}; }
  IndexExpr add(const IndexExpr& a, const IndexExpr& b) const;
  IndexExpr scale(const IndexExpr& a, int64_t c) const;
  IndexExpr div(const IndexExpr& a, int64_t d);
  IndexExpr mod(const IndexExpr& a, int64_t d);
  int64_t min(const IndexExpr& a) const;
  int64_t max(const IndexExpr& a) const;
  // Bounds over every iteration of the loops, narrowed variables included.
  int64_t whole_min(const IndexExpr& a) const;
  int64_t whole_max(const IndexExpr& a) const;
  // True when the expression uses only loop variables (no div/mod atoms).
  bool is_affine(const IndexExpr& a) const;
  // True when loop variable `var` appears only as a plain term (never inside a div/mod atom), so
  // a loop over it walks the address with a constant stride.
  bool affine_in(const IndexExpr& a, const std::string& var) const;
  // Coefficient of the loop variable `name` (0 when absent or hidden inside a div/mod).
  int64_t coefficient(const IndexExpr& a, const std::string& name) const;
  // The value of an affine expression where every loop variable is 0 (its constant, less what
  // shifted variables take away).
  int64_t offset(const IndexExpr& a) const;
  std::string render(const IndexExpr& a) const;
  // The value for given loop-variable values (by name); for tests and debugging.
  int64_t evaluate(const IndexExpr& a, const std::vector<std::pair<std::string, int64_t>>& vars) const;
  const std::vector<IndexAtom>& atoms() const { return atoms_; }

 private:
  bool uses_var(const IndexExpr& a, const std::string& var) const;
  std::pair<int64_t, int64_t> whole_range(const IndexAtom& atom) const;
  std::pair<int64_t, int64_t> whole_bounds(const IndexExpr& a) const;
  int intern(IndexAtom atom);
  std::vector<IndexAtom> atoms_;
  std::vector<IndexExpr> inners_;
};

// lo <= expr < hi: whether a padded view reads real data at this index.
struct Guard {
  IndexExpr expr;
  int64_t lo = 0, hi = 0;
};

// The row-major linear index of multi-index `idx` into `shape`, and its inverse: the multi-index
// of linear index `flat` (div/mod atoms, which reshapes of contiguous data fold back).
IndexExpr linear_index(IndexContext& ctx, const std::vector<IndexExpr>& idx, const Shape& shape);
std::vector<IndexExpr> unflatten(IndexContext& ctx, const IndexExpr& flat, const Shape& shape);

// The element of a movement op's input (reshape, permute, expand, slice, pad) that its output
// element `idx` reads: the one place views become index arithmetic, for fused kernels and
// library operands alike. For a pad, the guards under which the read is real data (elsewhere the
// pad yields zero) are appended to `guards`; a pad without a `guards` vector is an error.
std::vector<IndexExpr> view_source_index(IndexContext& ctx, const Node& view, const std::vector<IndexExpr>& idx,
                                         std::vector<Guard>* guards = nullptr);

}  // namespace kiln::jit
