#include "core/dtype.h"

#include <bit>
#include <cstring>

#include "core/error.h"

namespace kiln {

namespace {
struct DTypeInfo {
  std::string_view name;
  size_t size;
  int rank;  // promotion order
};
constexpr DTypeInfo kInfo[kNumDTypes] = {
    {"bool", 1, 0},     {"uint8", 1, 1},    {"int8", 1, 1},     {"int32", 4, 2},    {"int64", 8, 3},
    {"float16", 2, 4},  {"bfloat16", 2, 4}, {"float32", 4, 5},  {"float64", 8, 6},
};
}  // namespace

size_t dtype_size(DType t) { return kInfo[static_cast<int>(t)].size; }
std::string_view dtype_name(DType t) { return kInfo[static_cast<int>(t)].name; }

DType dtype_from_name(std::string_view name) {
  for (int i = 0; i < kNumDTypes; ++i)
    if (kInfo[i].name == name) return static_cast<DType>(i);
  if (name == "float" || name == "f32") return DType::Float32;
  if (name == "double" || name == "f64") return DType::Float64;
  if (name == "half" || name == "fp16" || name == "f16") return DType::Float16;
  if (name == "bf16") return DType::BFloat16;
  KILN_FAIL("dtype", "unknown dtype '{}'", name);
}

bool is_floating(DType t) { return kInfo[static_cast<int>(t)].rank >= 4; }
bool is_integral(DType t) { return !is_floating(t); }

DType promote(DType a, DType b) {
  if (a == b) return a;
  int ra = kInfo[static_cast<int>(a)].rank, rb = kInfo[static_cast<int>(b)].rank;
  if (ra == rb) {
    if (ra == 4) return DType::Float32;  // float16 with bfloat16
    return DType::Int32;                 // uint8 with int8: no 8-bit type holds both
  }
  return ra > rb ? a : b;
}

// clang before 15 has no _Float16 on x86 (the fuzz build, tests/fuzz, uses Debian's clang 14);
// its __fp16 is the same IEEE binary16 as a storage type, converted with the same rounding.
#if defined(__clang__) && __clang_major__ < 15
using Half = __fp16;
#else
using Half = _Float16;
#endif
// memcpy, not bit_cast: a function cannot return an __fp16.
uint16_t float_to_half(float f) {
  Half h = static_cast<Half>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}
float half_to_float(uint16_t bits) {
  Half h;
  std::memcpy(&h, &bits, sizeof h);
  return static_cast<float>(h);
}

uint16_t float_to_bfloat16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
float bfloat16_to_float(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

namespace {
// Element i of a packed array through memcpy: files pack tensors back to back, so an element may
// sit at any address (a float16 at an odd one), and a byte of a bool array may hold any value.
template <typename T>
T element(const void* data, size_t i) {
  T v;
  std::memcpy(&v, static_cast<const char*>(data) + i * sizeof(T), sizeof(T));
  return v;
}
template <typename T>
void set_element(void* data, size_t i, T v) {
  std::memcpy(static_cast<char*>(data) + i * sizeof(T), &v, sizeof(T));
}
}  // namespace

double load_as_double(const void* data, DType t, size_t i) {
  switch (t) {
    case DType::Bool: return element<uint8_t>(data, i) != 0 ? 1.0 : 0.0;
    case DType::UInt8: return element<uint8_t>(data, i);
    case DType::Int8: return element<int8_t>(data, i);
    case DType::Int32: return element<int32_t>(data, i);
    case DType::Int64: return static_cast<double>(element<int64_t>(data, i));
    case DType::Float16: return half_to_float(element<uint16_t>(data, i));
    case DType::BFloat16: return bfloat16_to_float(element<uint16_t>(data, i));
    case DType::Float32: return element<float>(data, i);
    case DType::Float64: return element<double>(data, i);
  }
  return 0;
}

void store_from_double(void* data, DType t, size_t i, double v) {
  switch (t) {
    case DType::Bool: set_element<uint8_t>(data, i, v != 0); break;
    case DType::UInt8: set_element(data, i, static_cast<uint8_t>(v)); break;
    case DType::Int8: set_element(data, i, static_cast<int8_t>(v)); break;
    case DType::Int32: set_element(data, i, static_cast<int32_t>(v)); break;
    case DType::Int64: set_element(data, i, static_cast<int64_t>(v)); break;
    case DType::Float16: set_element(data, i, float_to_half(static_cast<float>(v))); break;
    case DType::BFloat16: set_element(data, i, float_to_bfloat16(static_cast<float>(v))); break;
    case DType::Float32: set_element(data, i, static_cast<float>(v)); break;
    case DType::Float64: set_element(data, i, v); break;
  }
}

}  // namespace kiln
