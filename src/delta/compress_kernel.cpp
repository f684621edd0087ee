#include "compress_kernel.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>

namespace bitdelta {

RowSums compress_row_scalar(const float* base, const float* ft, size_t n, uint8_t* signs) {
  RowSums s;
  std::memset(signs, 0, (n + 7) / 8);
  for (size_t i = 0; i < n; ++i) {
    const float d = ft[i] - base[i];
    if (d >= 0) signs[i / 8] |= uint8_t(1u << (i % 8));
    const double a = std::fabs(double(d));
    s.abs += a;
    s.sq += a * a;
  }
  return s;
}

namespace {

// 8 floats per step: one sign byte straight from movemask (bit j = element j, LSB first).
__attribute__((target("avx2,fma"))) RowSums compress_row_avx2(const float* base, const float* ft, size_t n,
                                                               uint8_t* signs) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256d abs0 = _mm256_setzero_pd(), abs1 = _mm256_setzero_pd();
  __m256d sq0 = _mm256_setzero_pd(), sq1 = _mm256_setzero_pd();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(ft + i), _mm256_loadu_ps(base + i));
    signs[i / 8] = uint8_t(_mm256_movemask_ps(_mm256_cmp_ps(d, zero, _CMP_GE_OQ)));
    const __m256 a = _mm256_and_ps(d, abs_mask);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(a));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
    abs0 = _mm256_add_pd(abs0, lo);
    abs1 = _mm256_add_pd(abs1, hi);
    sq0 = _mm256_fmadd_pd(lo, lo, sq0);
    sq1 = _mm256_fmadd_pd(hi, hi, sq1);
  }
  alignas(32) double lanes[4];
  RowSums s;
  _mm256_store_pd(lanes, _mm256_add_pd(abs0, abs1));
  s.abs = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  _mm256_store_pd(lanes, _mm256_add_pd(sq0, sq1));
  s.sq = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  if (i < n) {
    const RowSums tail = compress_row_scalar(base + i, ft + i, n - i, signs + i / 8);
    s.abs += tail.abs;
    s.sq += tail.sq;
  }
  return s;
}

bool has_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
}

}  // namespace

RowSums compress_row(const float* base, const float* ft, size_t n, uint8_t* signs) {
  return has_avx2() ? compress_row_avx2(base, ft, n, signs) : compress_row_scalar(base, ft, n, signs);
}

}  // namespace bitdelta
