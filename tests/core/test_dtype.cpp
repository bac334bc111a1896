// DTypes, promotion, half conversions and shapes.
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

using namespace kiln;

TEST_CASE("dtype promotion follows bool < ints < floats", "[dtype]") {
  CHECK(promote(DType::Bool, DType::Int32) == DType::Int32);
  CHECK(promote(DType::Int32, DType::Int64) == DType::Int64);
  CHECK(promote(DType::Int64, DType::Float16) == DType::Float16);
  CHECK(promote(DType::Float16, DType::BFloat16) == DType::Float32);
  CHECK(promote(DType::Float32, DType::Float64) == DType::Float64);
  CHECK(promote(DType::UInt8, DType::Int8) == DType::Int32);
  CHECK(dtype_size(DType::BFloat16) == 2);
  CHECK(dtype_from_name("bf16") == DType::BFloat16);
  REQUIRE_THROWS_AS(dtype_from_name("float7"), Error);
}

TEST_CASE("half and bfloat16 conversions round to nearest even", "[dtype]") {
  CHECK(half_to_float(float_to_half(1.0f)) == 1.0f);
  CHECK(half_to_float(float_to_half(65504.0f)) == 65504.0f);
  CHECK(bfloat16_to_float(float_to_bfloat16(1.0f)) == 1.0f);
  // 1 + 2^-8 lies exactly between two bfloat16 values: ties go to the even mantissa (1.0).
  CHECK(bfloat16_to_float(float_to_bfloat16(1.0f + 1.0f / 256)) == 1.0f);
  CHECK(bfloat16_to_float(float_to_bfloat16(1.0f + 3.0f / 256)) == 1.0f + 4.0f / 256);
  CHECK(std::isnan(bfloat16_to_float(float_to_bfloat16(std::nanf("")))));
}

TEST_CASE("broadcasting and axes", "[shape]") {
  CHECK(broadcast_shapes({3, 1}, {1, 4}, "t") == Shape{3, 4});
  CHECK(broadcast_shapes({5}, {2, 1}, "t") == Shape{2, 5});
  REQUIRE_THROWS_WITH(broadcast_shapes({3, 2}, {4, 2}, "myop"), Catch::Contains("myop") && Catch::Contains("[3, 2]"));
  CHECK(normalize_axis(-1, 3, "t") == 2);
  REQUIRE_THROWS_AS(normalize_axis(3, 3, "t"), Error);
  CHECK(contiguous_strides({2, 3, 4}) == std::vector<int64_t>{12, 4, 1});
}
