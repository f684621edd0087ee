#include "fused_linear.h"

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
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

}  // namespace

PackedSigns pack_signs(const uint8_t* file_signs, size_t N, size_t K) {
  const size_t C = sign_chunks(K), row_bytes = (K + 7) / 8, words = packed_sign_words(N, K);
  const size_t bytes = std::max<size_t>(64, (words * 4 + 63) / 64 * 64);
  auto* p = static_cast<uint32_t*>(std::aligned_alloc(64, bytes));
  if (!p) fail("pack_signs: out of memory for ", bytes, " bytes of packed signs");
  PackedSigns out(p);
  std::memset(p, 0, bytes);
  for (size_t n = 0; n < N; ++n) {
    const uint8_t* row = file_signs + n * row_bytes;
    uint32_t* dst = p + n / kSignRowBlock * C * kSignRowBlock + n % kSignRowBlock;
    for (size_t c = 0; c < C; ++c) {
      const size_t bit = c * kSignChunk, byte = bit / 8, valid = std::min(kSignChunk, K - bit);
      uint64_t v = 0;  // little-endian: bit i of v is bit i of the row from byte `byte` on
      std::memcpy(&v, row + byte, std::min<size_t>(8, row_bytes - byte));
      dst[c * kSignRowBlock] = uint32_t(v >> (bit % 8)) & uint32_t((uint64_t(1) << valid) - 1);
    }
  }
  return out;
}

namespace {

// Sign bit of output row n, column k in the packed layout (1 = +α).
inline bool packed_bit(const uint32_t* p, size_t C, size_t n, size_t k) {
  return (p[(n / kSignRowBlock * C + k / kSignChunk) * kSignRowBlock + n % kSignRowBlock] >>
          (k % kSignChunk)) & 1;
}

// (S·x)_n in plain loops: Σ_k ±x_k by the sign bits of output row n.
float signed_dot(const uint32_t* packed, size_t C, size_t n, const float* x, size_t K) {
  float sx = 0;
  for (size_t k = 0; k < K; ++k) sx += packed_bit(packed, C, n, k) ? x[k] : -x[k];
  return sx;
}

// --- plain path -------------------------------------------------------------------------------

void linear_rows_scalar(const TensorView& w, const float* x, size_t rows, const DeltaRef* deltas,
                        const float* bias, float* y, size_t n0, size_t n1) {
  const size_t K = w.shape[1], N = w.shape[0];
  const size_t esize = dtype_size(w.dtype), C = sign_chunks(K);
  std::vector<float> wrow(K);
  for (size_t n = n0; n < n1; ++n) {
    to_f32(w.dtype, w.data.data() + n * K * esize, wrow.data(), K);
    for (size_t r = 0; r < rows; ++r) {
      const float* xr = x + r * K;
      float acc = 0;
      const DeltaRef& d = deltas[r];
      for (size_t k = 0; k < K; ++k) acc += wrow[k] * xr[k];
      if (d.packed) acc += load_alpha(d, n) * signed_dot(d.packed, C, n, xr, K);
      y[r * N + n] = acc + (bias ? bias[n] : 0.0f);
    }
  }
}

// --- AVX2 path --------------------------------------------------------------------------------

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

// Software prefetch spread over the steps of a loop: cache lines from a list of byte ranges, in
// order, into L2, at a rate fixed beforehand. One core on its own keeps too few misses in flight
// to overlap its compute with memory, so the data of the next phase is requested during the
// current one: the delta rows' signs during the base tiles, the next weights during the lookups.
constexpr size_t kPrefetchCols = 64;   // base tile columns per prefetch step
constexpr size_t kPrefetchLines = 4;  // most cache lines per prefetch step in the lookups
class Prefetch {
 public:
  void clear() { ranges_.clear(), lines_ = 0, cur_ = 0, credit_ = 0, rate_ = 0; }
  void add(const void* p, size_t bytes) {
    const auto* b = static_cast<const char*>(p);
    if (bytes == 0) return;
    if (ranges_.empty()) next_ = b;
    ranges_.push_back({b, b + bytes});
    lines_ += (bytes + 63) / 64;
  }
  // Every line within about `steps` calls of step().
  void spread_over(size_t steps) { rate_ = steps ? (lines_ * 256 + steps - 1) / steps : 0; }
  __attribute__((always_inline)) inline void step() {
    credit_ += rate_;
    while (credit_ >= 256) {
      credit_ -= 256;
      if (cur_ == ranges_.size()) return void(rate_ = credit_ = 0);
      _mm_prefetch(next_, _MM_HINT_T1);
      if ((next_ += 64) >= ranges_[cur_].second && ++cur_ < ranges_.size()) next_ = ranges_[cur_].first;
    }
  }

 private:
  std::vector<std::pair<const char*, const char*>> ranges_;
  const char* next_ = nullptr;
  size_t lines_ = 0, cur_ = 0, credit_ = 0, rate_ = 0;
};

// The batch rows one tile works on (not necessarily adjacent rows of x).
template <size_t NR>
struct TileRows {
  const float* x[NR];
  float* y[NR];
};

// 8 weights (k .. k+7) of the NO output rows for the NR batch rows of a tile.
template <DType T, size_t NR, size_t NO>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void tile_step(
    const std::byte* const (&wrow)[NO], const TileRows<NR>& rows, __m256 (&acc)[NR][NO], size_t k) {
  constexpr size_t esize = T == DType::F32 ? 4 : 2;
  __m256 wv[NO];
  for (size_t o = 0; o < NO; ++o) wv[o] = load8<T>(wrow[o] + k * esize);
  for (size_t r = 0; r < NR; ++r) {
    const __m256 xv = _mm256_loadu_ps(rows.x[r] + k);
    for (size_t o = 0; o < NO; ++o) acc[r][o] = _mm256_fmadd_ps(wv[o], xv, acc[r][o]);
  }
}

// x·W_baseᵀ for NO output rows (n .. n+NO−1) and NR batch rows, written to y. Each weight load
// feeds NR fused multiply-adds and each x load NO of them; the NR·NO accumulator chains are
// independent, which hides the FMA latency.
template <DType T, size_t NR, size_t NO>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void tile_block_avx2(
    const std::byte* wdata, size_t K, const TileRows<NR>& rows, size_t n, Prefetch& pf) {
  constexpr size_t esize = T == DType::F32 ? 4 : 2;
  const size_t K8 = K / 8 * 8;
  __m256 acc[NR][NO];
  const std::byte* wrow[NO];
  for (size_t o = 0; o < NO; ++o) wrow[o] = wdata + (n + o) * K * esize;
  for (size_t r = 0; r < NR; ++r)
    for (size_t o = 0; o < NO; ++o) acc[r][o] = _mm256_setzero_ps();
  for (size_t k0 = 0; k0 < K8; k0 += kPrefetchCols) {  // a prefetch step per 64 columns
    pf.step();
    const size_t k1 = std::min(K8, k0 + kPrefetchCols);
    for (size_t k = k0; k < k1; k += 8) tile_step<T, NR, NO>(wrow, rows, acc, k);
  }
  for (size_t o = 0; o < NO; ++o) {
    float tail[8] = {};
    if (K8 < K) to_f32(T, wrow[o] + K8 * esize, tail, K - K8);
    for (size_t r = 0; r < NR; ++r) {
      float a = hsum(acc[r][o]);
      for (size_t k = K8; k < K; ++k) a += tail[k - K8] * rows.x[r][k];
      rows.y[r][n + o] = a;
    }
  }
}

// Output rows [n0, n1) for NR batch rows: NO output rows at a time, then the rest one by one.
// Not inlined: with every shape inlined into one function the 8-row base tile ran at half speed.
template <DType T, size_t NR, size_t NO>
__attribute__((target("avx2,fma,f16c"), noinline)) void tile_avx2(const std::byte* wdata, size_t K,
                                                                  const TileRows<NR>& rows,
                                                                  size_t n0, size_t n1, Prefetch& pf) {
  size_t n = n0;
  for (; n + NO <= n1; n += NO) tile_block_avx2<T, NR, NO>(wdata, K, rows, n, pf);
  for (; n < n1; ++n) tile_block_avx2<T, NR, 1>(wdata, K, rows, n, pf);
}

// Output rows per tile for nr batch rows: 4 for 1–2, else 2.
constexpr size_t tile_outputs(size_t nr) { return nr <= 2 ? 4 : 2; }

// Batch rows idx[0..nr) (nr ≤ kTile) over output rows [b0, b1).
template <DType T>
__attribute__((target("avx2,fma,f16c"))) void tile_rows_avx2(const std::byte* wdata, size_t K,
                                                             size_t N, const float* x, float* y,
                                                             const size_t* idx, size_t nr,
                                                             size_t b0, size_t b1, Prefetch& pf) {
  TileRows<kTile> t{};
  for (size_t i = 0; i < nr; ++i) {
    t.x[i] = x + idx[i] * K;
    t.y[i] = y + idx[i] * N;
  }
  const auto sub = [&]<size_t NR>() {
    TileRows<NR> s;
    for (size_t i = 0; i < NR; ++i) s.x[i] = t.x[i], s.y[i] = t.y[i];
    return s;
  };
  // Enough independent accumulators per tile, within the 16 vector registers.
  switch (nr) {
    case 1:
      return tile_avx2<T, 1, tile_outputs(1)>(wdata, K, sub.template operator()<1>(), b0, b1, pf);
    case 2:
      return tile_avx2<T, 2, tile_outputs(2)>(wdata, K, sub.template operator()<2>(), b0, b1, pf);
    case 3:
      return tile_avx2<T, 3, tile_outputs(3)>(wdata, K, sub.template operator()<3>(), b0, b1, pf);
    default:
      return tile_avx2<T, 4, tile_outputs(4)>(wdata, K, t, b0, b1, pf);
  }
}

// --- the delta term through lookup tables -------------------------------------------------------

constexpr size_t kGroups = kSignChunk / 3;  // 3-column groups per packed word

// One delta row's tables: T[g·8 + m] = Σᵢ (bit i of m ? x[3g+i] : −x[3g+i]) for the 3-column
// groups g < 10·C, x read as 0 past K. 8 floats per group, 32-byte aligned.
size_t table_floats(size_t K) { return sign_chunks(K) * kGroups * 8; }

__attribute__((target("avx2,fma"))) void build_table_avx2(const float* x, size_t K, float* T) {
  const size_t G = sign_chunks(K) * kGroups;
  // Lane m of n_i: −0.0 where bit i of m is 0 (negate x_i), +0.0 where it is 1.
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const auto neg = [&](int i) __attribute__((target("avx2"))) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_andnot_si256(_mm256_srli_epi32(lane, i), _mm256_set1_epi32(1)), 31));
  };
  const __m256 n0 = neg(0), n1 = neg(1), n2 = neg(2);
  for (size_t g = 0; g < G; ++g) {
    float v[3];
    for (size_t i = 0; i < 3; ++i) v[i] = 3 * g + i < K ? x[3 * g + i] : 0.0f;
    const __m256 t = _mm256_add_ps(
        _mm256_add_ps(_mm256_xor_ps(_mm256_set1_ps(v[0]), n0), _mm256_xor_ps(_mm256_set1_ps(v[1]), n1)),
        _mm256_xor_ps(_mm256_set1_ps(v[2]), n2));
    _mm256_store_ps(T + g * 8, t);
  }
}

// S·x for the 8·NB output rows of row blocks b .. b+NB−1 (lane r of out[i]: row 8(b+i)+r). Per
// 3 columns and block: a shift, a vpermps (the table vector indexed by the 3 sign bits in each
// lane) and an add; the table vector is loaded once for the NB blocks.
template <size_t NB>
__attribute__((target("avx2,fma"), always_inline)) inline void lut_blocks(const uint32_t* packed, size_t C,
                                                                         const float* T, size_t b,
                                                                         __m256 (&out)[NB], Prefetch& pf) {
  __m256 even[NB], odd[NB];  // two accumulator chains per block (groups 2j and 2j+1)
  const uint32_t* wp[NB];
  for (size_t i = 0; i < NB; ++i) {
    even[i] = odd[i] = _mm256_setzero_ps();
    wp[i] = packed + (b + i) * C * kSignRowBlock;
  }
  for (size_t c = 0; c < C; ++c) {
    __m256i bits[NB];
    for (size_t i = 0; i < NB; ++i)
      bits[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp[i] + c * kSignRowBlock));
    const float* t = T + c * kGroups * 8;
    pf.step();
#pragma GCC unroll 5
    for (size_t j = 0; j < kGroups; j += 2) {
      const __m256 t0 = _mm256_load_ps(t + j * 8), t1 = _mm256_load_ps(t + j * 8 + 8);
      for (size_t i = 0; i < NB; ++i) {
        // even += T[bits & 7]; odd += T'[(bits >> 3) & 7]; bits >>= 6. As one asm block: written
        // with intrinsics, GCC computed all 40 lookups of a chunk first and spilled them.
        __m256 p, q;
        asm("vpermps %[t0], %[b], %[p]\n\t"
            "vaddps %[p], %[e], %[e]\n\t"
            "vpsrld $3, %[b], %[q]\n\t"
            "vpermps %[t1], %[q], %[q]\n\t"
            "vaddps %[q], %[o], %[o]\n\t"
            "vpsrld $6, %[b], %[b]"
            : [e] "+x"(even[i]), [o] "+x"(odd[i]), [b] "+x"(bits[i]), [p] "=&x"(p), [q] "=&x"(q)
            : [t0] "x"(t0), [t1] "x"(t1));
      }
    }
  }
  for (size_t i = 0; i < NB; ++i) out[i] = _mm256_add_ps(even[i], odd[i]);
}

// y[n] += α_n·(S·x)_n for the 8 rows of block b that are below n1.
__attribute__((target("avx2,fma"), always_inline)) inline void add_delta8(const DeltaRef& d, size_t b,
                                                                         size_t n1, __m256 sx, float* y) {
  const size_t n = b * kSignRowBlock;
  if (n + 8 <= n1) {
    const __m256 a = d.alpha_per_row ? _mm256_loadu_ps(d.alpha + n) : _mm256_set1_ps(load_alpha(d, 0));
    _mm256_storeu_ps(y + n, _mm256_fmadd_ps(a, sx, _mm256_loadu_ps(y + n)));
    return;
  }
  alignas(32) float v[8];
  _mm256_store_ps(v, sx);
  for (size_t i = 0; n + i < n1; ++i) y[n + i] += load_alpha(d, n + i) * v[i];
}

// y[n] += α_n·(S·x)_n for output rows [n0, n1), n0 a multiple of 8; y is the batch row's output.
__attribute__((target("avx2,fma"), noinline)) void lut_rows_avx2(const DeltaRef& d, size_t K,
                                                                 const float* T, size_t n0, size_t n1,
                                                                 float* y, Prefetch& pf) {
  const size_t C = sign_chunks(K), b1 = (n1 + kSignRowBlock - 1) / kSignRowBlock;
  size_t b = n0 / kSignRowBlock;
  for (; b + 4 <= b1; b += 4) {
    __m256 sx[4];
    lut_blocks<4>(d.packed, C, T, b, sx, pf);
    for (size_t i = 0; i < 4; ++i) add_delta8(d, b + i, n1, sx[i], y);
  }
  for (; b < b1; ++b) {
    __m256 sx[1];
    lut_blocks<1>(d.packed, C, T, b, sx, pf);
    add_delta8(d, b, n1, sx[0], y);
  }
}

// Output rows per super-block: the unit of work of a thread, a multiple of the row block.
constexpr size_t kSuperRows = 32;

// Output rows [n0, n1) (n0 a multiple of kSuperRows): per super-block, every batch row's base
// product through the GEMV tiles (the weights read from memory once, in blocks that stay in L1/L2
// while every row tile passes over them), then each delta row's α·(S·x) through its tables (the
// variant's signs read once). tables[r]: row r's lookup tables, nullptr for a row without a delta.
template <DType T>
__attribute__((target("avx2,fma,f16c"))) void linear_rows_avx2(const TensorView& w, const float* x,
                                                               size_t rows, const DeltaRef* deltas,
                                                               const float* const* tables,
                                                               const float* bias, float* y,
                                                               size_t n0, size_t n1) {
  const size_t K = w.shape[1], N = w.shape[0];
  const std::byte* wdata = w.data.data();
  std::vector<size_t> all(rows);
  for (size_t r = 0; r < rows; ++r) all[r] = r;
  // At least 4 output rows (a multiple of 4), so the 4-output-row tiles apply.
  const size_t block =
      std::max<size_t>(4, (32u << 10) / std::max<size_t>(1, K * dtype_size(w.dtype))) / 4 * 4;
  const size_t esize = dtype_size(w.dtype), C = sign_chunks(K);
  size_t ndelta = 0;
  std::vector<const uint32_t*> distinct;  // the call's distinct packed signs
  for (size_t r = 0; r < rows; ++r) {
    if (!tables[r]) continue;
    ++ndelta;
    if (std::find(distinct.begin(), distinct.end(), deltas[r].packed) == distinct.end())
      distinct.push_back(deltas[r].packed);
  }
  // Prefetch steps of the base tiles per output row: one per 64 columns and tile of output rows.
  double steps_per_row = 0;
  for (size_t i = 0; i < rows; i += kTile)
    steps_per_row += double(K / kPrefetchCols) / double(tile_outputs(std::min(kTile, rows - i)));
  Prefetch pf;
  for (size_t s0 = n0; s0 < n1; s0 += kSuperRows) {
    const size_t s1 = std::min(n1, s0 + kSuperRows);
    // During the base tiles: this super-block's signs of every distinct delta.
    pf.clear();
    const size_t w0 = s0 / kSignRowBlock * C * kSignRowBlock;
    const size_t w1 = (s1 + kSignRowBlock - 1) / kSignRowBlock * C * kSignRowBlock;
    for (const uint32_t* packed : distinct) pf.add(packed + w0, (w1 - w0) * 4);
    pf.spread_over(size_t(steps_per_row * double(s1 - s0)));
    for (size_t b0 = s0; b0 < s1; b0 += block)
      for (size_t i = 0; i < rows; i += kTile)
        tile_rows_avx2<T>(wdata, K, N, x, y, all.data() + i, std::min(kTile, rows - i), b0,
                          std::min(s1, b0 + block), pf);
    // During the lookups (a step per 30 columns and 32 rows): the next super-block's weights, at most
    // kPrefetchLines per step (with few delta rows the lookups are short, and a burst of
    // prefetches would only stall them: the rest comes in with the next base tiles).
    pf.clear();
    if (ndelta && s1 < n1) {
      const size_t steps = ndelta * C * ((s1 - s0 + 31) / 32);
      pf.add(wdata + s1 * K * esize,
             std::min((std::min(n1, s1 + kSuperRows) - s1) * K * esize, steps * kPrefetchLines * 64));
      pf.spread_over(steps);
    }
    for (size_t r = 0; r < rows; ++r)
      if (tables[r]) lut_rows_avx2(deltas[r], K, tables[r], s0, s1, y + r * N, pf);
    if (bias)
      for (size_t r = 0; r < rows; ++r)
        for (size_t n = s0; n < s1; ++n) y[r * N + n] += bias[n];
  }
}

void linear_rows_avx2(const TensorView& w, const float* x, size_t rows, const DeltaRef* deltas,
                      const float* const* tables, const float* bias, float* y, size_t n0, size_t n1) {
  switch (w.dtype) {
    case DType::BF16:
      return linear_rows_avx2<DType::BF16>(w, x, rows, deltas, tables, bias, y, n0, n1);
    case DType::F16:
      return linear_rows_avx2<DType::F16>(w, x, rows, deltas, tables, bias, y, n0, n1);
    default:
      return linear_rows_avx2<DType::F32>(w, x, rows, deltas, tables, bias, y, n0, n1);
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

// The tables of the given batch rows of x, in one 32-byte aligned buffer (per calling thread),
// built by the pool's threads; tables[r] points to row r's (rows not listed keep their entry).
void build_tables(const float* x, size_t K, const std::vector<size_t>& which, std::vector<const float*>& tables,
                  ThreadPool& pool) {
  thread_local std::unique_ptr<float[], FreeDeleter> buf;
  thread_local size_t capacity = 0;
  const size_t per = table_floats(K), need = per * which.size();
  if (need > capacity) {
    buf.reset(static_cast<float*>(std::aligned_alloc(32, (need * 4 + 31) / 32 * 32)));
    if (!buf) fail("fused_linear: out of memory for ", need * 4, " bytes of lookup tables");
    capacity = need;
  }
  float* base = buf.get();
  for (size_t i = 0; i < which.size(); ++i) tables[which[i]] = base + i * per;
  if (which.size() == 1) return build_table_avx2(x + which[0] * K, K, base);
  pool.parallel_for(which.size(), [&](size_t i0, size_t i1) {
    for (size_t i = i0; i < i1; ++i) build_table_avx2(x + which[i] * K, K, base + i * per);
  });
}

// Many rows (prefill, large batches): blocks of output rows are converted to float32 in cache and
// multiplied with cblas_sgemm. Rows of the base, and of variants with few rows, share one GEMM
// against the base block (their deltas added per row through the tables); a variant with many
// rows gets its own GEMM against W_base + α·S formed for this block only (in L2, never whole).
constexpr size_t kGemmRows = 16;   // from this many rows on, the GEMM path (measured: bench_linear)
constexpr size_t kGemmBlock = 64;  // output rows per block: 64·K floats stay in L2
constexpr size_t kDeltaGemmRows = 4;  // a variant with at least this many rows: its own GEMM

// dst[k] = w[k] + (sign of row n, column k ? α : −α) for k < K. w and dst have room for
// 30·C + 2 floats: each 30-column chunk is written as 32 (the 2 past it rewritten by the next).
__attribute__((target("avx2,fma"))) void add_signs_avx2(const float* w, const uint32_t* packed, size_t C,
                                                        size_t n, float alpha, float* dst) {
  const uint32_t* p = packed + n / kSignRowBlock * C * kSignRowBlock + n % kSignRowBlock;
  const __m256 neg_alpha = _mm256_set1_ps(-alpha);
  const __m256i top = _mm256_set1_epi32(int32_t(0x80000000u));
  __m256i shift[4];  // lane l of shift[q]: moves bit 8q + l to bit 31
  for (int q = 0; q < 4; ++q)
    shift[q] = _mm256_sub_epi32(_mm256_set1_epi32(31 - 8 * q), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (size_t c = 0; c < C; ++c) {
    const __m256i word = _mm256_set1_epi32(int32_t(p[c * kSignRowBlock]));
    const size_t k = c * kSignChunk;
    for (int q = 0; q < 4; ++q) {
      // −α with its sign flipped where the bit is 1: ±α exactly.
      const __m256 flip = _mm256_castsi256_ps(_mm256_and_si256(_mm256_sllv_epi32(word, shift[q]), top));
      _mm256_storeu_ps(dst + k + 8 * q,
                       _mm256_add_ps(_mm256_loadu_ps(w + k + 8 * q), _mm256_xor_ps(neg_alpha, flip)));
    }
  }
}

void add_signs_scalar(const float* w, const uint32_t* packed, size_t C, size_t n, float alpha, size_t K,
                      float* dst) {
  for (size_t k = 0; k < K; ++k) dst[k] = w[k] + (packed_bit(packed, C, n, k) ? alpha : -alpha);
}

void linear_gemm(const TensorView& w, const float* x, size_t rows, const DeltaRef* deltas,
                 const float* bias, float* y, ThreadPool& pool, bool simd) {
  // Our pool splits the output rows; OpenBLAS's own threads would only fight ours for the cores.
  static const bool single = (openblas_set_num_threads(1), true);
  (void)single;
  const size_t K = w.shape[1], N = w.shape[0], esize = dtype_size(w.dtype);
  const size_t C = sign_chunks(K), Kp = C * kSignChunk + 2;  // block row stride
  struct Group {
    DeltaRef delta;            // packed == nullptr: the base group
    std::vector<size_t> rows;  // batch rows, in order
    std::vector<float> x;      // those rows gathered (empty if the group is every row)
  };
  std::vector<Group> groups(1);
  for (size_t r = 0; r < rows; ++r) {
    auto it = std::find_if(groups.begin() + 1, groups.end(), [&](const Group& g) {
      return deltas[r].packed && g.delta.packed == deltas[r].packed;
    });
    if (!deltas[r].packed) it = groups.begin();
    if (it == groups.end()) it = groups.insert(groups.end(), Group{deltas[r], {}, {}});
    it->rows.push_back(r);
  }
  std::vector<size_t> few;  // rows of small variant groups: base GEMM + their own delta term
  for (size_t g = 1; g < groups.size(); ++g)
    if (groups[g].rows.size() < kDeltaGemmRows) {
      for (size_t r : groups[g].rows) {
        groups[0].rows.push_back(r);
        few.push_back(r);
      }
      groups[g].rows.clear();
    }
  std::vector<const float*> tables(rows, nullptr);
  if (simd) build_tables(x, K, few, tables, pool);
  std::sort(groups[0].rows.begin(), groups[0].rows.end());
  for (auto& g : groups)
    if (!g.rows.empty() && g.rows.size() < rows)
      for (size_t r : g.rows) g.x.insert(g.x.end(), x + r * K, x + (r + 1) * K);

  const size_t blocks = (N + kGemmBlock - 1) / kGemmBlock;
  pool.parallel_for(blocks, [&](size_t b0, size_t b1) {
    thread_local std::vector<float> wblock, weff, z;
    wblock.resize(kGemmBlock * Kp);  // columns K .. Kp: padding, never read by the GEMM
    weff.resize(kGemmBlock * Kp);
    for (size_t b = b0; b < b1; ++b) {
      const size_t n0 = b * kGemmBlock, nb = std::min(kGemmBlock, N - n0);
      for (size_t j = 0; j < nb; ++j) to_f32(w.dtype, w.data.data() + (n0 + j) * K * esize, &wblock[j * Kp], K);
      for (const auto& g : groups) {
        if (g.rows.empty()) continue;
        const float* wb = wblock.data();
        if (g.delta.packed) {
          for (size_t j = 0; j < nb; ++j) {
            const float a = load_alpha(g.delta, n0 + j);
            if (simd)
              add_signs_avx2(&wblock[j * Kp], g.delta.packed, C, n0 + j, a, &weff[j * Kp]);
            else
              add_signs_scalar(&wblock[j * Kp], g.delta.packed, C, n0 + j, a, K, &weff[j * Kp]);
          }
          wb = weff.data();
        }
        const size_t m = g.rows.size();
        if (g.x.empty()) {  // every row: straight into y
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), int(nb), int(K), 1.0f, x,
                      int(K), wb, int(Kp), 0.0f, y + n0, int(N));
          continue;
        }
        z.resize(m * nb);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), int(nb), int(K), 1.0f,
                    g.x.data(), int(K), wb, int(Kp), 0.0f, z.data(), int(nb));
        for (size_t i = 0; i < m; ++i) std::memcpy(y + g.rows[i] * N + n0, &z[i * nb], nb * 4);
      }
      for (size_t r : few) {
        const DeltaRef& d = deltas[r];
        if (simd) {
          Prefetch none;
          lut_rows_avx2(d, K, tables[r], n0, n0 + nb, y + r * N, none);
          continue;
        }
        for (size_t j = 0; j < nb; ++j)
          y[r * N + n0 + j] += load_alpha(d, n0 + j) * signed_dot(d.packed, C, n0 + j, x + r * K, K);
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
  for (size_t r = 0; r < rows; ++r)
    if (deltas[r].signs && !deltas[r].packed)
      fail("fused_linear: row ", r, "'s delta has no packed signs (cpu::pack_signs)");
  const size_t K = w.shape[1], N = w.shape[0];
  simd = simd && has_avx2();
  if (rows >= kGemmRows) return linear_gemm(w, x.data(), rows, deltas.data(), bias, y.data(), pool, simd);
  if (!simd)
    return pool.parallel_for(N, [&](size_t n0, size_t n1) {
      linear_rows_scalar(w, x.data(), rows, deltas.data(), bias, y.data(), n0, n1);
    });
  std::vector<size_t> delta_rows;
  for (size_t r = 0; r < rows; ++r)
    if (deltas[r].packed) delta_rows.push_back(r);
  std::vector<const float*> tables(rows, nullptr);
  build_tables(x.data(), K, delta_rows, tables, pool);
  pool.parallel_for((N + kSuperRows - 1) / kSuperRows, [&](size_t s0, size_t s1) {
    linear_rows_avx2(w, x.data(), rows, deltas.data(), tables.data(), bias, y.data(), s0 * kSuperRows,
                     std::min(N, s1 * kSuperRows));
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
