#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "bitdelta/dtype.h"

namespace bitdelta {
namespace {

// Independent references: exact float64 arithmetic on the bit patterns.
double bf16_reference(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 7) & 0xff, man = h & 0x7f;
  if (exp == 0xff) return man ? NAN : (sign ? -INFINITY : INFINITY);
  const double mag = exp == 0 ? std::ldexp(man, -133) : std::ldexp(128 + man, exp - 134);
  return sign ? -mag : mag;
}

double f16_reference(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return man ? NAN : (sign ? -INFINITY : INFINITY);
  const double mag = exp == 0 ? std::ldexp(man, -24) : std::ldexp(1024 + man, exp - 25);
  return sign ? -mag : mag;
}

TEST(DType, Bf16ToF32IsExactForEveryPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const double ref = bf16_reference(uint16_t(h));
    const float got = bf16_to_f32(uint16_t(h));
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      EXPECT_EQ(double(got), ref) << h;
      EXPECT_EQ(f32_to_bf16(got), h) << "round trip " << h;
    }
  }
}

TEST(DType, F16ToF32IsExactForEveryPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const double ref = f16_reference(uint16_t(h));
    const float got = f16_to_f32(uint16_t(h));
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      EXPECT_EQ(double(got), ref) << h;
      EXPECT_EQ(f32_to_f16(got), h) << "round trip " << h;
    }
  }
}

// Rounding to the nearest representable value, ties to even, checked against the neighbours.
template <typename ToHalf, typename FromHalf>
void check_rounding(ToHalf to_half, FromHalf from_half, uint64_t seed) {
  std::srand(unsigned(seed));
  for (int i = 0; i < 200000; ++i) {
    uint32_t bits = (uint32_t(std::rand()) << 16) ^ uint32_t(std::rand());
    float f;
    std::memcpy(&f, &bits, 4);
    if (!std::isfinite(f)) continue;
    const uint16_t h = to_half(f);
    const double got = from_half(h);
    if (std::isinf(got)) continue;  // overflow: covered by the pattern tests' range
    // No representable neighbour is strictly closer.
    for (int step : {-1, 1}) {
      const uint16_t n = uint16_t(h + step);
      const double other = from_half(n);
      if (std::isnan(other) || std::isinf(other) || std::signbit(other) != std::signbit(got)) continue;
      const double d_got = std::fabs(double(f) - got), d_other = std::fabs(double(f) - other);
      ASSERT_LE(d_got, d_other) << f;
      if (d_got == d_other) {
        ASSERT_EQ(h & 1, 0) << "tie not to even for " << f;
      }
    }
  }
}

TEST(DType, F32ToBf16RoundsToNearestEven) { check_rounding(f32_to_bf16, bf16_reference, 1); }
TEST(DType, F32ToF16RoundsToNearestEven) { check_rounding(f32_to_f16, f16_reference, 2); }

TEST(DType, Names) {
  EXPECT_EQ(dtype_from_name("BF16"), DType::BF16);
  EXPECT_EQ(dtype_size(DType::I32), 4u);
  EXPECT_FALSE(dtype_from_name("Q4_K").has_value());
  EXPECT_EQ(dtype_name(DType::F8_E4M3), "F8_E4M3");
}

}  // namespace
}  // namespace bitdelta
