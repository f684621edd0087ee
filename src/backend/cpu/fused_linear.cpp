#include "fused_linear.h"

#include <immintrin.h>

#include <array>
#include <cstring>
#include <vector>

#include "bitdelta/error.h"

namespace bitdelta::cpu {

namespace {

float load_alpha(const DeltaRef& d, size_t n) {
  float a;
  std::memcpy(&a, d.alpha + (d.alpha_per_row ? n : 0), 4);
  return a;
}

// --- plain path -------------------------------------------------------------------------------

void linear_rows_scalar(const TensorView& w, const float* x, size_t rows, const DeltaRef* deltas, const float* bias,
                        float* y, size_t n0, size_t n1) {
  const size_t K = w.shape[1], N = w.shape[0];
  const size_t esize = dtype_size(w.dtype), row_bytes = (K + 7) / 8;
  std::vector<float> wrow(K);
  for (size_t n = n0; n < n1; ++n) {
    to_f32(w.dtype, w.data.data() + n * K * esize, wrow.data(), K);
    for (size_t r = 0; r < rows; ++r) {
      const float* xr = x + r * K;
      float acc = 0, bits_x = 0, sum_x = 0;
      const DeltaRef& d = deltas[r];
      for (size_t k = 0; k < K; ++k) acc += wrow[k] * xr[k];
      if (d.signs) {
        const uint8_t* s = d.signs + n * row_bytes;
        for (size_t k = 0; k < K; ++k) {
          sum_x += xr[k];
          if ((s[k / 8] >> (k % 8)) & 1) bits_x += xr[k];
        }
        acc += load_alpha(d, n) * (2 * bits_x - sum_x);  // S·x = 2·(bits·x) − Σx
      }
      y[r * N + n] = acc + (bias ? bias[n] : 0.0f);
    }
  }
}

// --- AVX2 path --------------------------------------------------------------------------------

// Bit j of a sign byte -> lane j all-ones: one load instead of three instructions per byte.
const std::array<std::array<int32_t, 8>, 256>& mask_table() {
  static const auto table = [] {
    std::array<std::array<int32_t, 8>, 256> t{};
    for (int b = 0; b < 256; ++b)
      for (int j = 0; j < 8; ++j) t[size_t(b)][size_t(j)] = (b >> j) & 1 ? -1 : 0;
    return t;
  }();
  return table;
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(DType t, const std::byte* p) {
  switch (t) {
    case DType::BF16:
      return _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
    case DType::F16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    default:
      return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

constexpr size_t kTile = 4;  // batch rows whose accumulators stay in registers

// Output rows [n0, n1) for batch rows [r0, r0+nr), nr <= kTile.
template <size_t NR>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const TensorView& w, const float* x, const DeltaRef* deltas,
                                                        const float* sum_x, const float* bias, float* y, size_t N,
                                                        size_t n0, size_t n1) {
  const size_t K = w.shape[1], esize = dtype_size(w.dtype), row_bytes = (K + 7) / 8;
  const size_t K8 = K / 8 * 8;
  const auto& table = mask_table();
  for (size_t n = n0; n < n1; ++n) {
    const std::byte* wrow = w.data.data() + n * K * esize;
    __m256 acc[NR], dacc[NR];
    const uint8_t* srow[NR];
    for (size_t r = 0; r < NR; ++r) {
      acc[r] = _mm256_setzero_ps();
      dacc[r] = _mm256_setzero_ps();
      srow[r] = deltas[r].signs ? deltas[r].signs + n * row_bytes : nullptr;
    }
    for (size_t k = 0; k < K8; k += 8) {
      const __m256 wv = load8(w.dtype, wrow + k * esize);
      for (size_t r = 0; r < NR; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * K + k);
        acc[r] = _mm256_fmadd_ps(wv, xv, acc[r]);
        if (srow[r]) {
          const __m256 m = _mm256_castsi256_ps(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(table[srow[r][k / 8]].data())));
          dacc[r] = _mm256_add_ps(dacc[r], _mm256_and_ps(m, xv));  // bits·x
        }
      }
    }
    for (size_t r = 0; r < NR; ++r) {
      float a = hsum(acc[r]), bits_x = hsum(dacc[r]);
      if (K8 < K) {
        float tail[8] = {};
        to_f32(w.dtype, wrow + K8 * esize, tail, K - K8);
        for (size_t k = K8; k < K; ++k) {
          const float xv = x[r * K + k];
          a += tail[k - K8] * xv;
          if (srow[r] && ((srow[r][k / 8] >> (k % 8)) & 1)) bits_x += xv;
        }
      }
      if (srow[r]) a += load_alpha(deltas[r], n) * (2 * bits_x - sum_x[r]);
      y[r * N + n] = a + (bias ? bias[n] : 0.0f);
    }
  }
}

__attribute__((target("avx2,fma,f16c"))) void linear_rows_avx2(const TensorView& w, const float* x, size_t rows,
                                                              const DeltaRef* deltas, const float* sum_x,
                                                              const float* bias, float* y, size_t n0, size_t n1) {
  const size_t K = w.shape[1], N = w.shape[0];
  // Blocks of output rows small enough that their weights stay in L1/L2 while every row tile
  // passes over them: the base is read from memory once per call.
  const size_t block = std::max<size_t>(1, (32u << 10) / std::max<size_t>(1, K * dtype_size(w.dtype)));
  for (size_t b0 = n0; b0 < n1; b0 += block) {
    const size_t b1 = std::min(n1, b0 + block);
    for (size_t r = 0; r < rows; r += kTile) {
      const size_t nr = std::min(kTile, rows - r);
      const float* xr = x + r * K;
      float* yr = y + r * N;
      switch (nr) {
        case 1: tile_avx2<1>(w, xr, deltas + r, sum_x + r, bias, yr, N, b0, b1); break;
        case 2: tile_avx2<2>(w, xr, deltas + r, sum_x + r, bias, yr, N, b0, b1); break;
        case 3: tile_avx2<3>(w, xr, deltas + r, sum_x + r, bias, yr, N, b0, b1); break;
        default: tile_avx2<4>(w, xr, deltas + r, sum_x + r, bias, yr, N, b0, b1); break;
      }
    }
  }
}

bool has_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return yes;
}

void check_shapes(const TensorView& w, std::span<const float> x, size_t rows, std::span<const DeltaRef> deltas,
                  std::span<float> y) {
  if (w.shape.size() != 2 || !is_float(w.dtype)) fail("fused_linear: weight must be a 2-D float tensor");
  if (x.size() != rows * w.shape[1] || y.size() != rows * w.shape[0] || deltas.size() != rows)
    fail("fused_linear: x, y or deltas do not match ", rows, " rows of weight ", shape_str(w.shape));
}

}  // namespace

void fused_linear(const TensorView& w, std::span<const float> x, size_t rows, std::span<const DeltaRef> deltas,
                  const float* bias, std::span<float> y, ThreadPool& pool) {
  check_shapes(w, x, rows, deltas, y);
  const size_t K = w.shape[1], N = w.shape[0];
  std::vector<float> sum_x(rows, 0.0f);
  for (size_t r = 0; r < rows; ++r)
    if (deltas[r].signs)
      for (size_t k = 0; k < K; ++k) sum_x[r] += x[r * K + k];
  pool.parallel_for(N, [&](size_t n0, size_t n1) {
    if (has_avx2())
      linear_rows_avx2(w, x.data(), rows, deltas.data(), sum_x.data(), bias, y.data(), n0, n1);
    else
      linear_rows_scalar(w, x.data(), rows, deltas.data(), bias, y.data(), n0, n1);
  });
}

void fused_linear_reference(const TensorView& w, std::span<const float> x, size_t rows,
                            std::span<const DeltaRef> deltas, const float* bias, std::span<float> y) {
  check_shapes(w, x, rows, deltas, y);
  const size_t K = w.shape[1], N = w.shape[0], esize = dtype_size(w.dtype), row_bytes = (K + 7) / 8;
  std::vector<float> weff(K);
  for (size_t r = 0; r < rows; ++r) {
    const DeltaRef& d = deltas[r];
    for (size_t n = 0; n < N; ++n) {
      to_f32(w.dtype, w.data.data() + n * K * esize, weff.data(), K);
      if (d.signs) {
        const float a = load_alpha(d, n);
        for (size_t k = 0; k < K; ++k) weff[k] += (d.signs[n * row_bytes + k / 8] >> (k % 8)) & 1 ? a : -a;
      }
      double acc = bias ? bias[n] : 0.0;
      for (size_t k = 0; k < K; ++k) acc += double(weff[k]) * double(x[r * K + k]);
      y[r * N + n] = float(acc);
    }
  }
}

}  // namespace bitdelta::cpu
