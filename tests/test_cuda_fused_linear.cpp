// Backend-consistency test for the CUDA fused BitDelta linear (label `gpu`: needs a GPU).
// Every fast CUDA path and the plain CUDA reference run on random inputs and shapes (odd K, mixed
// variants, rows without delta, α per row and per tensor) and are compared with the CPU reference
// bitdelta::cpu::fused_linear_reference, which sees the same bf16-rounded x and W.
// Bounds, as ‖y − y_ref‖₂ / ‖y_ref‖₂ (y_ref: W_eff in f32, dot in f64):
//   decode kernel max(5e-5, 2.5e-9·K): bf16·bf16 products are exact, but the tensor cores' f32
//     accumulation is not IEEE-rounded, so its error grows with the columns one accumulator sums
//     (k_split 1: 1.1e-5, 3.6e-5 and 5.3e-5 at K = 11008, 30000 and 50000, run 146); the delta
//     term sees x quantized to 16-bit integers per row (≤ max|x|/65024 per element: ~1e-6 of y
//     here), its sums are exact,
//   CUDA reference 1e-6,
//   prefill 4e-3: two-GEMM rounds α⊙S to bf16 (measured ≤ 1.3e-3 at N = 16, ~3e-4 at larger N);
//     materialize/pipelined round W_eff to bf16 (≤ 2⁻⁹ relative per weight); the fused GEMM too,
//     as bf16(w ± bf16(α)) (α rounded to bf16 first: 2⁻⁹ of the delta term, well inside).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/fused_linear.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/delta_terms_beside.cuh"
#include "backend/cuda/fused_linear_decode.cuh"
#include "backend/cuda/fused_gemm_mma.cuh"
#include "backend/cuda/fused_linear_prefill.cuh"
#include "backend/cuda/fused_linear_reference.cuh"
#include "backend/cuda/fused_linear_stream.cuh"
#include "bitdelta/dtype.h"

namespace {

using bitdelta::DeltaRef;
namespace bcuda = bitdelta::cuda;

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) {
    BITDELTA_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(count, 1) * sizeof(T)));
  }
  DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    BITDELTA_CUDA_CHECK(
        cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::vector<T> to_host() const {
    std::vector<T> h(n);
    BITDELTA_CUDA_CHECK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

struct Variant {
  std::vector<uint8_t> signs;
  std::vector<float> alpha;
  bool per_row;
};

int failures = 0, checks = 0;

double rel_error(const std::vector<float>& y, const std::vector<float>& ref, bool& all_finite) {
  double num = 0, den = 0;
  all_finite = true;
  for (size_t i = 0; i < y.size(); ++i) {
    if (!std::isfinite(y[i])) all_finite = false;
    num += (double(y[i]) - ref[i]) * (double(y[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

void expect(const std::string& what, const std::vector<float>& y, const std::vector<float>& ref,
            double bound) {
  bool finite;
  const double err = rel_error(y, ref, finite);
  ++checks;
  const bool ok = finite && err <= bound;
  if (!ok) ++failures;
  std::printf("%s %-70s rel_err %.3e (bound %.0e)%s\n", ok ? "ok  " : "FAIL", what.c_str(), err,
              bound, finite ? "" : " NON-FINITE OUTPUT");
}

// A call that must be refused: the one line it throws names `want`.
void expect_refused(const std::string& what, const std::string& want, const std::function<void()>& call) {
  std::string message;
  try {
    call();
  } catch (const std::exception& e) {
    message = e.what();
  }
  const bool ok = message.find(want) != std::string::npos;
  ++checks;
  if (!ok) ++failures;
  std::printf("%s %s refused: \"%s\"\n", ok ? "ok  " : "FAIL", what.c_str(), message.c_str());
}

void poison(float* y, size_t n) {
  BITDELTA_CUDA_CHECK(cudaMemset(y, 0xff, n * sizeof(float)));
}  // NaN

// One shape: N×K weight, `rows` rows whose variant index is row_variant[r] (-1: none).
void check_case(std::mt19937& rng, int N, int K, const std::vector<int>& row_variant, int nvariants,
                bool per_row) {
  const int rows = int(row_variant.size());
  const size_t row_bytes = (size_t(K) + 7) / 8;
  const double decode_bound = std::max(5e-5, 2.5e-9 * K);  // the header's decode bound
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> w(size_t(N) * K), x(size_t(rows) * K);
  for (auto& v : w) v = bitdelta::f32_to_bf16(0.05f * u(rng));
  for (auto& v : x) v = bitdelta::f32_to_bf16(u(rng));
  std::vector<Variant> vars(nvariants);
  for (auto& v : vars) {
    v.per_row = per_row;
    v.signs.resize(size_t(N) * row_bytes);
    for (size_t n = 0; n < size_t(N); ++n)
      for (size_t b = 0; b < row_bytes; ++b) {
        uint8_t byte = uint8_t(rng());
        const size_t valid = std::min<size_t>(8, size_t(K) - 8 * b);
        if (valid < 8) byte &= uint8_t((1u << valid) - 1);  // padding bits are 0 (DESIGN.md §3)
        v.signs[n * row_bytes + b] = byte;
      }
    v.alpha.resize(per_row ? N : 1);
    for (auto& a : v.alpha) a = 0.005f * (1.25f + u(rng));
  }
  // CPU reference on the same bf16 values.
  std::vector<float> xf(x.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = bitdelta::bf16_to_f32(x[i]);
  bitdelta::TensorView wv{
      bitdelta::DType::BF16,
      {uint64_t(N), uint64_t(K)},
      std::span<const std::byte>(reinterpret_cast<const std::byte*>(w.data()), w.size() * 2)};
  std::vector<DeltaRef> host_refs(rows);
  for (int r = 0; r < rows; ++r)
    if (row_variant[r] >= 0) {
      const Variant& v = vars[row_variant[r]];
      host_refs[r] = DeltaRef{v.signs.data(), v.alpha.data(), v.per_row};
    }
  std::vector<float> ref(size_t(rows) * N);
  bitdelta::cpu::fused_linear_reference(wv, xf, rows, host_refs, nullptr, ref);

  DeviceBuffer<uint16_t> dw(w), dx(x);
  // The CUDA reference reads the file's sign layout; the fast kernels read the packed one.
  std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> dsigns, dpacked;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> dalpha;
  for (auto& v : vars) {
    dsigns.push_back(std::make_unique<DeviceBuffer<uint8_t>>(v.signs));
    dpacked.push_back(std::make_unique<DeviceBuffer<uint8_t>>(bcuda::packed_signs_bytes(N, K)));
    bcuda::pack_signs(dsigns.back()->ptr, N, K, dpacked.back()->ptr, nullptr);
    dalpha.push_back(std::make_unique<DeviceBuffer<float>>(v.alpha));
  }
  std::vector<DeltaRef> raw_refs(rows), dev_refs(rows);
  for (int r = 0; r < rows; ++r)
    if (row_variant[r] >= 0) {
      raw_refs[r] = DeltaRef{dsigns[row_variant[r]]->ptr, dalpha[row_variant[r]]->ptr, per_row};
      dev_refs[r] = DeltaRef{dpacked[row_variant[r]]->ptr, dalpha[row_variant[r]]->ptr, per_row};
    }
  DeviceBuffer<float> dy(size_t(rows) * N);
  const auto* wb = reinterpret_cast<const __nv_bfloat16*>(dw.ptr);
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(dx.ptr);
  std::string vlist;
  for (int v : row_variant) vlist += (v < 0 ? std::string("-") : std::to_string(v)) + ",";
  const std::string tag = std::to_string(N) + "x" + std::to_string(K) + " rows " +
                          std::to_string(rows) + (per_row ? " alpha/row" : " alpha/tensor") +
                          " v[" + vlist.substr(0, 40) + "]";

  if (rows <= bcuda::kMaxDecodeRows) {
    if (rows <= 16) {
      poison(dy.ptr, dy.n);
      bcuda::fused_linear_reference(wb, N, K, xb, rows, raw_refs, dy.ptr, nullptr);
      BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
      expect("cuda reference   " + tag, dy.to_host(), ref, 1e-6);
    }
    for (int ks : {0, 1, 2, 4, 8}) {
      poison(dy.ptr, dy.n);
      bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dy.ptr, nullptr, {ks, 0, bcuda::DecodeKernel::kRegisters});
      BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
      expect("decode ks=" + std::to_string(ks) + "      " + tag, dy.to_host(), ref, decode_bound);
    }
    // One row: the balanced grid (the default there; other row counts take the register kernel).
    if (rows == 1) {
      poison(dy.ptr, dy.n);
      bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dy.ptr, nullptr, {0, 0, bcuda::DecodeKernel::kBalanced});
      BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
      expect("decode balanced  " + tag, dy.to_host(), ref, decode_bound);
      {  // x quantized before the call (DecodeOptions::xq), not in each block
        DeviceBuffer<uint8_t> dq(bcuda::quantized_x_bytes(rows, K));
        bcuda::quantize_x(xb, rows, K, dq.ptr, nullptr);
        bcuda::DecodeOptions o{0, 0, bcuda::DecodeKernel::kBalanced};
        o.xq = dq.ptr;
        poison(dy.ptr, dy.n);
        bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dy.ptr, nullptr, o);
        BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
        expect("decode bal. xq   " + tag, dy.to_host(), ref, decode_bound);
      }
    }
    // The streaming kernel (sm_90a; where it does not run, or K is not a multiple of 8, the same calls
    // take the register kernel): its own grid, and grids of 1, 2, 3 and 7 blocks (ranges of units
    // that cut tiles anywhere) and of two blocks per tile; a two-stage ring below.
    using DK = bcuda::DecodeKernel;
    const bool streams = bcuda::stream_kernel_supports(wb, K, xb);
    const int tiles64 = (N + 63) / 64;
    for (int blocks : {0, 1, 2, 3, 7, 2 * tiles64}) {
      if (!streams && blocks != 0) continue;
      if (blocks > tiles64 && blocks != 2 * tiles64) continue;
      poison(dy.ptr, dy.n);
      bcuda::DecodeOptions o{0, 0, DK::kStream};
      o.blocks = blocks;
      bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dy.ptr, nullptr, o);
      BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
      expect("stream blocks=" + std::to_string(blocks) + " " + tag, dy.to_host(), ref, decode_bound);
    }
    if (streams && tiles64 > 1) {  // more blocks than tiles, not twice them: refused, naming the numbers
      bcuda::DecodeOptions o{0, 0, DK::kStream};
      o.blocks = tiles64 + 1;
      expect_refused("stream blocks=" + std::to_string(tiles64 + 1),
                     std::to_string(tiles64 + 1) + " blocks for " + std::to_string(tiles64) + " tiles",
                     [&] { bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dy.ptr, nullptr, o); });
    }
    {  // x quantized before the call (DecodeOptions::xq), both kernels
      DeviceBuffer<uint8_t> dq(bcuda::quantized_x_bytes(rows, K));
      bcuda::quantize_x(xb, rows, K, dq.ptr, nullptr);
      for (DK kernel : {DK::kRegisters, DK::kStream, DK::kBalanced}) {
        bcuda::DecodeOptions o{0, 0, kernel};
        o.xq = dq.ptr;
        poison(dy.ptr, dy.n);
        bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dy.ptr, nullptr, o);
        BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
        const char* name = kernel == DK::kStream ? "stream" : kernel == DK::kBalanced ? "balanced" : "decode";
        expect(std::string(name) + " x before  " + tag, dy.to_host(), ref, decode_bound);
      }
    }
    poison(dy.ptr, dy.n);
    bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dy.ptr, nullptr, {0, 0, DK::kStream, 2});
    BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
    expect("stream 2 stages  " + tag, dy.to_host(), ref, decode_bound);
    for (int rps : {1, 4}) {  // both slot forms (4 only applies with at most 8 variant-groups)
      poison(dy.ptr, dy.n);
      bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dy.ptr, nullptr, {0, rps, DK::kRegisters});
      BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
      expect("decode slots/" + std::to_string(rps) + "  " + tag, dy.to_host(), ref, decode_bound);
    }
    {  // The delta terms alone, added to y (DecodeOptions::delta_only: the engine's path for 3 or more
       // gathered rows of several variants, where the streaming kernel does not run):
       // y holds the CPU's base beforehand, so y + the terms is the whole product. All rows in one
       // launch (delta_terms.cuh), x quantized by the call or before it; rows with no delta add
       // nothing; twice from the same y, the same floats (the warps' sums meet in a fixed order); a
       // kernel named is refused, and so is delta_store without delta_only.
      std::vector<DeltaRef> none(rows);
      std::vector<float> base(ref.size());
      bitdelta::cpu::fused_linear_reference(wv, xf, rows, none, nullptr, base);
      DeviceBuffer<float> dyb(base);
      bcuda::DecodeOptions o;
      o.delta_only = true;
      bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dyb.ptr, nullptr, o);
      BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float> first = dyb.to_host();
      expect("decode delta only " + tag, first, ref, decode_bound);
      DeviceBuffer<uint8_t> dq(bcuda::quantized_x_bytes(rows, K));
      bcuda::quantize_x(xb, rows, K, dq.ptr, nullptr, true);  // in pairs of blocks, as delta_only takes it
      DeviceBuffer<float> dyq(base);
      o.xq = dq.ptr;
      bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dyq.ptr, nullptr, o);
      BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float> second = dyq.to_host();
      expect("delta only x before " + tag, second, ref, decode_bound);
      ++checks;
      if (second != first) {
        ++failures;
        std::printf("FAIL delta only, twice: results differ  %s\n", tag.c_str());
      }
      for (int wk : {2, 4, 8}) {  // each number of warps along K, where the kernel's estimate chooses one
        DeviceBuffer<float> dyk(base);
        o.k_split = wk;
        bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dyk.ptr, nullptr, o);
        BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
        expect("delta only wk=" + std::to_string(wk) + "    " + tag, dyk.to_host(), ref, decode_bound);
      }
      o.k_split = 3;  // (refused by the terms kernel: only where some row has a delta)
      if (std::any_of(row_variant.begin(), row_variant.end(), [](int v) { return v >= 0; }))
        expect_refused("delta only on 3 warps along K", "3 warps along K (2, 4 or 8)",
                       [&] { bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dyb.ptr, nullptr, o); });
      o.k_split = 0;
      o.xq = nullptr;
      o.kernel = DK::kRegisters;
      expect_refused("delta only on a named kernel", "delta_only takes no kernel and no form_weights",
                     [&] { bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dyb.ptr, nullptr, o); });
      bcuda::DecodeOptions store_alone;
      store_alone.delta_store = true;
      expect_refused("delta store without delta only", "delta_store takes delta_only",
                     [&] { bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dyb.ptr, nullptr, store_alone); });
    }
    // Back to back on one stream, no synchronization between: the second call's quantized x must
    // not be read before its own quantization finished (programmatic dependent launch), nor
    // overwrite the first call's while that one still reads it.
    std::vector<uint16_t> x2(x.size());
    std::vector<float> x2f(x.size()), ref2(ref.size());
    for (size_t i = 0; i < x2.size(); ++i) x2f[i] = bitdelta::bf16_to_f32(x2[i] = bitdelta::f32_to_bf16(u(rng)));
    bitdelta::cpu::fused_linear_reference(wv, x2f, rows, host_refs, nullptr, ref2);
    DeviceBuffer<uint16_t> dx2(x2);
    DeviceBuffer<float> dy2(dy.n);
    for (DK kernel : {DK::kRegisters, DK::kStream, DK::kBalanced}) {
      const std::string name = kernel == DK::kStream ? "stream" : kernel == DK::kBalanced ? "balanced" : "decode";
      poison(dy.ptr, dy.n);
      poison(dy2.ptr, dy2.n);
      bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dy.ptr, nullptr, {0, 0, kernel});
      bcuda::fused_linear_decode(wb, N, K, reinterpret_cast<const __nv_bfloat16*>(dx2.ptr), rows, dev_refs, dy2.ptr,
                                 nullptr, {0, 0, kernel});
      BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
      expect(name + ", 2 in a row (1st) " + tag, dy.to_host(), ref, decode_bound);
      expect(name + ", 2 in a row (2nd) " + tag, dy2.to_host(), ref2, decode_bound);
    }
  }
  // The delta terms beside a GEMM (DeltaTermsBeside, a decode step's gathered rows in the engine):
  // forked over a buffer one row longer on each side than the rows, poisoned (NaN), the terms at
  // its second row. The terms are written, not added (delta_store), and the join zeroes the rest
  // (also with no terms added before it): rows outside and rows without a delta end exactly 0, the
  // rows' terms are exactly delta_only's on zeros in launches of up to 32 rows, and the CPU's base
  // plus them is the whole product. delta_store alone leaves the rows without a delta as they were.
  if (rows <= 2 * bcuda::kMaxDecodeRows) {
    static bcuda::DeltaTermsBeside beside;
    const size_t span = size_t(rows + 2) * N;
    DeviceBuffer<float> dt(span), dz(size_t(rows) * N);
    poison(dt.ptr, span);
    BITDELTA_CUDA_CHECK(cudaMemset(dz.ptr, 0, dz.n * sizeof(float)));
    BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
    beside.fork(nullptr, dt.ptr, span);
    beside.add_terms(wb, N, K, xb, rows, dev_refs, dt.ptr + N);
    beside.join(nullptr);
    bcuda::DecodeOptions o;
    o.delta_only = true;
    for (int c = 0; c < rows; c += bcuda::kMaxDecodeRows) {
      const int n = std::min(rows - c, bcuda::kMaxDecodeRows);
      bcuda::fused_linear_decode(wb, N, K, xb + size_t(c) * K, n, std::span(dev_refs).subspan(size_t(c), size_t(n)),
                                 dz.ptr + size_t(c) * N, nullptr, o);
    }
    BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> got = dt.to_host(), want = dz.to_host();
    if (rows <= bcuda::kMaxDecodeRows) {  // delta_store on a poisoned buffer, no join
      DeviceBuffer<float> ds(size_t(rows) * N);
      poison(ds.ptr, ds.n);
      o.delta_store = true;
      bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, ds.ptr, nullptr, o);
      o.delta_store = false;
      BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float> stored = ds.to_host();
      size_t bad = 0;
      for (int r = 0; r < rows; ++r)
        for (int n = 0; n < N; ++n) {
          const float v = stored[size_t(r) * N + n];
          bad += row_variant[r] >= 0 ? !(v == want[size_t(r) * N + n]) : !std::isnan(v);
        }
      ++checks;
      if (bad) ++failures;
      std::printf("%s delta store: %zu floats differ from the terms on zeros or touch a row without a delta  %s\n",
                  bad ? "FAIL" : "ok  ", bad, tag.c_str());
    }
    size_t outside = 0, inside = 0;
    for (size_t i = 0; i < size_t(N); ++i) outside += (got[i] != 0.0f) + (got[span - 1 - i] != 0.0f);
    for (size_t i = 0; i < want.size(); ++i) inside += !(got[size_t(N) + i] == want[i]);
    ++checks;
    if (outside || inside) ++failures;
    std::printf("%s terms beside: %zu floats outside the rows not 0, %zu inside differ  %s\n",
                outside || inside ? "FAIL" : "ok  ", outside, inside, tag.c_str());
    std::vector<DeltaRef> none(rows);
    std::vector<float> whole(ref.size());
    bitdelta::cpu::fused_linear_reference(wv, xf, rows, none, nullptr, whole);
    for (size_t i = 0; i < whole.size(); ++i) whole[i] += got[size_t(N) + i];
    expect("terms beside + base " + tag, whole, ref, decode_bound);
    poison(dt.ptr, span);
    BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
    beside.fork(nullptr, dt.ptr, span);  // no terms: zeroed all the same
    beside.join(nullptr);
    BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> zeros = dt.to_host();
    ++checks;
    const bool zeroed = std::all_of(zeros.begin(), zeros.end(), [](float f) { return f == 0.0f; });
    if (!zeroed) ++failures;
    std::printf("%s terms beside, forked and joined with no terms: buffer zeroed  %s\n", zeroed ? "ok  " : "FAIL",
                tag.c_str());
    if (rows <= bcuda::kMaxDecodeRows) {  // x quantized before, in pairs
      DeviceBuffer<uint8_t> dq(bcuda::quantized_x_bytes(rows, K));
      bcuda::quantize_x(xb, rows, K, dq.ptr, nullptr, true);
      poison(dt.ptr, span);
      BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
      beside.fork(nullptr, dt.ptr, span);
      beside.add_terms(wb, N, K, xb, rows, dev_refs, dt.ptr + N, dq.ptr);
      beside.join(nullptr);
      BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
      ++checks;
      const bool same = dt.to_host() == got;
      if (!same) ++failures;
      std::printf("%s terms beside, x quantized before: the same floats  %s\n", same ? "ok  " : "FAIL", tag.c_str());
    }
  }
  bool one_variant = true;
  for (int v : row_variant) one_variant = one_variant && v == row_variant[0];
  // W_eff formed from W's loads (DecodeOptions::form_weights): every row of one variant; W_eff in bf16
  // as the fused prefill GEMM rounds it, so the prefill bound. In the streaming kernel's stages (its
  // own grid, grids that cut tiles: 1, 3 blocks, two per tile; a two-stage ring), where it runs; in the
  // register kernel's registers on every GPU (each k_split). Twice in a row: the same result. Rows of
  // several variants, or none, are refused with one line naming the row, by both.
  if (rows <= bcuda::kMaxDecodeRows) {
    using DK = bcuda::DecodeKernel;
    const bool streams = bcuda::stream_kernel_supports(wb, K, xb);
    const int tiles64 = (N + 63) / 64;
    if (one_variant && row_variant[0] >= 0) {
      for (int blocks : {0, 1, 3, 2 * tiles64})
        for (int stages : {0, 2}) {
          if (!streams) continue;
          if (blocks > tiles64 && blocks != 2 * tiles64) continue;
          poison(dy.ptr, dy.n);
          bcuda::DecodeOptions o{0, 0, DK::kStream, stages};
          o.blocks = blocks;
          o.form_weights = true;
          const int calls = blocks == 0 && stages == 0 ? 2 : 1;  // twice in a row: the same result
          for (int c = 0; c < calls; ++c) bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dy.ptr, nullptr, o);
          BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
          expect("stream W_eff blocks=" + std::to_string(blocks) + " stages=" + std::to_string(stages) + " x" +
                     std::to_string(calls) + " " + tag,
                 dy.to_host(), ref, 4e-3);
        }
      for (int ks : {0, 1, 2, 4, 8}) {
        poison(dy.ptr, dy.n);
        bcuda::DecodeOptions o{ks, 0, DK::kRegisters};
        o.form_weights = true;
        const int calls = ks == 0 ? 2 : 1;
        for (int c = 0; c < calls; ++c) bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dy.ptr, nullptr, o);
        BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
        expect("registers W_eff ks=" + std::to_string(ks) + " x" + std::to_string(calls) + " " + tag, dy.to_host(), ref,
               4e-3);
      }
      // The balanced one-row kernel does not form W_eff, nor does the streaming kernel where it does
      // not run: refused with one line.
      for (DK kernel : {DK::kBalanced, DK::kStream}) {
        if (kernel == DK::kStream && streams) continue;
        bcuda::DecodeOptions o{0, 0, kernel};
        o.form_weights = true;
        expect_refused(std::string("W_eff on ") + (kernel == DK::kBalanced ? "balanced" : "stream") + " (" + tag + ")",
                       kernel == DK::kBalanced ? "not kBalanced" : "streaming kernel does not run here",
                       [&] { bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dy.ptr, nullptr, o); });
      }
    } else {
      int differs = 1;
      while (differs < rows && row_variant[differs] == row_variant[0]) ++differs;
      const std::string want = row_variant[0] < 0 ? "row 0 has no delta"
                                                  : "one variant; row " + std::to_string(differs) + " differs";
      for (DK kernel : {DK::kAuto, DK::kRegisters}) {
        bcuda::DecodeOptions o{0, 0, kernel};
        o.form_weights = true;
        expect_refused(std::string(kernel == DK::kAuto ? "auto" : "registers") + " W_eff (" + tag + ")", want,
                       [&] { bcuda::fused_linear_decode(wb, N, K, xb, rows, dev_refs, dy.ptr, nullptr, o); });
      }
    }
  }
  // Prefill paths: one variant for all rows (the first row's).
  if (one_variant && row_variant[0] >= 0) {
    bcuda::PrefillLinear prefill(nullptr, size_t(K) * 40);  // 40-row chunks: many chunks even here
    using M = bcuda::PrefillMethod;
    using S = bcuda::FusedSplit;
    struct Method {
      M m;
      const char* name;
      bcuda::PrefillLinear::FusedConfig fused;  // every tile shape runs on every case, both schedules
    };
    const Method methods[] = {{M::kTwoGemms, "two gemms ", {}},
                              {M::kMaterialize, "materialize", {}},
                              {M::kPipelined, "pipelined ", {}},
                              {M::kFused, "fused 128x128 sk", {128, 128, S::kStreamK}},
                              {M::kFused, "fused 128x128   ", {128, 128, S::kTilePerBlock}},
                              {M::kFused, "fused 64x256 sk ", {64, 256, S::kStreamK}},
                              {M::kFused, "fused 64x256    ", {64, 256, S::kTilePerBlock}},
                              {M::kFused, "fused 128x256 sk", {128, 256, S::kStreamK}},
                              {M::kFused, "fused 128x256   ", {128, 256, S::kTilePerBlock}},
                              {M::kFused, "fused 128x176 sk", {128, 176, S::kStreamK}},
                              {M::kFused, "fused 128x176   ", {128, 176, S::kTilePerBlock}},
                              {M::kFused, "fused 128x176 p ", {128, 176, S::kPersistent}},
                              {M::kFused, "fused 64x64 p   ", {64, 64, S::kPersistent}},
                              {M::kFused, "fused 64x64 sk  ", {64, 64, S::kStreamK}},
                              {M::kFused, "fused 64x64     ", {64, 64, S::kTilePerBlock}},
                              {M::kFused, "fused, default  ", {}},
                              // The portable kernel (mma.sync), each tile and ring, K split (at most
                              // K/64 ways) or not; its own choice.
                              {M::kFusedMma, "mma 128 rows, 3", {0, 0, S::kStreamK, 128, 3}},
                              {M::kFusedMma, "mma 128 rows, 4", {0, 0, S::kStreamK, 128, 4}},
                              {M::kFusedMma, "mma 64 rows, 3 ", {0, 0, S::kStreamK, 64, 3}},
                              {M::kFusedMma, "mma 64 rows, 4 ", {0, 0, S::kStreamK, 64, 4}},
                              {M::kFusedMma, "mma 64, split 3", {0, 0, S::kStreamK, 64, 3, 3}},
                              {M::kFusedMma, "mma 128, split 2", {0, 0, S::kStreamK, 128, 4, 2}},
                              {M::kFusedMma, "mma, default   ", {}}};
    static bool said = false;
    if (!said) {
      said = true;
      const std::string portable = "the portable kernel runs up to " + std::to_string(bcuda::kPortableFusedRows) +
                                   " rows, materialize past them";
      std::printf("fused gemm: %s on this GPU (K a multiple of 64, at least 128)\n",
                  prefill.fused_gemm_supported(wb, 1024, xb) ? "the sm_90a kernel runs" : portable.c_str());
    }
    for (auto [m, name, fused] : methods) {
      poison(dy.ptr, dy.n);
      prefill.set_fused_config(fused);
      prefill.run(m, wb, N, K, xb, rows, dev_refs[0], dy.ptr);
      BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
      expect(std::string("prefill ") + name + "  " + tag, dy.to_host(), ref, 4e-3);
    }
    // Twice in a row on one stream: the split tiles' counters are back at zero after a launch.
    if (prefill.fused_gemm_supported(wb, K, xb)) {
      prefill.set_fused_config({});
      poison(dy.ptr, dy.n);
      prefill.run(M::kFused, wb, N, K, xb, rows, dev_refs[0], dy.ptr);
      prefill.run(M::kFused, wb, N, K, xb, rows, dev_refs[0], dy.ptr);
      BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
      expect(std::string("prefill fused twice       ") + tag, dy.to_host(), ref, 4e-3);
    }
  }
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device\n");
    return 1;
  }
  {
    const auto* any = reinterpret_cast<const __nv_bfloat16*>(uintptr_t(256));  // aligned; not dereferenced
    std::printf("streaming decode kernel: %s\n", bcuda::stream_kernel_supports(any, 1024, any)
                                                     ? "runs on this GPU (sm_90a)"
                                                     : "not on this GPU (its calls run the register kernel)");
  }
  std::mt19937 rng(20261129);
  try {
    // The portable fused GEMM refuses, with one line, what it does not take (before any launch: the
    // pointers are never read).
    {
      const auto* any = reinterpret_cast<const __nv_bfloat16*>(uintptr_t(256));
      const auto* odd = reinterpret_cast<const __nv_bfloat16*>(uintptr_t(258));
      auto* y = reinterpret_cast<float*>(uintptr_t(256));
      const DeltaRef none{};
      expect_refused("mma gemm, K 100", "needs K a multiple of 64",
                     [&] { bcuda::mma_gemm(any, 64, 100, any, 8, none, y, nullptr, {64, 3, 1}); });
      expect_refused("mma gemm, unaligned x", "16-byte aligned W, x and signs",
                     [&] { bcuda::mma_gemm(any, 64, 128, odd, 8, none, y, nullptr, {64, 3, 1}); });
      expect_refused("mma gemm, split 3 of K 128", "not split 3 ways",
                     [&] { bcuda::mma_gemm(any, 64, 128, any, 8, none, y, nullptr, {64, 3, 3}); });
      expect_refused("mma gemm, tile 96", "no tile of 96 rows",
                     [&] { bcuda::mma_gemm(any, 64, 128, any, 8, none, y, nullptr, {96, 3, 1}); });
      // Its choice of tile and split is one it takes, within the shared memory the GPU allows a
      // block (8.6/8.9, A100, H100/H200) and with at least 4 stages of K per block where it splits.
      int chosen = 0, bad = 0;
      std::string first_bad;
      for (int N : {64, 4096, 12288, 22016, 32000})
        for (int K : {64, 128, 4096, 11008})
          for (int rows : {1, 33, 64, 100, 128, 200, 256, 512})
            for (int optin : {99 << 10, 163 << 10, 227 << 10})
              for (int sms : {28, 108, 132}) {
                const bcuda::MmaGemmConfig c = bcuda::mma_gemm_choose(N, K, rows, optin, sms);
                const int most = std::max(1, std::min(16, K / 64 / 4));
                const bool ok = (c.bn == 64 || c.bn == 128) && (c.stages == 3 || c.stages == 4) &&
                                bcuda::mma_gemm_smem(c) <= optin && c.k_split >= 1 && c.k_split <= most;
                ++chosen;
                if (!ok && bad++ == 0)
                  first_bad = std::to_string(N) + "x" + std::to_string(K) + ", " + std::to_string(rows) + " rows: " +
                              std::to_string(c.bn) + "/" + std::to_string(c.stages) + " split " + std::to_string(c.k_split);
              }
      ++checks;
      if (bad) ++failures;
      std::printf("%s mma gemm's choice valid in %d of %d cases%s\n", bad ? "FAIL" : "ok  ", chosen - bad, chosen,
                  bad ? (", first " + first_bad).c_str() : "");
    }
    // x quantized by one block in shared memory (the one-row kernel's transpose) against
    // quantize_x (ballots): the same bytes, on aligned and unaligned x, K not a multiple of 256 or
    // of 8, a block of zeros, one value far above the rest, tiny values.
    for (int K : {7, 131, 256, 1001, 4096, 11008, 30000})
      for (int offset : {0, 1}) {
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        std::vector<uint16_t> x(size_t(K) + offset);
        for (size_t i = 0; i < x.size(); ++i) {
          const size_t b = (i - offset) / 256;
          const float v = b % 5 == 1 ? 0.0f : b % 5 == 2 ? 1e-30f * u(rng) : u(rng);
          x[i] = bitdelta::f32_to_bf16(i % 97 == 3 ? 300.0f * v : v);
        }
        DeviceBuffer<uint16_t> dx(x);
        const auto* xb = reinterpret_cast<const __nv_bfloat16*>(dx.ptr) + offset;
        const size_t bytes = bcuda::quantized_x_bytes(1, K);
        DeviceBuffer<uint8_t> a(bytes), b(bytes);
        BITDELTA_CUDA_CHECK(cudaMemset(a.ptr, 0, bytes));
        BITDELTA_CUDA_CHECK(cudaMemset(b.ptr, 0xff, bytes));
        bcuda::quantize_x(xb, 1, K, a.ptr, nullptr);
        bcuda::quantize_x_in_block(xb, K, b.ptr, nullptr);
        BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<uint8_t> ha = a.to_host(), hb = b.to_host();
        // Compare the bytes quantize_x writes: per block (scale, Σq) and the fragments.
        size_t differ = 0;
        const size_t blk = bytes / size_t((K + 255) / 256);  // one block: (scale, Σq) at 0, fragments at 256
        for (size_t i = 0; i < bytes; ++i)
          if ((i % blk < 8 || i % blk >= 256) && ha[i] != hb[i]) ++differ;
        ++checks;
        if (differ) ++failures;
        std::printf("%s x quantized in one block = quantize_x, K %d%s: %zu bytes differ\n", differ ? "FAIL" : "ok  ", K,
                    offset ? " (unaligned)" : "", differ);
      }
    // Decode: mixed variants, shared variants, rows without delta, odd and aligned K.
    struct Shape {
      int N, K;
    };
    const Shape shapes[] = {{64, 64},     {37, 131}, {100, 1001}, {257, 4096},
                            {130, 11008}, {33, 7},   {16, 200}};
    for (const Shape s : shapes)
      for (bool per_row : {true, false}) {
        check_case(rng, s.N, s.K, {0}, 1, per_row);
        check_case(rng, s.N, s.K, {-1}, 1, per_row);
        check_case(rng, s.N, s.K, {-1, 1, -1}, 2, per_row);  // one row with a delta, not the first
        check_case(rng, s.N, s.K, {2, 0, -1, 1, 0}, 3, per_row);
        std::vector<int> sixteen(16);
        for (int r = 0; r < 16; ++r) sixteen[r] = r;
        check_case(rng, s.N, s.K, sixteen, 16, per_row);
        check_case(rng, s.N, s.K, {3, 3, 1, -1, 0, 2, 3, 1, 1, 0, -1, 3}, 4,
                   per_row);  // variants in both groups
        check_case(rng, s.N, s.K, std::vector<int>(9, 0), 1, per_row);
      }
    // More 64-row tiles than an H200 has multiprocessors (136 for 132): the streaming kernel's ranges
    // of units, a tile cut between two blocks at most block boundaries.
    {
      std::vector<int> rows16(16);
      for (int r = 0; r < 16; ++r) rows16[r] = r % 5 == 4 ? -1 : r % 7;
      check_case(rng, 8645, 2048, rows16, 7, true);
      check_case(rng, 8645, 2048, {1, 0, 1}, 2, false);
    }
    // 16 rows of 16 variants at 4096²: the delta terms' 16 single-row slots in two waves of blocks at
    // 4 warps along K, so on 132 multiprocessors in one at 2 (delta_terms.cu's estimate).
    {
      std::vector<int> sixteen(16);
      for (int r = 0; r < 16; ++r) sixteen[r] = r;
      check_case(rng, 4096, 4096, sixteen, 16, true);
    }
    // One row on more 16-row tiles than an H200 runs blocks at once (2 × 132): the balanced grid
    // cuts tiles between blocks (aligned K; K not a multiple of 64; about one tile per block).
    for (bool per_row : {true, false}) {
      check_case(rng, 8645, 2048, {0}, 1, per_row);
      check_case(rng, 5000, 1001, {0}, 1, per_row);
    }
    check_case(rng, 8645, 2048, {-1}, 1, true);
    check_case(rng, 4500, 4096, {0}, 1, true);
    check_case(rng, 8200, 300, {0}, 1, false);  // 513 tiles: whole tiles per block (1 or 2)
    // One row with a long K: the balanced grid's x quantized in more than 48 KB of shared memory
    // (asked for at launch); past its limit (100 KB), the register kernel after a quantizing launch.
    check_case(rng, 40, 30000, {0}, 1, true);
    check_case(rng, 24, 50000, {0}, 1, false);
    // 17..32 rows: the streaming kernel in one launch (wgmma n32), the register kernel in two.
    {
      std::vector<int> rows32(32), rows24(24);
      for (int r = 0; r < 32; ++r) rows32[r] = r % 9 == 8 ? -1 : (r * 5) % 13;
      for (int r = 0; r < 24; ++r) rows24[r] = r / 2;
      check_case(rng, 257, 4096, rows32, 13, true);
      check_case(rng, 130, 1024, rows24, 12, false);
      check_case(rng, 8645, 512, rows32, 13, false);
    }
    // 40 rows of several variants: the terms beside a GEMM in two launches (32 and 8 rows).
    {
      std::vector<int> rows40(40);
      for (int r = 0; r < 40; ++r) rows40[r] = r % 6 == 5 ? -1 : (r * 7) % 11;
      check_case(rng, 257, 4096, rows40, 11, true);
    }
    // Up to 32 rows of one variant: W_eff formed by the streaming kernel (and the decode kernels).
    for (bool per_row : {true, false}) {
      check_case(rng, 8645, 2048, std::vector<int>(32, 0), 1, per_row);  // 136 tiles: some cut
      check_case(rng, 257, 4096, std::vector<int>(17, 0), 1, per_row);
    }
    check_case(rng, 8200, 300, std::vector<int>(24, 0), 1, true);  // K: a block and a part
    check_case(rng, 4500, 4096, std::vector<int>(8, 0), 1, false);
    // Prefill: many rows of one variant.
    for (const Shape s : {Shape{300, 512}, Shape{129, 1003}, Shape{1024, 4096}})
      for (bool per_row : {true, false})
        check_case(rng, s.N, s.K, std::vector<int>(77, 0), 1, per_row);
    // The fused GEMM's tiles (128 output rows × 128 rows of x) with partial edges in both.
    for (bool per_row : {true, false}) check_case(rng, 520, 1024, std::vector<int>(300, 0), 1, per_row);
    check_case(rng, 200, 576, std::vector<int>(150, 0), 1, true);  // 9 stages of 64 columns: an odd count
    check_case(rng, 72, 64, std::vector<int>(40, 0), 1, false);     // one stage (the portable kernel's ring)
    check_case(rng, 136, 192, std::vector<int>(200, 0), 1, true);   // three stages, 2 tiles of x's rows
    // More tiles than an H200 has multiprocessors (64 × 256 tiles: 136 × 2 = 272 for 132): whole
    // tiles, then a wave and a bit split by stages, each split tile in two or three pieces.
    check_case(rng, 8645, 1024, std::vector<int>(300, 0), 1, true);
  } catch (const std::exception& e) {
    std::printf("FAIL exception: %s\n", e.what());
    return 1;
  }
  std::printf("%d of %d checks passed\n", checks - failures, checks);
  return failures == 0 ? 0 : 1;
}
