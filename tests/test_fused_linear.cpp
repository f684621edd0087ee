// The fused BitDelta linear against its plain reference (W_eff materialized, float64 products),
// on random shapes including odd K, mixed variants per batch, and every weight dtype.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>

#include "backend/cpu/fused_linear.h"
#include "bitdelta/error.h"
#include "test_util.h"

namespace bitdelta::cpu {
namespace {

struct Delta {
  std::vector<uint8_t> signs;
  std::vector<float> alpha;
  PackedSigns packed;
  // The kernel reads `packed`, the reference the file-layout `signs`.
  DeltaRef ref() const { return {signs.data(), alpha.data(), alpha.size() > 1, packed.get()}; }
};

Delta random_delta(size_t N, size_t K, bool per_row, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Delta d{std::vector<uint8_t>(N * ((K + 7) / 8)), std::vector<float>(per_row ? N : 1), nullptr};
  for (auto& b : d.signs) b = uint8_t(rng());
  for (size_t n = 0; n < N; ++n)  // padding bits stay 0, as the format requires
    if (K % 8) d.signs[n * ((K + 7) / 8) + K / 8] &= uint8_t((1u << (K % 8)) - 1);
  for (auto& a : d.alpha) a = float(rng() % 1000) * 1e-5f + 1e-4f;
  d.packed = pack_signs(d.signs.data(), N, K);
  return d;
}

// The packed layout against its definition: word (b·C + c)·8 + r, bit j holds row 8b + r, column
// 30c + j; everything outside the matrix is 0.
TEST(FusedLinear, PackedSignLayout) {
  for (auto [N, K] : {std::pair<size_t, size_t>{1, 1}, {9, 29}, {16, 30}, {17, 61}, {8, 4099}}) {
    const Delta d = random_delta(N, K, true, N * 131 + K);
    const size_t C = (K + 29) / 30, blocks = (N + 7) / 8;
    ASSERT_EQ(packed_sign_words(N, K), blocks * C * 8);
    for (size_t b = 0; b < blocks; ++b)
      for (size_t c = 0; c < C; ++c)
        for (size_t r = 0; r < 8; ++r) {
          const uint32_t word = d.packed[(b * C + c) * 8 + r];
          for (size_t j = 0; j < 32; ++j) {
            const size_t n = 8 * b + r, k = 30 * c + j;
            const bool want = j < 30 && n < N && k < K && ((d.signs[n * ((K + 7) / 8) + k / 8] >> (k % 8)) & 1);
            ASSERT_EQ((word >> j) & 1, uint32_t(want)) << "N=" << N << " K=" << K << " n=" << n << " k=" << k;
          }
        }
  }
}

TEST(FusedLinear, RefusesDeltaWithoutPackedSigns) {
  ThreadPool pool(1);
  const Delta d = random_delta(4, 8, true, 1);
  const auto w = test::HostTensor::from_floats(DType::F32, {4, 8}, test::random_floats(32, 2));
  const TensorView wv{w.dtype, w.shape, w.bytes};
  std::vector<float> x(8, 1.0f), y(4);
  const std::vector<DeltaRef> refs{{d.signs.data(), d.alpha.data(), true, nullptr}};
  try {
    fused_linear(wv, x, 1, refs, nullptr, y, pool);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no packed signs"), std::string::npos) << e.what();
  }
}

// The instruction sets this CPU runs: each is checked against the reference (an AVX-512 machine
// checks all three; one without checks scalar and AVX2 and says so once).
std::vector<Isa> isas_here() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512})
    if (cpu_has(isa)) out.push_back(isa);
  static const bool said = [] {
    for (Isa isa : {Isa::avx2, Isa::avx512})
      if (!cpu_has(isa)) std::printf("note: this CPU lacks %s; its kernels are not run here\n", isa_name(isa));
    return true;
  }();
  (void)said;
  return out;
}

// Every instruction set's kernels (SIMD tiles / GEMM; plain loops for scalar) against the
// reference, for every output.
void expect_matches_reference(const test::HostTensor& w, const std::vector<float>& x, size_t rows,
                              const std::vector<DeltaRef>& refs, const float* bias,
                              ThreadPool& pool) {
  const size_t N = w.shape[0], K = w.shape[1];
  const TensorView wv{w.dtype, w.shape, w.bytes};
  std::vector<float> ref(rows * N);
  fused_linear_reference(wv, x, rows, refs, bias, ref);
  const auto wf = w.floats();
  for (Isa isa : isas_here()) {
    std::vector<float> got(rows * N, NAN);
    fused_linear(wv, x, rows, refs, bias, got, pool, isa);
    for (size_t r = 0; r < rows; ++r)
      for (size_t n = 0; n < N; ++n) {
        // f32 accumulation of K products: error below K·2⁻²⁴·Σ|w_eff·x|, with |w_eff| ≤ |w| + α and
        // α < 0.02 here (the lookup-table paths sum x·W and x·S separately, each within that bound).
        double scale = 0;
        for (size_t k = 0; k < K; ++k)
          scale += std::fabs((std::fabs(wf[n * K + k]) + 0.02) * x[r * K + k]);
        ASSERT_NEAR(got[r * N + n], ref[r * N + n], 1.2e-7 * double(K) * scale + 1e-6)
            << isa_name(isa) << " " << dtype_name(w.dtype) << " N=" << N << " K=" << K << " rows=" << rows
            << " r=" << r << " n=" << n;
      }
  }
}

TEST(FusedLinear, InstructionSetsByName) {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) EXPECT_EQ(parse_isa(isa_name(isa)), isa);
  EXPECT_TRUE(cpu_has(Isa::scalar));
  EXPECT_TRUE(cpu_has(best_isa()));
  try {
    parse_isa("avx1024");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown CPU instruction set 'avx1024'"), std::string::npos) << e.what();
  }
  // Asking for a set this CPU lacks is an error, not a crash.
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    if (cpu_has(isa)) continue;
    ThreadPool pool(1);
    const auto w = test::HostTensor::from_floats(DType::F32, {4, 8}, test::random_floats(32, 2));
    std::vector<float> x(8, 1.0f), y(4);
    const std::vector<DeltaRef> refs(1);
    try {
      fused_linear({w.dtype, w.shape, w.bytes}, x, 1, refs, nullptr, y, pool, isa);
      FAIL() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("lacks the"), std::string::npos) << e.what();
    }
  }
}

TEST(FusedLinear, MatchesReferenceOnRandomShapesAndMixedVariants) {
  ThreadPool pool(2);
  std::mt19937_64 rng(7);
  for (DType dtype : {DType::BF16, DType::F16, DType::F32}) {
    for (auto [N, K] :
         {std::pair<size_t, size_t>{1, 1}, {7, 13}, {33, 64}, {64, 77}, {130, 255}, {17, 1000}}) {
      for (size_t rows : {1, 2, 3, 4, 5, 9, 16}) {  // < 16 rows: SIMD tiles; 16: the GEMM path
        const auto w =
            test::HostTensor::from_floats(dtype, {N, K}, test::random_floats(N * K, rng(), 0.1f));
        const auto x = test::random_floats(rows * K, rng());
        std::vector<Delta> variants;
        for (int v = 0; v < 3; ++v) variants.push_back(random_delta(N, K, v != 2, rng()));
        std::vector<DeltaRef> refs(rows);
        for (size_t r = 0; r < rows; ++r) {
          const size_t v = (r * 7 + N) % 4;  // 3 = the base alone
          if (v < 3) refs[r] = variants[v].ref();
        }
        const auto bias = test::random_floats(N, rng());
        for (const float* b : {static_cast<const float*>(nullptr), bias.data()})
          expect_matches_reference(w, x, rows, refs, b, pool);
      }
    }
  }
}

// A decode step of many variants: every delta row its own variant (the SIMD tiles take 1 to 4
// delta rows per pass, base rows in their own passes), rows in an order mixing the two, and a
// K large enough that an output-row block is the 4-row minimum (K·2 bytes > 8 KB) with a tail.
TEST(FusedLinear, ManyDistinctVariantsLargeK) {
  ThreadPool pool(2);
  std::mt19937_64 rng(11);
  for (DType dtype : {DType::BF16, DType::F16, DType::F32}) {
    for (auto [N, K, rows] :
         {std::tuple<size_t, size_t, size_t>{37, 4100, 10}, {9, 4099, 15}, {66, 8, 7}, {100, 301, 6}}) {
      const auto w =
          test::HostTensor::from_floats(dtype, {N, K}, test::random_floats(N * K, rng(), 0.1f));
      const auto x = test::random_floats(rows * K, rng());
      std::vector<Delta> variants;
      for (size_t v = 0; v < rows; ++v) variants.push_back(random_delta(N, K, v % 3 != 2, rng()));
      std::vector<DeltaRef> refs(rows);
      for (size_t r = 0; r < rows; ++r)
        if (r % 5 != 1) refs[r] = variants[r].ref();  // rows 1, 6, 11: the base alone
      const auto bias = test::random_floats(N, rng());
      expect_matches_reference(w, x, rows, refs, bias.data(), pool);
    }
  }
}

}  // namespace
}  // namespace bitdelta::cpu
