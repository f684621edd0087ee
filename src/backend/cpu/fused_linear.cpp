#include "fused_linear.h"

#include <cblas.h>
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

void linear_rows_scalar(const TensorView& w, const float* x, size_t rows, const DeltaRef* deltas,
                        const float* bias, float* y, size_t n0, size_t n1) {
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

// Bit j of a sign byte -> lane j: +0.0f where the bit is 1, −0.0f (only the sign bit) where it is
// 0. XOR with α gives the delta's ±α per lane (sign 1 = +α, sign 0 = −α) in one instruction.
const std::array<std::array<uint32_t, 8>, 256>& neg_table() {
  alignas(64) static const auto table = [] {
    std::array<std::array<uint32_t, 8>, 256> t{};
    for (int b = 0; b < 256; ++b)
      for (int j = 0; j < 8; ++j) t[size_t(b)][size_t(j)] = (b >> j) & 1 ? 0u : 0x80000000u;
    return t;
  }();
  return table;
}

// Bit j of a sign byte -> lane j: +1.0f or −1.0f.
const std::array<std::array<float, 8>, 256>& pm_table() {
  alignas(64) static const auto table = [] {
    std::array<std::array<float, 8>, 256> t{};
    for (int b = 0; b < 256; ++b)
      for (int j = 0; j < 8; ++j) t[size_t(b)][size_t(j)] = (b >> j) & 1 ? 1.0f : -1.0f;
    return t;
  }();
  return table;
}

template <DType T>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 load8(const std::byte* p) {
  if constexpr (T == DType::BF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  else if constexpr (T == DType::F16)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  else
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

constexpr size_t kTile = 4;  // batch rows per pass over a block of weights

// The batch rows one tile works on (not necessarily adjacent rows of x).
template <size_t NR>
struct TileRows {
  const float* x[NR];
  float* y[NR];
  const DeltaRef* d[NR];  // kDelta tiles: every row has a delta
};

// 8 weights (k .. k+7) of the NO output rows for the NR batch rows of a tile.
template <DType T, size_t NR, size_t NO, bool kDelta>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void tile_step(
    const std::byte* const (&wrow)[NO], const TileRows<NR>& rows,
    const uint8_t* const (&srow)[kDelta ? NR : 1][NO], const __m256 (&alpha)[kDelta ? NR : 1][NO],
    const std::array<uint32_t, 8>* table, const std::array<float, 8>* pm, __m256 (&acc)[NR][NO],
    size_t k) {
  constexpr size_t esize = T == DType::F32 ? 4 : 2;
  __m256 wv[NO];
  for (size_t o = 0; o < NO; ++o) wv[o] = load8<T>(wrow[o] + k * esize);
  for (size_t r = 0; r < NR; ++r) {
    const __m256 xv = _mm256_loadu_ps(rows.x[r] + k);
    for (size_t o = 0; o < NO; ++o) {
      if constexpr (kDelta && NR == 1) {
        // One row: W_eff = α·(±1) + W formed in place by one FMA (wv is not needed again).
        const __m256 weff =
            _mm256_fmadd_ps(alpha[r][o], _mm256_load_ps(pm[srow[r][o][k / 8]].data()), wv[o]);
        acc[r][o] = _mm256_fmadd_ps(weff, xv, acc[r][o]);
      } else if constexpr (kDelta) {
        // Rows share wv: ±α by an XOR (table load folded in), then an add; this keeps the FMA pipes
        // for the products.
        const __m256 sgn =
            _mm256_load_ps(reinterpret_cast<const float*>(table[srow[r][o][k / 8]].data()));
        const __m256 weff = _mm256_add_ps(wv[o], _mm256_xor_ps(alpha[r][o], sgn));
        acc[r][o] = _mm256_fmadd_ps(weff, xv, acc[r][o]);
      } else {
        acc[r][o] = _mm256_fmadd_ps(wv[o], xv, acc[r][o]);
      }
    }
  }
}

// NO output rows (n .. n+NO−1) for NR batch rows. Each weight load feeds NR fused multiply-adds
// and each x load NO of them; the NR·NO accumulator chains are independent, which hides the FMA
// latency. With kDelta every row has a delta and multiplies by its own W_eff = W_base ± α, formed
// per 8 weights in registers and rounded exactly as the reference rounds it (float32 w + (±α));
// the product is the one FMA the base needs anyway, so no second accumulator, no horizontal sum
// of bits·x and no 2·bits·x − Σx cancellation. Extra cost per 8 weights and delta row: a sign-byte
// load, a shift, and either one FMA with the ±1 table (one row) or an XOR with the ±0 table and an
// add (several rows sharing the converted weights).
template <DType T, size_t NR, size_t NO, bool kDelta>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void tile_block_avx2(
    const std::byte* wdata, size_t K, const TileRows<NR>& rows, size_t n) {
  constexpr size_t esize = T == DType::F32 ? 4 : 2;
  const size_t row_bytes = (K + 7) / 8, K8 = K / 8 * 8;
  const auto* table = neg_table().data();
  const auto* pm = pm_table().data();
  __m256 acc[NR][NO], alpha[kDelta ? NR : 1][NO];
  const uint8_t* srow[kDelta ? NR : 1][NO];
  const std::byte* wrow[NO];
  for (size_t o = 0; o < NO; ++o) wrow[o] = wdata + (n + o) * K * esize;
  for (size_t r = 0; r < NR; ++r)
    for (size_t o = 0; o < NO; ++o) {
      acc[r][o] = _mm256_setzero_ps();
      if constexpr (kDelta) {
        alpha[r][o] = _mm256_set1_ps(load_alpha(*rows.d[r], n + o));
        srow[r][o] = rows.d[r]->signs + (n + o) * row_bytes;
      }
    }
  for (size_t k = 0; k < K8; k += 8)
    tile_step<T, NR, NO, kDelta>(wrow, rows, srow, alpha, table, pm, acc, k);
  for (size_t o = 0; o < NO; ++o) {
    float tail[8] = {};
    if (K8 < K) to_f32(T, wrow[o] + K8 * esize, tail, K - K8);
    for (size_t r = 0; r < NR; ++r) {
      float a = hsum(acc[r][o]);
      for (size_t k = K8; k < K; ++k) {
        float wk = tail[k - K8];
        if constexpr (kDelta) {
          const float al = load_alpha(*rows.d[r], n + o);
          wk += (srow[r][o][k / 8] >> (k % 8)) & 1 ? al : -al;
        }
        a += wk * rows.x[r][k];
      }
      rows.y[r][n + o] = a;
    }
  }
}

// Output rows [n0, n1) for NR batch rows: NO output rows at a time, then the rest one by one.
// Not inlined: with every shape inlined into one function the 8-row base tile ran at half speed.
template <DType T, size_t NR, size_t NO, bool kDelta>
__attribute__((target("avx2,fma,f16c"), noinline)) void tile_avx2(const std::byte* wdata, size_t K,
                                                                  const TileRows<NR>& rows,
                                                                  size_t n0, size_t n1) {
  size_t n = n0;
  for (; n + NO <= n1; n += NO) tile_block_avx2<T, NR, NO, kDelta>(wdata, K, rows, n);
  for (; n < n1; ++n) tile_block_avx2<T, NR, 1, kDelta>(wdata, K, rows, n);
}

// Batch rows idx[0..nr) (nr ≤ kTile) over output rows [b0, b1).
template <DType T, bool kDelta>
__attribute__((target("avx2,fma,f16c"))) void tile_rows_avx2(const std::byte* wdata, size_t K,
                                                             size_t N, const float* x,
                                                             const DeltaRef* deltas, float* y,
                                                             const size_t* idx, size_t nr,
                                                             size_t b0, size_t b1) {
  TileRows<kTile> t{};
  for (size_t i = 0; i < nr; ++i) {
    t.x[i] = x + idx[i] * K;
    t.y[i] = y + idx[i] * N;
    t.d[i] = deltas + idx[i];
  }
  const auto sub = [&]<size_t NR>() {
    TileRows<NR> s;
    for (size_t i = 0; i < NR; ++i) s.x[i] = t.x[i], s.y[i] = t.y[i], s.d[i] = t.d[i];
    return s;
  };
  // Enough independent accumulators per tile, within the 16 vector registers.
  if constexpr (kDelta) {
    switch (nr) {
      case 1:
        tile_avx2<T, 1, 4, true>(wdata, K, sub.template operator()<1>(), b0, b1);
        break;
      case 2:
        tile_avx2<T, 2, 2, true>(wdata, K, sub.template operator()<2>(), b0, b1);
        break;
      case 3:
        tile_avx2<T, 3, 1, true>(wdata, K, sub.template operator()<3>(), b0, b1);
        break;
      default:
        tile_avx2<T, 4, 1, true>(wdata, K, t, b0, b1);
        break;
    }
  } else {
    switch (nr) {
      case 1:
        tile_avx2<T, 1, 4, false>(wdata, K, sub.template operator()<1>(), b0, b1);
        break;
      case 2:
        tile_avx2<T, 2, 4, false>(wdata, K, sub.template operator()<2>(), b0, b1);
        break;
      case 3:
        tile_avx2<T, 3, 2, false>(wdata, K, sub.template operator()<3>(), b0, b1);
        break;
      default:
        tile_avx2<T, 4, 2, false>(wdata, K, t, b0, b1);
        break;
    }
  }
}

template <DType T>
__attribute__((target("avx2,fma,f16c"))) void linear_rows_avx2(const TensorView& w, const float* x,
                                                               size_t rows, const DeltaRef* deltas,
                                                               const float* bias, float* y,
                                                               size_t n0, size_t n1) {
  const size_t K = w.shape[1], N = w.shape[0];
  const std::byte* wdata = w.data.data();
  // Base rows share the converted weights; delta rows each form their own W_eff.
  std::vector<size_t> base_rows, delta_rows;
  for (size_t r = 0; r < rows; ++r) (deltas[r].signs ? delta_rows : base_rows).push_back(r);
  // Blocks of output rows small enough that their weights stay in L1/L2 while every row tile
  // passes over them: the base is read from memory once per call, each variant's signs once.
  // At least 4 rows (a multiple of 4), so the 4-output-row tiles apply.
  const size_t block =
      std::max<size_t>(4, (32u << 10) / std::max<size_t>(1, K * dtype_size(w.dtype))) / 4 * 4;
  for (size_t b0 = n0; b0 < n1; b0 += block) {
    const size_t b1 = std::min(n1, b0 + block);
    for (size_t i = 0; i < base_rows.size(); i += kTile)
      tile_rows_avx2<T, false>(wdata, K, N, x, deltas, y, base_rows.data() + i,
                               std::min(kTile, base_rows.size() - i), b0, b1);
    for (size_t i = 0; i < delta_rows.size(); i += kTile)
      tile_rows_avx2<T, true>(wdata, K, N, x, deltas, y, delta_rows.data() + i,
                              std::min(kTile, delta_rows.size() - i), b0, b1);
    if (bias)
      for (size_t r = 0; r < rows; ++r)
        for (size_t n = b0; n < b1; ++n) y[r * N + n] += bias[n];
  }
}

void linear_rows_avx2(const TensorView& w, const float* x, size_t rows, const DeltaRef* deltas,
                      const float* bias, float* y, size_t n0, size_t n1) {
  switch (w.dtype) {
    case DType::BF16:
      return linear_rows_avx2<DType::BF16>(w, x, rows, deltas, bias, y, n0, n1);
    case DType::F16:
      return linear_rows_avx2<DType::F16>(w, x, rows, deltas, bias, y, n0, n1);
    default:
      return linear_rows_avx2<DType::F32>(w, x, rows, deltas, bias, y, n0, n1);
  }
}

bool has_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return yes;
}

// bits·x for one sign row (AVX2 through the mask table).
__attribute__((target("avx2,fma"))) float bits_dot_avx2(const uint8_t* signs, const float* x,
                                                        size_t K) {
  const auto& table = mask_table();
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  size_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 m0 = _mm256_castsi256_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(table[signs[k / 8]].data())));
    const __m256 m1 = _mm256_castsi256_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(table[signs[k / 8 + 1]].data())));
    acc0 = _mm256_add_ps(acc0, _mm256_and_ps(m0, _mm256_loadu_ps(x + k)));
    acc1 = _mm256_add_ps(acc1, _mm256_and_ps(m1, _mm256_loadu_ps(x + k + 8)));
  }
  float sum = hsum(_mm256_add_ps(acc0, acc1));
  for (; k < K; ++k)
    if ((signs[k / 8] >> (k % 8)) & 1) sum += x[k];
  return sum;
}

float bits_dot(const uint8_t* signs, const float* x, size_t K) {
  if (has_avx2()) return bits_dot_avx2(signs, x, K);
  float sum = 0;
  for (size_t k = 0; k < K; ++k)
    if ((signs[k / 8] >> (k % 8)) & 1) sum += x[k];
  return sum;
}

// Many rows (prefill, large batches): blocks of output rows are converted to float32 in cache and
// multiplied with cblas_sgemm. Rows of the base, and of variants with few rows, share one GEMM
// against the base block (their deltas added per row through the mask table); a variant with many
// rows gets its own GEMM against W_base + α·S formed for this block only (in L2, never whole).
constexpr size_t kGemmRows = 16;   // from this many rows on, the GEMM path (measured: bench_linear)
constexpr size_t kGemmBlock = 64;  // output rows per block: 64·K floats stay in L2
constexpr size_t kDeltaGemmRows = 4;  // a variant with at least this many rows: its own GEMM

// dst[k] = w[k] + (bit k ? α : −α), k < K.
__attribute__((target("avx2,fma"))) void add_signs_avx2(const float* w, const uint8_t* signs,
                                                        float alpha, size_t K, float* dst) {
  const auto& table = mask_table();
  const __m256 pos = _mm256_set1_ps(alpha), neg = _mm256_set1_ps(-alpha);
  size_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 m = _mm256_castsi256_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(table[signs[k / 8]].data())));
    _mm256_storeu_ps(dst + k, _mm256_add_ps(_mm256_loadu_ps(w + k), _mm256_blendv_ps(neg, pos, m)));
  }
  for (; k < K; ++k) dst[k] = w[k] + ((signs[k / 8] >> (k % 8)) & 1 ? alpha : -alpha);
}

void add_signs(const float* w, const uint8_t* signs, float alpha, size_t K, float* dst) {
  if (has_avx2()) return add_signs_avx2(w, signs, alpha, K, dst);
  for (size_t k = 0; k < K; ++k) dst[k] = w[k] + ((signs[k / 8] >> (k % 8)) & 1 ? alpha : -alpha);
}

void linear_gemm(const TensorView& w, const float* x, size_t rows, const DeltaRef* deltas,
                 const float* sum_x, const float* bias, float* y, ThreadPool& pool) {
  // Our pool splits the output rows; OpenBLAS's own threads would only fight ours for the cores.
  static const bool single = (openblas_set_num_threads(1), true);
  (void)single;
  const size_t K = w.shape[1], N = w.shape[0], esize = dtype_size(w.dtype), row_bytes = (K + 7) / 8;
  struct Group {
    DeltaRef delta;            // signs == nullptr: the base group
    std::vector<size_t> rows;  // batch rows, in order
    std::vector<float> x;      // those rows gathered (empty if the group is every row)
  };
  std::vector<Group> groups(1);
  for (size_t r = 0; r < rows; ++r) {
    auto it = std::find_if(groups.begin() + 1, groups.end(), [&](const Group& g) {
      return deltas[r].signs && g.delta.signs == deltas[r].signs;
    });
    if (!deltas[r].signs) it = groups.begin();
    if (it == groups.end()) it = groups.insert(groups.end(), Group{deltas[r], {}, {}});
    it->rows.push_back(r);
  }
  std::vector<std::pair<size_t, DeltaRef>>
      few;  // rows of small variant groups: base GEMM + mask dot
  for (size_t g = 1; g < groups.size(); ++g)
    if (groups[g].rows.size() < kDeltaGemmRows) {
      for (size_t r : groups[g].rows) {
        groups[0].rows.push_back(r);
        few.emplace_back(r, groups[g].delta);
      }
      groups[g].rows.clear();
    }
  std::sort(groups[0].rows.begin(), groups[0].rows.end());
  for (auto& g : groups)
    if (!g.rows.empty() && g.rows.size() < rows)
      for (size_t r : g.rows) g.x.insert(g.x.end(), x + r * K, x + (r + 1) * K);

  const size_t blocks = (N + kGemmBlock - 1) / kGemmBlock;
  pool.parallel_for(blocks, [&](size_t b0, size_t b1) {
    thread_local std::vector<float> wblock, weff, z;
    wblock.resize(kGemmBlock * K);
    weff.resize(kGemmBlock * K);
    for (size_t b = b0; b < b1; ++b) {
      const size_t n0 = b * kGemmBlock, nb = std::min(kGemmBlock, N - n0);
      to_f32(w.dtype, w.data.data() + n0 * K * esize, wblock.data(), nb * K);
      for (const auto& g : groups) {
        if (g.rows.empty()) continue;
        const float* wb = wblock.data();
        if (g.delta.signs) {
          for (size_t j = 0; j < nb; ++j)
            add_signs(&wblock[j * K], g.delta.signs + (n0 + j) * row_bytes,
                      load_alpha(g.delta, n0 + j), K, &weff[j * K]);
          wb = weff.data();
        }
        const size_t m = g.rows.size();
        if (g.x.empty()) {  // every row: straight into y
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), int(nb), int(K), 1.0f, x,
                      int(K), wb, int(K), 0.0f, y + n0, int(N));
          continue;
        }
        z.resize(m * nb);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), int(nb), int(K), 1.0f,
                    g.x.data(), int(K), wb, int(K), 0.0f, z.data(), int(nb));
        for (size_t i = 0; i < m; ++i) std::memcpy(y + g.rows[i] * N + n0, &z[i * nb], nb * 4);
      }
      for (const auto& [r, d] : few)
        for (size_t j = 0; j < nb; ++j) {
          const float bx = bits_dot(d.signs + (n0 + j) * row_bytes, x + r * K, K);
          y[r * N + n0 + j] += load_alpha(d, n0 + j) * (2 * bx - sum_x[r]);
        }
      if (bias)
        for (size_t r = 0; r < rows; ++r)
          for (size_t j = 0; j < nb; ++j) y[r * N + n0 + j] += bias[n0 + j];
    }
  });
}
void check_shapes(const TensorView& w, std::span<const float> x, size_t rows,
                  std::span<const DeltaRef> deltas, std::span<float> y) {
  if (w.shape.size() != 2 || !is_float(w.dtype))
    fail("fused_linear: weight must be a 2-D float tensor");
  if (x.size() != rows * w.shape[1] || y.size() != rows * w.shape[0] || deltas.size() != rows)
    fail("fused_linear: x, y or deltas do not match ", rows, " rows of weight ",
         shape_str(w.shape));
}

}  // namespace

void fused_linear(const TensorView& w, std::span<const float> x, size_t rows,
                  std::span<const DeltaRef> deltas, const float* bias, std::span<float> y,
                  ThreadPool& pool, bool simd) {
  check_shapes(w, x, rows, deltas, y);
  const size_t K = w.shape[1], N = w.shape[0];
  if (rows >= kGemmRows) {
    std::vector<float> sum_x(rows, 0.0f);
    for (size_t r = 0; r < rows; ++r)
      if (deltas[r].signs)
        for (size_t k = 0; k < K; ++k) sum_x[r] += x[r * K + k];
    return linear_gemm(w, x.data(), rows, deltas.data(), sum_x.data(), bias, y.data(), pool);
  }
  pool.parallel_for(N, [&](size_t n0, size_t n1) {
    if (simd && has_avx2())
      linear_rows_avx2(w, x.data(), rows, deltas.data(), bias, y.data(), n0, n1);
    else
      linear_rows_scalar(w, x.data(), rows, deltas.data(), bias, y.data(), n0, n1);
  });
}

void fused_linear_reference(const TensorView& w, std::span<const float> x, size_t rows,
                            std::span<const DeltaRef> deltas, const float* bias,
                            std::span<float> y) {
  check_shapes(w, x, rows, deltas, y);
  const size_t K = w.shape[1], N = w.shape[0], esize = dtype_size(w.dtype), row_bytes = (K + 7) / 8;
  std::vector<float> weff(K);
  for (size_t r = 0; r < rows; ++r) {
    const DeltaRef& d = deltas[r];
    for (size_t n = 0; n < N; ++n) {
      to_f32(w.dtype, w.data.data() + n * K * esize, weff.data(), K);
      if (d.signs) {
        const float a = load_alpha(d, n);
        for (size_t k = 0; k < K; ++k)
          weff[k] += (d.signs[n * row_bytes + k / 8] >> (k % 8)) & 1 ? a : -a;
      }
      double acc = bias ? bias[n] : 0.0;
      for (size_t k = 0; k < K; ++k) acc += double(weff[k]) * double(x[r * K + k]);
      y[r * N + n] = float(acc);
    }
  }
}

}  // namespace bitdelta::cpu
