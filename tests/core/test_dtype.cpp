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

TEST_CASE("elements load and store at any address, and any bool byte reads as a truth value", "[dtype]") {
  // Files pack tensors back to back: a float16 may start at an odd byte.
  alignas(8) unsigned char buffer[24] = {};
  unsigned char* odd = buffer + 1;
  store_from_double(odd, DType::Float64, 1, 3.0);  // bytes 8..15 of `odd`
  store_from_double(odd, DType::Float16, 2, 1.5);  // bytes 4..5
  store_from_double(odd, DType::BFloat16, 3, -2.0);  // bytes 6..7
  CHECK(load_as_double(odd, DType::Float64, 1) == 3.0);
  CHECK(load_as_double(odd, DType::Float16, 2) == 1.5);
  CHECK(load_as_double(odd, DType::BFloat16, 3) == -2.0);
  store_from_double(buffer + 3, DType::Float32, 0, 0.25);
  CHECK(load_as_double(buffer + 3, DType::Float32, 0) == 0.25);
  const unsigned char bools[3] = {0, 1, 2};  // 2: a byte no bool holds, from a foreign file
  CHECK(load_as_double(bools, DType::Bool, 0) == 0.0);
  CHECK(load_as_double(bools, DType::Bool, 1) == 1.0);
  CHECK(load_as_double(bools, DType::Bool, 2) == 1.0);
}

TEST_CASE("a shape with more elements than int64 holds is an error, not a wrapped count", "[shape]") {
  CHECK(numel({int64_t{1} << 31, int64_t{1} << 31}) == int64_t{1} << 62);
  CHECK_THROWS_WITH(numel({int64_t{1} << 32, int64_t{1} << 32}), Catch::Contains("more elements than an int64 holds"));
}
