// Backend consistency, op by op: each CUDA op of the forward pass (src/backend/cuda/ops.cuh)
// against its CPU counterpart (src/backend/cpu/ops.h) on random inputs. Both compute in float32;
// the GPU rounds to bf16 where a linear layer or the KV cache reads the result, so the CPU side is
// fed the same bf16-rounded values and the outputs are compared within bounds stated per test.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/ops.h"
#include "backend/cuda/code_arch.h"
#include "backend/cuda/device_model.h"
#include "backend/cuda/ops.cuh"
#include "bitdelta/dtype.h"
#include "test_util.h"

namespace bitdelta {
namespace {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

template <typename T>
struct Buf {
  T* p = nullptr;
  size_t n = 0;
  explicit Buf(size_t count) : n(count) {
    if (cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  ~Buf() { cudaFree(p); }
  void put(const std::vector<T>& v) { cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice); }
  std::vector<T> get() const {
    std::vector<T> v(n);
    cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
};

std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f) { return test::random_floats(n, seed, scale); }
std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& v) {
  std::vector<__nv_bfloat16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(v[i]);
  return out;
}
std::vector<float> to_f32(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}
float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

class GpuOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const auto why = cuda::unavailable_reason(); !why.empty()) GTEST_SKIP() << why;
  }
};

// |gpu − cpu| ≤ bound·(1 + |cpu|) everywhere; returns the largest scaled error seen.
double check_close(const std::vector<float>& gpu, const std::vector<float>& cpu, double bound, const char* what) {
  EXPECT_EQ(gpu.size(), cpu.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < std::min(gpu.size(), cpu.size()); ++i) {
    const double e = std::abs(double(gpu[i]) - cpu[i]) / (1.0 + std::abs(cpu[i]));
    worst = std::max(worst, e);
    if (!(e <= bound)) {
      ADD_FAILURE() << what << "[" << i << "]: gpu " << gpu[i] << " cpu " << cpu[i] << " (bound " << bound << ")";
      return e;
    }
  }
  std::printf("  %-28s worst scaled error %.2e (bound %.0e)\n", what, worst, bound);
  return worst;
}

// The sm_90a kernels and programmatic launch follow the code that runs, not the device alone. On a 9.0
// device: the sm_90a code runs (both on), unless the build has one PTX alone (BITDELTA_CUDA_PTX_ONLY:
// 80, the code 8.x GPUs run, neither; 90, what GPUs after Hopper run, programmatic launch only;
// gpu_run.sh's "portable" stage runs every GPU test on both) or CUDA_FORCE_PTX_JIT=1 makes the driver
// compile the build's compute_90 PTX.
TEST_F(GpuOps, Sm90aPathsFollowTheLoadedCode) {
  int dev = 0;
  CUDA_OK(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  CUDA_OK(cudaGetDeviceProperties(&p, dev));
  const char* force = std::getenv("CUDA_FORCE_PTX_JIT");
  const bool forced = force && std::string(force) == "1";
  const int ptx_only = BITDELTA_PTX_ONLY;  // 0, 80 or 90
  const cuda::LoadedCode c = cuda::loaded_code();
  std::printf("  device sm_%d%d runs code from PTX version %d: sm_90a kernels %s, griddepcontrol %s%s\n", p.major,
              p.minor, c.ptx_version, c.sm90a ? "yes" : "no", c.griddepcontrol ? "yes" : "no",
              ptx_only ? (ptx_only == 80 ? " (a compute_80 build)" : " (a compute_90 build)")
                       : forced ? " (CUDA_FORCE_PTX_JIT=1)" : "");
  if (p.major == 9 && p.minor == 0) {
    EXPECT_EQ(c.ptx_version, ptx_only ? ptx_only : 90);
    EXPECT_EQ(c.sm90a, ptx_only == 0 && !forced);
    EXPECT_EQ(c.griddepcontrol, ptx_only != 80);
  }
  EXPECT_EQ(cuda::sm90a_kernels_run(), p.major == 9 && p.minor == 0 && c.sm90a);
  EXPECT_EQ(cuda::dependent_launch_supported(), p.major >= 9 && c.griddepcontrol);
}

TEST_F(GpuOps, EmbeddingGatherAndRmsnormWithResidualAdd) {
  // 4160: 8 elements per thread; 11013: 16 (the form for hidden over 8192).
  for (const int hidden : {4096 + 64, 11008 + 5}) {
  SCOPED_TRACE(testing::Message() << "hidden " << hidden);
  const int rows = 5, vocab = 50, layers = 2;
  // Two variants: their own embedding tables and norms.
  const auto e0 = randn(size_t(vocab) * hidden, 1), e1 = randn(size_t(vocab) * hidden, 2);
  const auto n0 = randn(size_t(2 * layers + 1) * hidden, 3), n1 = randn(size_t(2 * layers + 1) * hidden, 4);
  Buf<__nv_bfloat16> de0(e0.size()), de1(e1.size());
  de0.put(to_bf16(e0));
  de1.put(to_bf16(e1));
  Buf<float> dn0(n0.size()), dn1(n1.size());
  dn0.put(n0);
  dn1.put(n1);
  const int tokens[rows] = {0, 7, 49, 7, 3};
  std::vector<cuda::RowDesc> desc(rows);
  for (int r = 0; r < rows; ++r)
    desc[size_t(r)] = {tokens[r], r, 0, nullptr, r % 2 ? de1.p : de0.p, r % 2 ? dn1.p : dn0.p, nullptr};
  Buf<cuda::RowDesc> ddesc(rows);
  ddesc.put(desc);
  Buf<float> x(size_t(rows) * hidden), add(size_t(rows) * hidden);
  const auto addv = randn(add.n, 5);
  add.put(addv);
  Buf<__nv_bfloat16> out(size_t(rows) * hidden);
  cuda::embed_rows(ddesc.p, rows, hidden, x.p, nullptr);
  const int norm_offset = 3 * hidden;  // layer 1's MLP norm
  cuda::add_rmsnorm(x.p, add.p, ddesc.p, nullptr, rows, hidden, norm_offset, -1, 1e-5f, out.p, nullptr);
  CUDA_OK(cudaDeviceSynchronize());

  std::vector<float> want_x(x.n), want_out(out.n);
  for (int r = 0; r < rows; ++r) {
    const auto& e = r % 2 ? e1 : e0;
    const auto& n = r % 2 ? n1 : n0;
    for (int i = 0; i < hidden; ++i)
      want_x[size_t(r) * hidden + size_t(i)] =
          round_bf16(e[size_t(tokens[r]) * hidden + size_t(i)]) + addv[size_t(r) * hidden + size_t(i)];
    cpu::rmsnorm(&want_x[size_t(r) * hidden], &n[size_t(norm_offset)], size_t(hidden), 1e-5, &want_out[size_t(r) * hidden]);
  }
  // x: the same float additions. out: one bf16 rounding (2⁻⁹ relative) plus the sum of squares in
  // another order (~1e-6).
  check_close(x.get(), want_x, 1e-6, "embedding + residual");
  check_close(to_f32(out.get()), want_out, 4.5e-3, "rmsnorm (bf16 out)");
  }
}

// Rows of five sequences: four decode rows (positions 0, 1, 36 and 299) and a prefill run of 11
// rows at positions 40..50 of the fifth, which the attention takes as tiles of 8 and 3 rows. The
// four decode rows also go alone (tiles of one row: positions split over blocks, 3 splits at 299).
TEST_F(GpuOps, BiasRopeStoreAndAttentionOverTheCache) {
  // head_dim 96 (3 dims per lane): decode rows alone take the one-row tile kernel, not the split one.
  // Head_dim 64 and 128 take the tensor-core kernel: one head per block (the forms with split_heads
  // 0), and where the forms ask for them (split_heads 8) 4 (32/8), 8 (16/2) and 2 (8/4) heads per
  // block; 8/8, one head per block. Head_dim 48 and 256 take the split kernel: 2 heads per block
  // (4/2) and 1 (8/1, 8 dims per lane).
  for (const auto& [heads, kv_heads, head_dim] :
       {std::tuple{32, 8, 128}, std::tuple{4, 2, 48}, std::tuple{8, 8, 64}, std::tuple{4, 4, 96}, std::tuple{16, 2, 64},
        std::tuple{8, 1, 256}, std::tuple{8, 4, 64}}) {
    SCOPED_TRACE(testing::Message() << heads << " heads, " << kv_heads << " kv heads, head_dim " << head_dim);
    const int layers = 3, layer = 1, hidden = 64;
    const int q_dim = heads * head_dim, kv_dim = kv_heads * head_dim;
    const int n_seq = 5, cap = 300;
    std::vector<std::pair<int, int>> row_at = {{0, 0}, {1, 1}, {2, 36}, {3, 299}};  // (sequence, position)
    for (int p = 40; p <= 50; ++p) row_at.push_back({4, p});
    const int rows = int(row_at.size());
    std::vector<float> inv_freq(size_t(head_dim / 2));
    for (size_t i = 0; i < inv_freq.size(); ++i) inv_freq[i] = float(1.0 / std::pow(10000.0, 2.0 * double(i) / head_dim));
    Buf<float> dinv(inv_freq.size());
    dinv.put(inv_freq);
    // Each sequence's cache, filled at earlier positions with random bf16 keys and values. Layout
    // [layers][2][cap][kv_dim] (cuda::kv_index), written out here rather than through kv_index.
    std::vector<std::vector<float>> cache(n_seq);
    std::vector<std::unique_ptr<Buf<__nv_bfloat16>>> dcache;
    const auto at_kv = [&](int l, int which, int p) { return ((size_t(l) * 2 + size_t(which)) * cap + size_t(p)) * kv_dim; };
    for (int s = 0; s < n_seq; ++s) {
      cache[size_t(s)] = randn(size_t(layers) * 2 * cap * kv_dim, 10 + uint64_t(s));
      for (auto& v : cache[size_t(s)]) v = round_bf16(v);
      dcache.push_back(std::make_unique<Buf<__nv_bfloat16>>(cache[size_t(s)].size()));
      dcache.back()->put(to_bf16(cache[size_t(s)]));
    }
    const auto bias = randn(size_t(layers) * (q_dim + 2 * kv_dim + hidden), 20, 0.1f);
    Buf<float> dbias(bias.size());
    dbias.put(bias);
    auto has_bias = [](int seq) { return seq != 2; };
    std::vector<cuda::RowDesc> desc(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r) {
      const auto [seq, pos] = row_at[size_t(r)];
      desc[size_t(r)] = {0, pos, cap, dcache[size_t(seq)]->p, nullptr, nullptr, has_bias(seq) ? dbias.p : nullptr};
    }
    Buf<cuda::RowDesc> ddesc(static_cast<size_t>(rows));
    ddesc.put(desc);
    // Tiles as the model makes them: consecutive rows of one sequence, consecutive positions.
    std::vector<int2> tiles;
    for (int r = 0; r < rows;) {
      int e = r + 1;
      while (e < rows && e - r < cuda::kAttnTile && row_at[size_t(e)].first == row_at[size_t(r)].first &&
             row_at[size_t(e)].second == row_at[size_t(e - 1)].second + 1)
        ++e;
      tiles.push_back(make_int2(r, e - r));
      r = e;
    }
    ASSERT_EQ(tiles.size(), 6u);
    Buf<int2> dtiles(tiles.size());
    dtiles.put(tiles);
    const auto q = randn(size_t(rows) * q_dim, 30), k = randn(size_t(rows) * kv_dim, 31), v = randn(size_t(rows) * kv_dim, 32);
    Buf<float> dq(q.size()), dk(k.size()), dv(v.size());
    dq.put(q);
    dk.put(k);
    dv.put(v);
    Buf<__nv_bfloat16> out(size_t(rows) * q_dim);
    const float scale = 1.0f / std::sqrt(float(head_dim));
    cuda::bias_rope_store(dq.p, dk.p, dv.p, q_dim, kv_dim, ddesc.p, rows, layer, heads, kv_heads, head_dim, hidden,
                          dinv.p, nullptr);
    cuda::attention(dq.p, q_dim, ddesc.p, dtiles.p, int(tiles.size()), cuda::kAttnTile, 50, layer, heads, kv_heads,
                    head_dim, scale, out.p, nullptr);
    // The decode rows (the first 4, tiles 0–3 of one row each) alone: with the positions per block
    // chosen (twice: the split counters must be back at zero after a launch), then for position 299
    // (10 chunks of 32) 128 (3 splits of 3–4 chunks, one per warp), 160 (2 splits of 5, two for warp
    // 0) and 4096 (one split, 3 chunks for warps 0 and 1); with one q head per block (what is chosen
    // for so few rows) and with as many of a kv head as the kernel takes (split_heads 8); and 32 (10
    // splits of one chunk each: warps 1-3 of every block without a chunk).
    const int n_decode = 4;
    const std::pair<int, int> forms[] = {{0, 0},   {0, 0}, {128, 0}, {160, 0}, {4096, 0},
                                         {32, 0},  {0, 8}, {160, 8}, {4096, 8}};
    std::vector<std::unique_ptr<Buf<__nv_bfloat16>>> out_decode;
    for (const auto& [split_len, split_heads] : forms) {
      out_decode.push_back(std::make_unique<Buf<__nv_bfloat16>>(size_t(n_decode) * q_dim));
      cuda::attention(dq.p, q_dim, ddesc.p, dtiles.p, n_decode, 1, 299, layer, heads, kv_heads, head_dim, scale,
                      out_decode.back()->p, nullptr, split_len, split_heads);
    }
    CUDA_OK(cudaDeviceSynchronize());

    // CPU, row by row: bias, rope, store (bf16-rounded, as the cache holds), attend over the float
    // cache (a row sees its own and earlier positions, stored by earlier rows of its sequence).
    std::vector<float> want_q(q), want_out(out.n);
    for (int r = 0; r < rows; ++r) {
      const auto [seq, p] = row_at[size_t(r)];
      const float* b = has_bias(seq) ? &bias[size_t(layer) * (q_dim + 2 * kv_dim + hidden)] : nullptr;
      float* qr = &want_q[size_t(r) * q_dim];
      std::vector<float> kr(&k[size_t(r) * kv_dim], &k[size_t(r + 1) * kv_dim]);
      std::vector<float> vr(&v[size_t(r) * kv_dim], &v[size_t(r + 1) * kv_dim]);
      if (b) {
        for (int i = 0; i < q_dim; ++i) qr[i] += b[i];
        for (int i = 0; i < kv_dim; ++i) kr[size_t(i)] += b[q_dim + i], vr[size_t(i)] += b[q_dim + kv_dim + i];
      }
      const size_t pos = size_t(p);
      cpu::rope(qr, size_t(heads), size_t(head_dim), pos, inv_freq);
      cpu::rope(kr.data(), size_t(kv_heads), size_t(head_dim), pos, inv_freq);
      auto& cs = cache[size_t(seq)];
      for (int i = 0; i < kv_dim; ++i)
        cs[at_kv(layer, 0, p) + size_t(i)] = round_bf16(kr[size_t(i)]), cs[at_kv(layer, 1, p) + size_t(i)] = round_bf16(vr[size_t(i)]);
      for (int h = 0; h < heads; ++h)
        cpu::attend(qr + h * head_dim, &cs[at_kv(layer, 0, 0)], &cs[at_kv(layer, 1, 0)], pos + 1, size_t(kv_dim),
                    size_t(h / (heads / kv_heads) * head_dim), size_t(head_dim), scale,
                    &want_out[size_t(r) * q_dim + size_t(h) * head_dim]);
    }
    // q: the same float ops, cos/sin of the same float angle in double (1e-6). The cache: exactly the
    // rounded values. Attention: softmax in another order plus the bf16 output rounding (2⁻⁹).
    check_close(dq.get(), want_q, 1e-5, "rope q");
    for (int r = 0; r < rows; ++r) {
      const auto [seq, p] = row_at[size_t(r)];
      for (int which = 0; which < 2; ++which) {
        std::vector<__nv_bfloat16> got(static_cast<size_t>(kv_dim));
        cudaMemcpy(got.data(), dcache[size_t(seq)]->p + at_kv(layer, which, p), got.size() * 2, cudaMemcpyDeviceToHost);
        const float* want = &cache[size_t(seq)][at_kv(layer, which, p)];
        EXPECT_EQ(to_f32(got), std::vector<float>(want, want + kv_dim)) << (which ? "v" : "k") << " stored at row " << r;
      }
    }
    check_close(to_f32(out.get()), want_out, 5e-3, "attention (bf16 out)");
    for (size_t i = 0; i < out_decode.size(); ++i) {
      const std::string what = "attention, decode rows, split_len " + std::to_string(forms[i].first) + ", heads " +
                               std::to_string(forms[i].second);
      check_close(to_f32(out_decode[i]->get()),
                  std::vector<float>(want_out.begin(), want_out.begin() + long(n_decode) * q_dim), 5e-3, what.c_str());
    }
  }
}

// A prompt's run of rows on GEMMs (attention_prompt): 100 rows at positions 150..249 of one sequence,
// rows 3..102 of q and out, against the CPU over the same bf16 cache; in one piece, and in pieces of
// about 37 rows (scratch for fewer rows than the run has).
TEST_F(GpuOps, AttentionOfAPromptRunOnGemms) {
  cublasHandle_t handle = nullptr;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  for (const auto& [heads, kv_heads, head_dim] : {std::tuple{32, 8, 128}, std::tuple{8, 8, 64}, std::tuple{6, 2, 40}}) {
    SCOPED_TRACE(testing::Message() << heads << " heads, " << kv_heads << " kv heads, head_dim " << head_dim);
    const int layers = 2, layer = 1, cap = 256, p0 = 150, n = 100, first = 3, rows = first + n;
    const int q_dim = heads * head_dim, kv_dim = kv_heads * head_dim;
    auto cache = randn(size_t(layers) * 2 * cap * kv_dim, 50);
    for (auto& v : cache) v = round_bf16(v);
    Buf<__nv_bfloat16> dcache(cache.size());
    dcache.put(to_bf16(cache));
    const auto q = randn(size_t(rows) * q_dim, 51, 2.0f);
    Buf<float> dq(q.size());
    dq.put(q);
    Buf<__nv_bfloat16> out(size_t(rows) * q_dim);
    const float scale = 1.0f / std::sqrt(float(head_dim));
    const cuda::RowDesc row{0, p0, cap, dcache.p, nullptr, nullptr, nullptr};
    const size_t per_row = size_t(heads) * ((p0 + n + 7) / 8 * 8) * 6;
    for (const size_t piece_bytes : {size_t(256) << 20, per_row * 37}) {
      SCOPED_TRACE(testing::Message() << "pieces of " << piece_bytes / per_row << " rows at most");
      CUDA_OK(cudaMemset(out.p, 0xff, out.n * sizeof(__nv_bfloat16)));  // NaN until written
      cuda::attention_prompt(handle, dq.p, q_dim, row, first, n, layer, heads, kv_heads, head_dim, scale, out.p, nullptr,
                             piece_bytes);
      CUDA_OK(cudaDeviceSynchronize());
      const auto got = to_f32(out.get());
      std::vector<float> want, have;
      const size_t keys = size_t(layer) * 2 * cap * kv_dim, values = keys + size_t(cap) * kv_dim;
      for (int i = 0; i < n; ++i)
        for (int h = 0; h < heads; ++h) {
          std::vector<float> o(static_cast<size_t>(head_dim));
          cpu::attend(&q[size_t(first + i) * q_dim + size_t(h) * head_dim], &cache[keys], &cache[values],
                      size_t(p0 + i + 1), size_t(kv_dim), size_t(h / (heads / kv_heads) * head_dim), size_t(head_dim),
                      scale, o.data());
          want.insert(want.end(), o.begin(), o.end());
          const float* g = &got[size_t(first + i) * q_dim + size_t(h) * head_dim];
          have.insert(have.end(), g, g + head_dim);
        }
      // q in two bf16 parts (about 2^-16 relative), the probabilities rounded to bf16 (2^-9 each,
      // averaging out over the positions), and the bf16 output (2^-9).
      check_close(have, want, 5e-3, "attention of a prompt run (bf16 out)");
    }
  }
  cublasDestroy(handle);
}

TEST_F(GpuOps, SwigluOverTheOutputOfAFusedGateUpLinear) {
  // Gate and up side by side in rows of 2n; n = 11008 takes the 4-column form, 11013 the scalar one.
  for (const int n : {11008, 11008 + 5}) {
  SCOPED_TRACE(testing::Message() << "n " << n);
  const int rows = 3;
  const auto gu = randn(size_t(rows) * 2 * n, 40, 3.0f);
  Buf<float> dgu(gu.size());
  dgu.put(gu);
  Buf<__nv_bfloat16> out(size_t(rows) * n);
  cuda::swiglu(dgu.p, dgu.p + n, 2 * n, rows, n, out.p, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> want, u;
  for (int r = 0; r < rows; ++r) {
    want.insert(want.end(), gu.begin() + long(r) * 2 * n, gu.begin() + long(r) * 2 * n + n);
    u.insert(u.end(), gu.begin() + long(r) * 2 * n + n, gu.begin() + long(r + 1) * 2 * n);
  }
  cpu::swiglu(want.data(), u.data(), want.size());
  check_close(to_f32(out.get()), want, 4e-3, "swiglu (bf16 out)");
  }
}

// y += d (a linear's delta terms computed beside its base, device_model.cu): the same float additions
// as the CPU's, exactly; 4 floats a thread where the length and both pointers allow, else one (a
// length not a multiple of 4, and d one float off 16-byte alignment).
TEST_F(GpuOps, AddToAddsElementwise) {
  for (const auto& [n, offset] : {std::pair<size_t, size_t>{3 * 11008, 0}, {3 * 11008 + 3, 0}, {4096, 1}}) {
    SCOPED_TRACE(testing::Message() << "n " << n << ", d offset " << offset);
    const auto y = randn(n, 50), d = randn(n + 1, 51);
    Buf<float> dy(n), dd(n + 1);
    dy.put(y);
    dd.put(d);
    cuda::add_to(dy.p, dd.p + offset, n, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> want(y);
    for (size_t i = 0; i < n; ++i) want[i] += d[i + offset];
    EXPECT_EQ(dy.get(), want);
  }
}

// A linear's delta terms taken apart (device_model.cu linear()) and added by the kernel that consumes
// its output: exactly what add_to and then that kernel give (add_rmsnorm in both of its forms, with
// a row map and biases; bias_rope_store over q|k|v views of one buffer, with biases; swiglu over
// gate|up in its 4-column and its scalar form). Their results against the CPU: the tests above.
TEST_F(GpuOps, DeltaTermsFoldedIntoTheConsumerEqualAddTo) {
  // Runs `op` on y + t added first (add_to), then on y with t as its terms; returns both outputs.
  const auto both = [](const std::vector<float>& y, const std::vector<float>& t, const auto& op) {
    Buf<float> dy(y.size()), dt(t.size());
    dy.put(y);
    dt.put(t);
    cuda::add_to(dy.p, dt.p, y.size(), nullptr);
    auto added = op(dy.p, nullptr);
    dy.put(y);
    auto folded = op(dy.p, static_cast<const float*>(dt.p));
    return std::pair{std::move(added), std::move(folded)};
  };
  const int rows = 5, vocab = 8;
  for (const int hidden : {4096 + 64, 11008 + 5}) {
    SCOPED_TRACE(testing::Message() << "add_rmsnorm, hidden " << hidden);
    const auto e = randn(size_t(vocab) * hidden, 60), n = randn(size_t(hidden) * 2, 61), b = randn(size_t(hidden), 62);
    Buf<__nv_bfloat16> de(e.size());
    de.put(to_bf16(e));
    Buf<float> dn(n.size()), db(b.size());
    dn.put(n);
    db.put(b);
    std::vector<cuda::RowDesc> desc(rows);
    for (int r = 0; r < rows; ++r) desc[size_t(r)] = {r, r, 0, nullptr, de.p, dn.p, r % 2 ? db.p : nullptr};
    Buf<cuda::RowDesc> ddesc(rows);
    ddesc.put(desc);
    Buf<int> dmap(3);
    dmap.put({4, 1, 2});
    for (const bool mapped : {false, true}) {
      const int n_out = mapped ? 3 : rows;
      const auto op = [&](float* add, const float* terms) {
        Buf<float> x(size_t(rows) * hidden);
        Buf<__nv_bfloat16> out(size_t(n_out) * hidden);
        cuda::embed_rows(ddesc.p, rows, hidden, x.p, nullptr);
        cuda::add_rmsnorm(x.p, add, ddesc.p, mapped ? dmap.p : nullptr, n_out, hidden, hidden, 0, 1e-5f, out.p,
                          nullptr, terms);
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        auto xs = x.get();
        const auto o = to_f32(out.get());
        xs.insert(xs.end(), o.begin(), o.end());
        return xs;
      };
      const auto [added, folded] = both(randn(size_t(rows) * hidden, 63), randn(size_t(rows) * hidden, 64, 0.1f), op);
      EXPECT_EQ(folded, added) << (mapped ? "with a row map" : "");
    }
  }
  {
    const int heads = 8, kv_heads = 2, head_dim = 64, layers = 2, layer = 1, hidden = 64, cap = 16;
    const int q_dim = heads * head_dim, kv_dim = kv_heads * head_dim, stride = q_dim + 2 * kv_dim;
    std::vector<float> inv_freq(size_t(head_dim / 2));
    for (size_t i = 0; i < inv_freq.size(); ++i) inv_freq[i] = float(1.0 / std::pow(10000.0, 2.0 * double(i) / head_dim));
    Buf<float> dinv(inv_freq.size());
    dinv.put(inv_freq);
    const auto bias = randn(size_t(layers) * (q_dim + 2 * kv_dim + hidden), 65, 0.1f);
    Buf<float> dbias(bias.size());
    dbias.put(bias);
    Buf<__nv_bfloat16> cache(size_t(rows) * layers * 2 * cap * kv_dim);
    std::vector<cuda::RowDesc> desc(rows);
    for (int r = 0; r < rows; ++r)
      desc[size_t(r)] = {0, 3 * r, cap, cache.p + size_t(r) * layers * 2 * cap * kv_dim, nullptr, nullptr,
                         r % 2 ? nullptr : dbias.p};
    Buf<cuda::RowDesc> ddesc(rows);
    ddesc.put(desc);
    const auto op = [&](float* q, const float* terms) {
      EXPECT_EQ(cudaMemset(cache.p, 0, cache.n * sizeof(__nv_bfloat16)), cudaSuccess);
      cuda::bias_rope_store(q, q + q_dim, q + q_dim + kv_dim, stride, stride, ddesc.p, rows, layer, heads, kv_heads,
                            head_dim, hidden, dinv.p, nullptr, terms);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<float> got(size_t(rows) * q_dim);  // q (k and v go to the cache, not back)
      cudaMemcpy2D(got.data(), size_t(q_dim) * 4, q, size_t(stride) * 4, size_t(q_dim) * 4, rows, cudaMemcpyDeviceToHost);
      const auto c = to_f32(cache.get());
      got.insert(got.end(), c.begin(), c.end());
      return got;
    };
    const auto [added, folded] = both(randn(size_t(rows) * stride, 66), randn(size_t(rows) * stride, 67, 0.1f), op);
    EXPECT_EQ(folded, added) << "bias_rope_store";
  }
  for (const int n : {11008, 11008 + 5}) {
    const auto op = [&](float* gu, const float* terms) {
      Buf<__nv_bfloat16> out(size_t(rows) * n);
      cuda::swiglu(gu, gu + n, 2 * n, rows, n, out.p, nullptr, terms);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      return to_f32(out.get());
    };
    const auto [added, folded] = both(randn(size_t(rows) * 2 * n, 68, 3.0f), randn(size_t(rows) * 2 * n, 69, 0.3f), op);
    EXPECT_EQ(folded, added) << "swiglu, n " << n;
  }
}

}  // namespace
}  // namespace bitdelta
