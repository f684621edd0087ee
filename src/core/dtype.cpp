#include "bitdelta/dtype.h"

#include <array>
#include <immintrin.h>

#include <cmath>

#include "bitdelta/error.h"

namespace bitdelta {
namespace {

struct DTypeInfo {
  DType type;
  std::string_view name;
  size_t size;
};

constexpr std::array<DTypeInfo, 15> kDTypes{{
    {DType::BOOL, "BOOL", 1},   {DType::U8, "U8", 1},         {DType::I8, "I8", 1},
    {DType::U16, "U16", 2},     {DType::I16, "I16", 2},       {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2},   {DType::U32, "U32", 4},       {DType::I32, "I32", 4},
    {DType::F32, "F32", 4},     {DType::U64, "U64", 8},       {DType::I64, "I64", 8},
    {DType::F64, "F64", 8},     {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
}};

}  // namespace

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& d : kDTypes)
    if (d.name == name) return d.type;
  return std::nullopt;
}

std::string_view dtype_name(DType t) { return kDTypes[size_t(t)].name; }
size_t dtype_size(DType t) { return kDTypes[size_t(t)].size; }
bool is_float(DType t) { return t == DType::BF16 || t == DType::F16 || t == DType::F32; }

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  float magnitude;
  if (exp == 0) {
    magnitude = std::ldexp(float(man), -24);  // zero or subnormal
  } else if (exp == 31) {
    magnitude = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    uint32_t bits = ((exp + 112) << 23) | (man << 13);
    std::memcpy(&magnitude, &bits, 4);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, 4);
  bits |= sign;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

uint16_t f32_to_f16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  bits &= 0x7fffffffu;
  if (bits > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (bits >= 0x477ff000u) return sign | 0x7c00u;  // rounds to infinity (>= 65520)
  if (bits < 0x38800000u) {                       // below the smallest normal: subnormal or 0
    float mag;
    std::memcpy(&mag, &bits, 4);
    // Scale so the subnormal unit (2^-24) becomes 1, then round to nearest even.
    return sign | uint16_t(std::nearbyint(mag * 16777216.0f));
  }
  uint32_t rounded = bits + 0xfffu + ((bits >> 13) & 1u);
  return sign | uint16_t((rounded - 0x38000000u) >> 13);
}

namespace {

void bf16_to_f32_scalar(const std::byte* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    dst[i] = bf16_to_f32(h);
  }
}

__attribute__((target("avx2"))) void bf16_to_f32_avx2(const std::byte* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  bf16_to_f32_scalar(src + 2 * i, dst + i, n - i);
}

__attribute__((target("avx2,f16c"))) void f16_to_f32_f16c(const std::byte* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i))));
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    dst[i] = f16_to_f32(h);
  }
}

bool cpu_has(const char* what) {
  __builtin_cpu_init();  // may run before libgcc's own constructor
  return what == std::string_view("f16c") ? __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")
                                          : __builtin_cpu_supports("avx2");
}
const bool kHasAvx2 = cpu_has("avx2");
const bool kHasF16c = cpu_has("f16c");

}  // namespace

void to_f32(DType t, const std::byte* src, float* dst, size_t n) {
  switch (t) {
    case DType::F32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::BF16:
      (kHasAvx2 ? bf16_to_f32_avx2 : bf16_to_f32_scalar)(src, dst, n);
      return;
    case DType::F16:
      if (kHasF16c) return f16_to_f32_f16c(src, dst, n);
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = f16_to_f32(h);
      }
      return;
    default:
      fail("cannot convert dtype ", dtype_name(t), " to float (expected BF16, F16 or F32)");
  }
}

void from_f32(DType t, const float* src, std::byte* dst, size_t n) {
  switch (t) {
    case DType::F32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h = f32_to_bf16(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h = f32_to_f16(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    default:
      fail("cannot convert float to dtype ", dtype_name(t), " (expected BF16, F16 or F32)");
  }
}

}  // namespace bitdelta
