// A float16 / bfloat16 product of a value of its type and a bool made a number (0 or 1) is the
// value or a zero: the JIT stores it without rounding (jit/render_common.cc, masks_a_value), in
// either operand order, with the same bits as rounding would give for every value. A float-precision
// scalar or any other cast factor is still rounded.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "tests/support/compare.h"
#include "tests/support/kernel_source.h"

using namespace kiln;
using kiln::testing::f32;
using kiln::testing::kInf;
using kiln::testing::kNaN;

namespace {


const char* rounding_of(DType t) { return t == DType::BFloat16 ? "kiln_round_bf" : "kiln_round_h"; }

}  // namespace

TEST_CASE("half-type products with a 0/1 mask: exact without rounding, the rest rounded", "[cpu][jit][dtype]") {
  // (1 + 2^-7 and 1 + 2^-10: every mantissa bit of bfloat16 and float16 in use, so 3x is not exact.)
  const std::vector<double> values = {1.5,  -2.25, 0.0,  -0.0, 3e38, kInf, -kInf, kNaN, 1e-39,
                                      0.3,  1.0 + std::ldexp(1.0, -7), -1.0 - std::ldexp(1.0, -10)};
  const std::vector<bool> keep = {true, false, true, false, true, false, true, false, true, true, true, true};
  const int64_t n = static_cast<int64_t>(keep.size());
  const Tensor mask = from_vector<bool>(keep, {n});
  const Tensor threes = from_vector<int8_t>(std::vector<int8_t>(keep.size(), 3), {n});
  for (DType t : {DType::BFloat16, DType::Float16}) {
    INFO(dtype_name(t));
    auto round = [&](double v) {
      const float f = static_cast<float>(v);
      return t == DType::BFloat16 ? bfloat16_to_float(float_to_bfloat16(f)) : half_to_float(float_to_half(f));
    };
    const Tensor x = cast(f32(values), t).realize();
    const std::vector<float> xs = x.cast(DType::Float32).to_vector<float>();
    const Tensor masked = x * cast(mask, t), masked_first = cast(mask, t) * x;
    const Tensor tripled = x * cast(threes, t);              // not exact: rounded
    const Tensor scaled = scalar(0.3, t) * cast(mask, t);    // a float-precision scalar: rounded
    // The rule fires where it may and nowhere else (the products are what each kernel stores).
    CHECK(testing::cpu_source_of(masked).find(rounding_of(t)) == std::string::npos);
    CHECK(testing::cpu_source_of(masked_first).find(rounding_of(t)) == std::string::npos);
    CHECK(testing::cpu_source_of(tripled).find(rounding_of(t)) != std::string::npos);
    CHECK(testing::cpu_source_of(scaled).find(rounding_of(t)) != std::string::npos);
    // The values, read through a float32 cast fused into the same kernel: a float16 store rounds
    // anyway, so only there would a product wrongly left unrounded show.
    const std::vector<float> m = masked.cast(DType::Float32).to_vector<float>();
    const std::vector<float> mf = masked_first.cast(DType::Float32).to_vector<float>();
    const std::vector<float> p = tripled.cast(DType::Float32).to_vector<float>();
    const std::vector<float> s = scaled.cast(DType::Float32).to_vector<float>();
    for (size_t i = 0; i < values.size(); ++i) {
      INFO("element " << i << ": " << xs[i]);
      const float want_m = round(static_cast<double>(xs[i]) * (keep[i] ? 1.0 : 0.0));
      const float want_p = round(static_cast<double>(xs[i]) * 3.0);
      for (float got : {m[i], mf[i]}) {
        if (std::isnan(want_m)) CHECK(std::isnan(got));
        else CHECK((got == want_m && std::signbit(got) == std::signbit(want_m)));
      }
      if (std::isnan(want_p)) CHECK(std::isnan(p[i]));
      else CHECK(p[i] == want_p);
      CHECK(s[i] == (keep[i] ? round(0.3) : 0.0f));
    }
  }
}
