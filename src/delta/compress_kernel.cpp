#include "compress_kernel.h"

// GCC 12's AVX-512 headers trip its own uninitialized-variable warnings (_mm512_undefined_*).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
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

__attribute__((target("avx512f"))) RowSums compress_row_avx512(const float* base, const float* ft, size_t n,
                                                                  uint8_t* signs) {
  const __m512 zero = _mm512_setzero_ps();
  __m512d abs0 = _mm512_setzero_pd(), abs1 = _mm512_setzero_pd();
  __m512d sq0 = _mm512_setzero_pd(), sq1 = _mm512_setzero_pd();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(ft + i), _mm512_loadu_ps(base + i));
    const __mmask16 ge = _mm512_cmp_ps_mask(d, zero, _CMP_GE_OQ);
    std::memcpy(signs + i / 8, &ge, 2);  // x86 is little-endian: bit j of the mask is element i+j
    const __m512 a = _mm512_abs_ps(d);
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(a));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    abs0 = _mm512_add_pd(abs0, lo);
    abs1 = _mm512_add_pd(abs1, hi);
    sq0 = _mm512_fmadd_pd(lo, lo, sq0);
    sq1 = _mm512_fmadd_pd(hi, hi, sq1);
  }
  RowSums s;
  s.abs = _mm512_reduce_add_pd(_mm512_add_pd(abs0, abs1));
  s.sq = _mm512_reduce_add_pd(_mm512_add_pd(sq0, sq1));
  if (i < n) {
    const RowSums tail = compress_row_scalar(base + i, ft + i, n - i, signs + i / 8);
    s.abs += tail.abs;
    s.sq += tail.sq;
  }
  return s;
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

}  // namespace

RowSums compress_row(const float* base, const float* ft, size_t n, uint8_t* signs) {
  return has_avx512() ? compress_row_avx512(base, ft, n, signs) : compress_row_scalar(base, ft, n, signs);
}

}  // namespace bitdelta
