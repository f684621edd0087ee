// Element types of safetensors files and conversions between the floating ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace bitdelta {

// Every dtype the safetensors format names; the engine computes with BF16, F16 and F32.
enum class DType : uint8_t {
  BOOL, U8, I8, U16, I16, F16, BF16, U32, I32, F32, U64, I64, F64, F8_E4M3, F8_E5M2
};

std::optional<DType> dtype_from_name(std::string_view name);
std::string_view dtype_name(DType t);
size_t dtype_size(DType t);
bool is_float(DType t);  // BF16, F16, F32: the dtypes weights may have

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even; NaN stays NaN (quiet).
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);  // round to nearest even

// Converts n elements of a floating dtype (BF16, F16, F32) to float; src may be unaligned.
void to_f32(DType t, const std::byte* src, float* dst, size_t n);
// Converts n floats into a floating dtype (BF16, F16, F32), rounding to nearest even.
void from_f32(DType t, const float* src, std::byte* dst, size_t n);

}  // namespace bitdelta
