#include "fused_linear.h"

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
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

// --- SIMD paths: the kernels of fused_linear_simd.inc, once per vector width ----------------------

// Output rows per super-block: the unit of work of a thread, a multiple of the row block.
constexpr size_t kSuperRows = 32;

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
  template <size_t M>
  TileRows<M> first() const {
    TileRows<M> s;
    for (size_t i = 0; i < M; ++i) s.x[i] = x[i], s.y[i] = y[i];
    return s;
  }
};

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


namespace avx2 {
#define BD_TARGET "avx2,fma,f16c"
struct Vec {
  using F = __m256;
  using I = __m256i;
  static constexpr size_t L = 8, kTileRows = 4;
  // Output rows per tile for nr batch rows, within 16 vector registers (nr·outputs accumulators,
  // `outputs` weight vectors and one x vector): 4 for 1–2 rows, else 2.
  static constexpr size_t outputs(size_t nr) { return nr <= 2 ? 4 : 2; }
#define BD_V __attribute__((target(BD_TARGET), always_inline)) static inline
  BD_V F zero() { return _mm256_setzero_ps(); }
  BD_V F loadu(const float* p) { return _mm256_loadu_ps(p); }
  BD_V void storeu(float* p, F v) { _mm256_storeu_ps(p, v); }
  BD_V F set1(float v) { return _mm256_set1_ps(v); }
  BD_V F add(F a, F b) { return _mm256_add_ps(a, b); }
  BD_V F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  BD_V float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  template <DType T>
  BD_V F load_w(const std::byte* p) {
    if constexpr (T == DType::BF16)
      return _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
    else if constexpr (T == DType::F16)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    else
      return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
  BD_V I load_bits(const uint32_t* p, size_t, size_t) {  // one row block per vector
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  }
  BD_V F load_table(const float* t) { return _mm256_load_ps(t); }
#undef BD_V
};
#include "fused_linear_simd.inc"
#undef BD_TARGET
}  // namespace avx2

// AVX-512 (F, BW, VL): 16 lanes and 32 vector registers. The lookups take two row blocks per
// vpermps (16 rows × 3 columns); the tiles up to 4 batch rows × 4 output rows.
// GCC 12 warns "__Y may be used uninitialized" inside its own AVX-512 intrinsics (the
// _mm512_undefined_* they start from): a false positive of the header, silenced here only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace avx512 {
#define BD_TARGET "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
struct Vec {
  using F = __m512;
  using I = __m512i;
  static constexpr size_t L = 16, kTileRows = 4;
  static constexpr size_t outputs(size_t) { return 4; }
#define BD_V __attribute__((target(BD_TARGET), always_inline)) static inline
  BD_V F zero() { return _mm512_setzero_ps(); }
  BD_V F loadu(const float* p) { return _mm512_loadu_ps(p); }
  BD_V void storeu(float* p, F v) { _mm512_storeu_ps(p, v); }
  BD_V F set1(float v) { return _mm512_set1_ps(v); }
  BD_V F add(F a, F b) { return _mm512_add_ps(a, b); }
  BD_V F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  BD_V float hsum(F v) { return _mm512_reduce_add_ps(v); }
  template <DType T>
  BD_V F load_w(const std::byte* p) {
    if constexpr (T == DType::BF16)
      return _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    else if constexpr (T == DType::F16)
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    else
      return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  }
  // Row blocks p and p + stride (the second read as zero when fewer than 2 are valid).
  BD_V I load_bits(const uint32_t* p, size_t stride, size_t valid) {
    const __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i hi =
        valid > 1 ? _mm256_load_si256(reinterpret_cast<const __m256i*>(p + stride)) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  BD_V F load_table(const float* t) {  // the 8 floats in both halves (as 4 doubles: AVX512F alone)
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_load_pd(reinterpret_cast<const double*>(t))));
  }
#undef BD_V
};
#include "fused_linear_simd.inc"
#undef BD_TARGET
}  // namespace avx512
#pragma GCC diagnostic pop

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
                 const float* bias, float* y, ThreadPool& pool, Isa isa) {
  const bool simd = isa != Isa::scalar;
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
          if (isa == Isa::avx512)
            avx512::lut_rows(d, K, tables[r], n0, n0 + nb, y + r * N, none);
          else
            avx2::lut_rows(d, K, tables[r], n0, n0 + nb, y + r * N, none);
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

bool cpu_has(Isa isa) {
  // Asked on every call of fused_linear: the CPU's answers are read once.
  static const std::array<bool, 3> has = [] {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    return std::array<bool, 3>{true, avx2, avx512};
  }();
  return has[size_t(isa)];
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return "scalar";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
  }
  return "?";
}

Isa parse_isa(std::string_view name) {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512})
    if (name == isa_name(isa)) return isa;
  fail("unknown CPU instruction set '", name, "' (expected scalar, avx2 or avx512)");
}

Isa best_isa() {
  static const Isa best = [] {
    Isa cap = Isa::avx512;
    if (const char* env = std::getenv("BITDELTA_CPU_ISA"); env && *env) {
      try {
        cap = parse_isa(env);
      } catch (const Error& e) {
        fail("BITDELTA_CPU_ISA: ", e.what());
      }
    }
    for (Isa isa : {Isa::avx512, Isa::avx2})
      if (isa <= cap && cpu_has(isa)) return isa;
    return Isa::scalar;
  }();
  return best;
}

void fused_linear(const TensorView& w, std::span<const float> x, size_t rows,
                  std::span<const DeltaRef> deltas, const float* bias, std::span<float> y,
                  ThreadPool& pool, Isa isa) {
  check_shapes(w, x, rows, deltas, y);
  for (size_t r = 0; r < rows; ++r)
    if (deltas[r].signs && !deltas[r].packed)
      fail("fused_linear: row ", r, "'s delta has no packed signs (cpu::pack_signs)");
  if (!cpu_has(isa)) fail("fused_linear: this CPU lacks the ", isa_name(isa), " instruction set");
  const size_t K = w.shape[1], N = w.shape[0];
  if (rows >= kGemmRows) return linear_gemm(w, x.data(), rows, deltas.data(), bias, y.data(), pool, isa);
  if (isa == Isa::scalar)
    return pool.parallel_for(N, [&](size_t n0, size_t n1) {
      linear_rows_scalar(w, x.data(), rows, deltas.data(), bias, y.data(), n0, n1);
    });
  std::vector<size_t> delta_rows;
  for (size_t r = 0; r < rows; ++r)
    if (deltas[r].packed) delta_rows.push_back(r);
  std::vector<const float*> tables(rows, nullptr);
  build_tables(x.data(), K, delta_rows, tables, pool);
  const auto rows_fn = isa == Isa::avx512 ? avx512::linear_rows : avx2::linear_rows;
  pool.parallel_for((N + kSuperRows - 1) / kSuperRows, [&](size_t s0, size_t s1) {
    rows_fn(w, x.data(), rows, deltas.data(), tables.data(), bias, y.data(), s0 * kSuperRows,
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
