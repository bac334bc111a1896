// Element types, their sizes and names, and the promotion rule binary ops use.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace kiln {

enum class DType : uint8_t { Bool, UInt8, Int8, Int32, Int64, Float16, BFloat16, Float32, Float64 };
inline constexpr int kNumDTypes = 9;

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);
DType dtype_from_name(std::string_view name);  // throws kiln::Error on unknown names
bool is_floating(DType t);
bool is_integral(DType t);  // bool counts as integral
// Result type of a binary op: the "larger" kind wins (bool < ints < floats), as in PyTorch
// for tensor-tensor operands; float16 with bfloat16 gives float32.
DType promote(DType a, DType b);

// C++ type a host-side value of each dtype is read/written as.
template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<bool>() { return DType::Bool; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::UInt8; }
template <> constexpr DType dtype_of<int8_t>() { return DType::Int8; }
template <> constexpr DType dtype_of<int32_t>() { return DType::Int32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::Int64; }
template <> constexpr DType dtype_of<float>() { return DType::Float32; }
template <> constexpr DType dtype_of<double>() { return DType::Float64; }

// Half-precision conversions on the host (round to nearest even).
uint16_t float_to_half(float f);
float half_to_float(uint16_t h);
uint16_t float_to_bfloat16(float f);
float bfloat16_to_float(uint16_t b);

// Reads element i of a buffer of dtype t as double / writes a double into it (with rounding).
double load_as_double(const void* data, DType t, size_t i);
void store_from_double(void* data, DType t, size_t i, double v);

}  // namespace kiln
