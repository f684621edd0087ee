// Benchmark of the CUDA fused BitDelta linear against cuBLAS and the byte roofline (issue 6, part
// 1). Cases per shape N×K (bf16 weights):
//   (a) 1 row, 1 variant: fused decode kernel vs cuBLAS base-only GEMV (cublasGemmEx, n = 1), also
//   timed alternating with it
//   (b) 16 rows from 16 distinct variants vs the byte roofline (2NK + 16·NK/8 bytes ÷ copy
//   bandwidth) (c) 512 rows, 1 variant: prefill methods vs cuBLAS base-only GEMM
// Modes: (none) all cases at the five shapes; --prefill [N K ...] case (c) only, at those shapes or
// the five; --one-row [N K ...] case (a) only (alone, alternating, in chains of 20, and after a norm
// as in a step: chains and CUDA graphs of 20 norm + linear pairs less the norms alone); --many-variants
// [N K ...] cases (b), d and e only (rows of several variants); --few-rows
// [N K ...] case c' (8–48 rows of one variant) only; --prefill-rows R [N K ...] case (c) with R rows
// instead of 512 (not c'); --prefill-fresh-x [N K ...] case (c) (not c') with x copied into place
// before each call, untimed (as a model's prompt finds it: just written); --quick the first shape;
// --profile [N K], --profile-prefill [N K [rows]] few reps (for ncu); --portable-sweep R1,R2,... [N K ...] the
// portable fused GEMM's configurations at those row counts;
// --tile-read [N K ...] the streaming kernel's TMA ring alone in several stage geometries (tile_read.h);
// --stream-trace [N K ...] the streaming kernel's per-block timeline (a BITDELTA_STREAM_TRACE build), also
// with x quantized before and with parts of its work knocked out (stream_knockout); --route-trace [N K ...]
// (b)'s route with its two branches on one timeline (the same build).
// Timing: CUDA events around each call, warm-up, median of many reps; every rep uses the next of
// several weight/sign buffer sets so that the 60 MB L2 never serves them; data random (never
// zeros). The device-to-device copy bandwidth (read + write) is measured in the same run: the
// roofline. x stays the same buffer; (c) ends with the engine's choice and cuBLAS timed once more with
// x copied into place before each call ("x just written", untimed), as a model's prompt finds it:
// left clean in L2 by the call before, x made one ring look faster than two at 4096 × 11008, where
// with x just written it took 1.54–1.56 × cuBLAS against 1.22–1.25 (run 415, H100).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/delta_terms.cuh"
#include "backend/cuda/delta_terms_beside.cuh"
#include "backend/cuda/fused_linear_decode.cuh"
#include "backend/cuda/fused_linear_stream.cuh"
#include "backend/cuda/fused_linear_prefill.cuh"
#include "backend/cuda/ops.cuh"
#include "common.h"
#include "read_floor.h"
#include "tile_read.h"

namespace {

using bitdelta::DeltaRef;
namespace bcuda = bitdelta::cuda;
using bitdelta::bench::DeviceMem;
using bitdelta::bench::median;
using bitdelta::bench::ChainWait;
using bitdelta::bench::read_floor_chain_best;
using bitdelta::bench::read_floor_us;
using bitdelta::bench::ReadFloor;
using bitdelta::bench::ReadRegion;
using bitdelta::bench::time_chain_us;
using bitdelta::bench::time_pair_us;
using bitdelta::bench::time_us;
using bf16 = __nv_bfloat16;

// The chained floors of a kernel that reads x written by the launch before (read_floor.h).
constexpr std::pair<ChainWait, const char*> floor_waits[] = {
    {ChainWait::kAfter, "after the wait"},
    {ChainWait::kFirstBatchBefore, "first batch before the wait"},
    {ChainWait::kFirstBatchToL2, "first batch to L2 before the wait"}};


// Fills device memory from a random host pattern of 64 MiB (random bf16 of U(-1,1)·scale, or
// bytes).
class RandomFill {
 public:
  RandomFill() : bf16_((32u << 20) + 64), bytes_((64u << 20) + 128) {
    std::mt19937 rng(12345);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (auto& v : bf16_) v = __float2bfloat16(u(rng));
    for (auto& b : bytes_) b = uint8_t(rng());
  }
  void fill(void* dst, size_t bytes, bool as_bf16) const {
    const uint8_t* src = as_bf16 ? reinterpret_cast<const uint8_t*>(bf16_.data()) : bytes_.data();
    const size_t chunk = 64u << 20;
    for (size_t off = 0; off < bytes; off += chunk)
      BITDELTA_CUDA_CHECK(cudaMemcpy(static_cast<uint8_t*>(dst) + off, src + (off / chunk % 7) * 16,
                                     std::min(chunk, bytes - off), cudaMemcpyHostToDevice));
  }

 private:
  std::vector<bf16> bf16_;
  std::vector<uint8_t> bytes_;
};

struct Row {
  std::string shape, kase, version;
  double us, bytes, ref_us;  // ref_us: cuBLAS time (ratio) or roofline time (fraction)
  const char* ref_name;
};

std::vector<Row> table;
double copy_bw = 0;  // bytes/s

void print_row(const Row& r) {
  std::printf("%-12s %-22s %-26s %10.2f %10.1f %8.0f %7.3f %7.3f %s\n", r.shape.c_str(),
              r.kase.c_str(), r.version.c_str(), r.us, r.bytes / 1e6, r.bytes / r.us / 1e3,
              (r.bytes / copy_bw * 1e6) / r.us, r.ref_us > 0 ? r.us / r.ref_us : 0.0, r.ref_name);
  std::fflush(stdout);
}

void add(Row r) {
  print_row(r);
  table.push_back(std::move(r));
}

// The ends of traced launches (µs from the launch's first entry), one value per block or per
// multiprocessor with its SM id: per launch the span (last end), the earliest and median end and the
// average idle tail (last end − an end); per multiprocessor its end against its launch's median,
// kept by launch parity, so that the even launches' averages can be compared with the odd ones'.
struct EndStats {
  std::vector<double> span, end_min, end_med, idle;
  std::vector<std::vector<double>> sm_rel[2];
  void add(int launch, const std::vector<std::pair<size_t, double>>& ends) {
    std::vector<double> e;
    for (const auto& [sm, t] : ends) e.push_back(t);
    const double last = *std::max_element(e.begin(), e.end()), med = median(e);
    double idle_sum = 0;
    for (double t : e) idle_sum += last - t;
    span.push_back(last);
    end_min.push_back(*std::min_element(e.begin(), e.end()));
    end_med.push_back(med);
    idle.push_back(idle_sum / double(e.size()));
    auto& rel = sm_rel[launch & 1];
    for (const auto& [sm, t] : ends) {
      if (rel.size() <= sm) rel.resize(sm + 1);
      rel[sm].push_back(t - med);
    }
  }
  // "span …, ends min … median …, idle tail …" (medians over the launches).
  std::string summary() const {
    char buf[160];
    std::snprintf(buf, sizeof buf, "span %.2f, ends min %.2f median %.2f, idle tail %.2f", median(span),
                  median(end_min), median(end_med), median(idle));
    return buf;
  }
  // The fastest and slowest multiprocessors on average, and the even/odd launches' correlation (over
  // the SMs that ran in both).
  void print_sm_spread(const std::string& shape, const std::string& what) const {
    std::vector<std::pair<double, int>> mean_all;
    std::vector<double> even, odd;
    const auto mean = [](const std::vector<double>& v) {
      double a = 0;
      for (double x : v) a += x;
      return a / double(v.size());
    };
    for (size_t sm = 0; sm < std::min(sm_rel[0].size(), sm_rel[1].size()); ++sm) {
      if (sm_rel[0][sm].empty() || sm_rel[1][sm].empty()) continue;
      even.push_back(mean(sm_rel[0][sm]));
      odd.push_back(mean(sm_rel[1][sm]));
      mean_all.emplace_back((even.back() + odd.back()) / 2, int(sm));
    }
    double corr = 0;
    if (even.size() > 2) {
      const double me = mean(even), mo = mean(odd);
      double sxy = 0, sxx = 0, syy = 0;
      for (size_t i = 0; i < even.size(); ++i) {
        sxy += (even[i] - me) * (odd[i] - mo), sxx += (even[i] - me) * (even[i] - me), syy += (odd[i] - mo) * (odd[i] - mo);
      }
      corr = sxy / std::sqrt(sxx * syy);
    }
    std::sort(mean_all.begin(), mean_all.end());
    std::printf("%-12s trace %-20s per SM, end - median (us): fastest", shape.c_str(), what.c_str());
    for (size_t i = 0; i < std::min<size_t>(6, mean_all.size()); ++i)
      std::printf(" %d:%.2f", mean_all[i].second, mean_all[i].first);
    std::printf("; slowest");
    for (size_t i = mean_all.size() > 6 ? mean_all.size() - 6 : 0; i < mean_all.size(); ++i)
      std::printf(" %d:%.2f", mean_all[i].second, mean_all[i].first);
    std::printf("; even/odd launches' correlation %.2f\n", corr);
  }
};

constexpr int kTraceLaunches = 12;

// The floor's read kernel (read_floor.cu) on the same bytes, 8 blocks of 256 threads per SM, traced:
// an SM's end is its last block's; medians over the launches. Whether plain loads see the per-SM
// differences that the streaming kernel's copies do.
void trace_floor(const std::string& shape, const std::string& what,
                 const std::function<std::vector<ReadRegion>(int)>& regions) {
  for (int s = 0; s < 2; ++s) bitdelta::bench::read_floor_trace(regions(s), 8, 256);
  EndStats stats;
  for (int l = 0; l < kTraceLaunches; ++l) {
    const auto t = bitdelta::bench::read_floor_trace(regions(l), 8, 256);
    const size_t nb = t.size() / 3;
    unsigned long long t0 = ~0ull;
    for (size_t b = 0; b < nb; ++b) t0 = std::min(t0, t[3 * b]);
    std::vector<double> sm_end;  // −1: no block ran there
    for (size_t b = 0; b < nb; ++b) {
      const size_t sm = size_t(t[3 * b + 2]);
      if (sm_end.size() <= sm) sm_end.resize(sm + 1, -1.0);
      sm_end[sm] = std::max(sm_end[sm], (double(t[3 * b + 1]) - double(t0)) * 1e-3);
    }
    std::vector<std::pair<size_t, double>> ends;
    for (size_t sm = 0; sm < sm_end.size(); ++sm)
      if (sm_end[sm] >= 0) ends.emplace_back(sm, sm_end[sm]);
    stats.add(l, ends);
  }
  std::printf("%-12s trace %-20s %s (ends: the SMs')\n", shape.c_str(), what.c_str(), stats.summary().c_str());
  stats.print_sm_spread(shape, what);
}

// --stream-trace: launches of the streaming kernel one at a time (the device idle between), each
// block's timeline read back (fused_linear_stream.cuh, a BITDELTA_STREAM_TRACE build). Prints, as
// medians over the launches, in µs from the first block's entry: EndStats' span, ends and idle tail
// (over blocks); when the median block's first stage landed and its producer issued its last copy;
// the time from a piece's last stage to its written sums (its epilogue: of pieces before a block's
// last, and of last pieces); and EndStats' per-SM spread.
void trace_stream(const std::string& shape, const std::string& what, const std::function<void(int)>& fn) {
#ifdef BITDELTA_STREAM_TRACE
  namespace c = bitdelta::cuda;
  for (int s = 0; s < 4; ++s) fn(s);
  c::stream_trace_take();
  EndStats stats;
  std::vector<double> first, issued, epi, epi_last;
  for (int l = 0; l < kTraceLaunches; ++l) {
    fn(l);
    const auto t = c::stream_trace_take();
    const auto at = [&](int b, int e) { return t[size_t(b) * c::kTraceEvents + e]; };
    int nb = 0;
    while (nb < c::kTraceBlocks && at(nb, c::kTraceSm)) ++nb;
    unsigned long long t0 = ~0ull;
    for (int b = 0; b < nb; ++b) t0 = std::min(t0, at(b, c::kTraceEntry));
    const auto us = [&](unsigned long long v) { return (double(v) - double(t0)) * 1e-3; };
    std::vector<double> f, is;
    std::vector<std::pair<size_t, double>> ends;
    for (int b = 0; b < nb; ++b) {
      f.push_back(us(at(b, c::kTraceFirst)));
      is.push_back(us(at(b, c::kTraceIssued)));
      ends.emplace_back(size_t(at(b, c::kTraceSm) - 1), us(at(b, c::kTraceDone)));
      int np = 0;
      while (np < c::kTracePieces && at(b, c::kTracePiece + 2 * np + 1)) ++np;
      for (int j = 0; j < np; ++j)
        (j == np - 1 ? epi_last : epi)
            .push_back(us(at(b, c::kTracePiece + 2 * j + 1)) - us(at(b, c::kTracePiece + 2 * j)));
    }
    stats.add(l, ends);
    first.push_back(median(f));
    issued.push_back(median(is));
  }
  // "-": no such pieces (or, with the epilogue knocked out, none recorded).
  const auto med = [](const std::vector<double>& v) {
    return v.empty() ? std::string("-") : std::to_string(median(v)).substr(0, 4);
  };
  std::printf("%-12s trace %-20s %s; first stage %.2f, last copy issued %.2f; epilogue %s (pieces before the last), "
              "%s (last pieces)\n",
              shape.c_str(), what.c_str(), stats.summary().c_str(), median(first), median(issued), med(epi).c_str(),
              med(epi_last).c_str());
  stats.print_sm_spread(shape, what);
#else
  (void)fn;
  std::printf("%-12s trace %s: build with -DBITDELTA_STREAM_TRACE=ON (CMake) for the timeline\n", shape.c_str(),
              what.c_str());
#endif
}

#ifdef BITDELTA_STREAM_TRACE
// --route-trace: (b)'s route in graphs of 20 (run(l, parts) launches graph l of the form), the last
// route's blocks read back: the streaming base's (fused_linear_stream.cuh's trace) and the delta terms'
// (delta_terms.cuh's). Prints per form, medians over the launches, µs from the first entry of either:
// the span to the last block's end; per kernel the first, median and last entry and end (the terms'
// wait for x's quantizing too); then, for the last launch, the blocks of each resident per µs.
void route_trace(const std::string& shape, const std::function<void(int, int)>& run,
                 const std::vector<std::pair<int, const char*>>& forms) {
  namespace c = bitdelta::cuda;
  for (const auto& [parts, name] : forms) {
    for (int l = 0; l < 4; ++l) run(l, parts);
    c::stream_trace_take();
    c::terms_trace_take();
    std::vector<std::vector<double>> stat(14);
    std::vector<std::pair<double, double>> last_s, last_t;
    int nstream = 0, nterms = 0;
    for (int l = 0; l < kTraceLaunches; ++l) {
      run(l, parts);
      const auto ts = c::stream_trace_take(), tt = c::terms_trace_take();
      std::vector<std::pair<double, double>> sb, tb;  // (entry, end) in ns
      std::vector<double> tw;
      for (int b = 0; b < c::kTraceBlocks; ++b) {
        const auto* e = &ts[size_t(b) * c::kTraceEvents];
        if (e[c::kTraceSm]) sb.emplace_back(double(e[c::kTraceEntry]), double(e[c::kTraceDone]));
      }
      for (int b = 0; b < c::kTermsTraceBlocks; ++b) {
        const auto* e = &tt[size_t(b) * c::kTermsTraceEvents];
        if (e[c::kTermsSm]) tb.emplace_back(double(e[c::kTermsEntry]), double(e[c::kTermsDone])), tw.push_back(double(e[c::kTermsWaited]));
      }
      double t0 = 1e30, t1 = 0;
      for (const auto* v : {&sb, &tb})
        for (auto [a, b] : *v) t0 = std::min(t0, a), t1 = std::max(t1, b);
      const auto us = [&](double v) { return (v - t0) * 1e-3; };
      const auto pick = [&](const std::vector<std::pair<double, double>>& v, bool end, int q) {  // q: 0 min, 1 median, 2 max
        if (v.empty()) return -1.0;
        std::vector<double> x;
        for (auto [a, b] : v) x.push_back(us(end ? b : a));
        std::sort(x.begin(), x.end());
        return q == 0 ? x.front() : q == 1 ? x[x.size() / 2] : x.back();
      };
      stat[0].push_back(us(t1));
      for (int q = 0; q < 3; ++q) {
        stat[1 + q].push_back(pick(sb, false, q)), stat[4 + q].push_back(pick(sb, true, q));
        stat[7 + q].push_back(pick(tb, false, q)), stat[10 + q].push_back(pick(tb, true, q));
      }
      std::vector<double> waited;
      for (double v : tw) waited.push_back(us(v));
      stat[13].push_back(waited.empty() ? -1.0 : median(waited));
      nstream = int(sb.size()), nterms = int(tb.size());
      last_s.clear(), last_t.clear();
      for (auto [a, b] : sb) last_s.emplace_back(us(a), us(b));
      for (auto [a, b] : tb) last_t.emplace_back(us(a), us(b));
    }
    const auto m = [&](int i) { return median(stat[size_t(i)]); };
    std::printf("%-12s route trace %-36s span %.2f us; stream base (%d blocks) entries %.2f / %.2f / %.2f, ends %.2f / "
                "%.2f / %.2f; terms (%d blocks) entries %.2f / %.2f / %.2f, past the wait (median) %.2f, ends %.2f / "
                "%.2f / %.2f (first / median / last)\n",
                shape.c_str(), name, m(0), nstream, m(1), m(2), m(3), m(4), m(5), m(6), nterms, m(7), m(8), m(9), m(13),
                m(10), m(11), m(12));
    const auto profile = [&](const char* what, const std::vector<std::pair<double, double>>& v) {
      std::printf("%-12s   %-36s %s resident per us:", shape.c_str(), name, what);
      for (double t = 0; t < m(0) + 0.5; t += 1.0) {
        int n = 0;
        for (auto [a, b] : v) n += a <= t + 0.5 && t + 0.5 < b;
        std::printf(" %d", n);
      }
      std::printf("\n");
    };
    profile("stream base blocks", last_s);
    profile("terms blocks", last_t);
  }
}
#endif

// profile_only: cases (a) and (b) only, few reps (for ncu); prefill_only: case (c) only (with
// profile_only too: cuBLAS and the fused GEMM, few reps).
constexpr auto kRegisters = bcuda::DecodeKernel::kRegisters, kStream = bcuda::DecodeKernel::kStream,
               kBalanced = bcuda::DecodeKernel::kBalanced;

// Rotating sets of W (random bf16) and, per set, `variants` deltas (random sign bits in the packed
// device layout, for which the layout changes nothing; α per row in [0.001, 0.003)): enough sets that
// one rotation holds more than 4× the 60 MB L2, so that no rep finds its operands there.
class WeightSets {
 public:
  WeightSets(const RandomFill& rnd, int N, int K, int variants)
      : variants_(variants), nsets_(int(std::max<size_t>(2, (240u << 20) / (size_t(N) * K * 2) + 1))) {
    const size_t wbytes = size_t(N) * K * 2, sbytes = bcuda::packed_signs_bytes(N, K);
    for (int s = 0; s < nsets_; ++s) {
      w_.push_back(std::make_unique<DeviceMem>(wbytes));
      rnd.fill(w_.back()->ptr, wbytes, true);
      for (int v = 0; v < variants; ++v) {
        signs_.push_back(std::make_unique<DeviceMem>(sbytes));
        rnd.fill(signs_.back()->ptr, sbytes, false);
        alpha_.push_back(std::make_unique<DeviceMem>(size_t(N) * 4));
        std::vector<float> a(N);
        std::mt19937 rng(s * 100 + v);
        for (auto& x : a) x = 0.001f + 0.002f * float(rng() % 1000) / 1000.0f;
        BITDELTA_CUDA_CHECK(cudaMemcpy(alpha_.back()->ptr, a.data(), a.size() * 4, cudaMemcpyHostToDevice));
      }
    }
  }
  const bf16* W(int s) const { return static_cast<const bf16*>(w_[size_t(s % nsets_)]->ptr); }
  DeltaRef delta(int s, int v) const {
    const size_t i = size_t(s % nsets_) * variants_ + v;
    return DeltaRef{static_cast<const uint8_t*>(signs_[i]->ptr), static_cast<const float*>(alpha_[i]->ptr), true};
  }

 private:
  int variants_, nsets_;
  std::vector<std::unique_ptr<DeviceMem>> w_, signs_, alpha_;
};

// The input of a linear as the step makes it: up to 32 rows written by the one-row norm before the
// linear (add_rmsnorm, launched chained as in the model), so that a bench can time a linear after a
// light launch rather than after another linear (NOTES.md, part 50). Norm weights 1, x normal(0, 1).
struct NormedX {
  static constexpr int kRows = 32;
  int K;
  DeviceMem xf, gamma, xn, desc;
  explicit NormedX(int k)
      : K(k), xf(size_t(kRows) * k * 4), gamma(size_t(k) * 4), xn(size_t(kRows) * k * 2),
        desc(sizeof(bcuda::RowDesc) * kRows) {
    std::vector<float> ones(static_cast<size_t>(k), 1.0f), xv(static_cast<size_t>(kRows) * k);
    std::mt19937 g(7);
    std::normal_distribution<float> nd;
    for (auto& v : xv) v = nd(g);
    BITDELTA_CUDA_CHECK(cudaMemcpy(xf.ptr, xv.data(), xv.size() * 4, cudaMemcpyHostToDevice));
    BITDELTA_CUDA_CHECK(cudaMemcpy(gamma.ptr, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
    std::vector<bcuda::RowDesc> rd(kRows);
    for (auto& r : rd) r.norms = static_cast<const float*>(gamma.ptr);
    BITDELTA_CUDA_CHECK(cudaMemcpy(desc.ptr, rd.data(), rd.size() * sizeof(bcuda::RowDesc), cudaMemcpyHostToDevice));
  }
  const bf16* x() const { return static_cast<const bf16*>(xn.ptr); }
  void norm(int rows, cudaStream_t st) const {
    bcuda::add_rmsnorm(static_cast<float*>(xf.ptr), nullptr, static_cast<const bcuda::RowDesc*>(desc.ptr), nullptr,
                       rows, K, 0, -1, 1e-5f, static_cast<bf16*>(xn.ptr), st);
  }
};

// cuBLAS on the base alone: y[rows, N] f32 = x[rows, K] · Wᵀ.
void cublas_base(bcuda::PrefillLinear& prefill, const bf16* w, int N, int K, const bf16* x, int rows, float* y) {
  const float one = 1.0f, zero = 0.0f;
  BITDELTA_CUBLAS_CHECK(cublasGemmEx(prefill.handle(), CUBLAS_OP_T, CUBLAS_OP_N, N, rows, K, &one, w, CUDA_R_16BF, K,
                                     x, CUDA_R_16BF, K, &zero, y, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
}

void bench_shape(const RandomFill& rnd, bcuda::PrefillLinear& prefill, int N, int K,
                 bool profile_only = false, bool prefill_only = false, int prefill_rows = 512,
                 bool few_rows_only = false, bool one_row_only = false, bool many_only = false,
                 int trace_only = 0, bool c_only = false, bool fresh_x = false) {
  const size_t wbytes = size_t(N) * K * 2, sbytes = bcuda::packed_signs_bytes(N, K);
  const int kVariants = 16, kPrefillRows = prefill_rows;
  const std::string c_rows = "c: " + std::to_string(kPrefillRows) + " rows";
  const WeightSets sets(rnd, N, K, kVariants);
  const size_t x_rows = std::max(kPrefillRows, 512);
  DeviceMem x(x_rows * K * 2), y(x_rows * N * 4);
  rnd.fill(x.ptr, x_rows * K * 2, true);
  auto W = [&](int s) { return sets.W(s); };
  auto delta = [&](int s, int v) { return sets.delta(s, v); };
  const auto* X = static_cast<const bf16*>(x.ptr);
  float* Y = static_cast<float*>(y.ptr);
  const bool stream_runs = bcuda::stream_kernel_supports(W(0), K, X);
  const std::unique_ptr<NormedX> normed = K <= bcuda::kMaxHidden ? std::make_unique<NormedX>(K) : nullptr;
  const std::string shape = std::to_string(N) + "x" + std::to_string(K);
  const int reps = profile_only ? 1 : wbytes > (200u << 20) ? 30 : 100;
  auto cublas_rows = [&](int rows, int s) { cublas_base(prefill, W(s), N, K, X, rows, Y); };
  // The engine's route for gathered rows of several variants (device_model.cu linear()), through
  // the same calls: a second stream writes the delta terms to a buffer of their own
  // (DeltaTermsBeside) while cuBLAS takes the base (PrefillLinear, kBaseOnly); the join; then, with
  // `add`, y += the buffer (add_to). Without, the linear ends at the join: in the engine the kernel
  // that consumes y then reads the buffer too (ops.cuh, terms), rows·N·4 bytes more there. As the
  // engine's decode step is, the calls are captured into a CUDA graph and replayed: `chain` routes
  // of consecutive weight sets in one graph (made on first use, after one uncaptured run of each),
  // timed per route; with `chain` 0 they are issued one by one (9 calls: at 4096² they took longer to
  // issue than the GPU's work, run 343).
  DeviceMem yd(size_t(32) * N * 4);
  static bcuda::DeltaTermsBeside beside;
  static const cudaStream_t capture = [] {
    cudaStream_t st;
    BITDELTA_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    return st;
  }();
  // parts: kBoth, or one branch alone (the fork and join kept): what each takes in the same form.
  // kStreamBase: the streaming kernel with no delta takes the base instead of cuBLAS (alone at 4096²,
  // 16 rows: 15.5 against 18.5 µs, run 346; beside the terms it gained only at 4096², run 348).
  // kXqBefore: x's 16 rows quantized once before (pairs form), the terms' quantizing launch left out:
  // the route as it would run if the kernels producing x quantized it (tried in the engine and
  // dropped, run 352: below).
  // kAfterNorm: the norm that writes the rows' x first (NormedX), the route reading that x; alone, the
  // norm only (no fork or join).
  // With kStreamBase: kBaseFirst, the base issued before the terms; parts >> kBlocksShift, the
  // streaming base's blocks (DecodeOptions::blocks; 0: its rule), fewer leaving multiprocessors to
  // the terms. (Session 55 also had the streaming base take 1, 2 or 4 variants' terms itself beside
  // the terms of the rest: 1.69-1.78x at 4096², run 376; dropped.)
  // kEngineBase: the base as the engine's route takes it: where the streaming kernel runs, it on its
  // own grid, else cuBLAS. parts >> kWkShift: the terms kernel's warps along K (DecodeOptions::k_split;
  // 0: its estimate).
  enum Parts { kBoth = 3, kBaseAlone = 1, kTermsAlone = 2, kStreamBase = 4, kXqBefore = 8, kAfterNorm = 16 };
  constexpr int kBaseFirst = 256, kBlocksShift = 9, kBlocksMask = 511, kEngineBase = 1 << 20, kWkShift = 21;
  DeviceMem xq16(bcuda::quantized_x_bytes(kVariants, K));
  bcuda::quantize_x(X, kVariants, K, static_cast<uint8_t*>(xq16.ptr), nullptr, true);
  const auto route = [&](int s, std::span<const DeltaRef> d, bool add, cudaStream_t st, int parts) {
    const int rows = int(d.size());
    const bf16* xin = X;
    if (parts & kAfterNorm) {
      normed->norm(rows, st);
      xin = normed->x();
      if ((parts & kBoth) == 0) return;
    }
    auto* terms = static_cast<float*>(yd.ptr);
    const std::vector<DeltaRef> none(static_cast<size_t>(rows));
    const auto base = [&] {
      bcuda::DecodeOptions o{0, 0, kStream};
      const bool stream_base = (parts & kStreamBase) || ((parts & kEngineBase) && stream_runs);
      o.blocks = (parts >> kBlocksShift) & kBlocksMask;
      if ((parts & kBaseAlone) && stream_base)
        bcuda::fused_linear_decode(W(s), N, K, xin, rows, none, Y, st, o);
      else if (parts & kBaseAlone)
        prefill.run(bcuda::PrefillMethod::kBaseOnly, W(s), N, K, xin, rows, DeltaRef{}, Y);
    };
    beside.fork(st, terms, size_t(rows) * N);
    if (parts & kBaseFirst) base();
    if (parts & kTermsAlone)
      beside.add_terms(W(s), N, K, xin, rows, d, terms,
                       (parts & kXqBefore) ? static_cast<const uint8_t*>(xq16.ptr) : nullptr, parts >> kWkShift);
    if (!(parts & kBaseFirst)) base();
    beside.join(st);
    if (add) bcuda::add_to(Y, terms, size_t(rows) * N, st);
  };
  struct Graphs {
    std::map<std::tuple<const void*, const void*, size_t, bool, int, int>, cudaGraphExec_t> exec;
    ~Graphs() {
      for (auto& [k, e] : exec) cudaGraphExecDestroy(e);
    }
  } graphs;
  // A graph of what issue(capture) launches: run once uncaptured first (scratch at its size), then
  // captured and instantiated.
  const auto make_graph = [&](const std::function<void(cudaStream_t)>& issue) {
    BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
    issue(capture);
    BITDELTA_CUDA_CHECK(cudaStreamSynchronize(capture));
    cudaGraph_t g;
    cudaGraphExec_t e;
    BITDELTA_CUDA_CHECK(cudaStreamBeginCapture(capture, cudaStreamCaptureModeThreadLocal));
    issue(capture);
    BITDELTA_CUDA_CHECK(cudaStreamEndCapture(capture, &g));
    BITDELTA_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
    BITDELTA_CUDA_CHECK(cudaGraphDestroy(g));
    return e;
  };
  // deltas(s): the rows' variants in weight set s.
  const auto side_by_side = [&](int s, const std::function<std::vector<DeltaRef>(int)>& deltas, bool add,
                                int chain, int parts = kBoth) {
    const std::vector<DeltaRef> d = deltas(s);
    if (chain == 0) return route(s, d, add, nullptr, parts);
    cudaGraphExec_t& e = graphs.exec[{W(s), d[0].signs, d.size(), add, chain, parts}];
    if (!e) {
      BITDELTA_CUBLAS_CHECK(cublasSetStream(prefill.handle(), capture));
      e = make_graph([&](cudaStream_t st) {
        for (int i = 0; i < chain; ++i) route(s + i, deltas(s + i), add, st, parts);
      });
      BITDELTA_CUBLAS_CHECK(cublasSetStream(prefill.handle(), nullptr));
    }
    BITDELTA_CUDA_CHECK(cudaGraphLaunch(e, nullptr));
  };

  // (a) one row, one variant.
  if (!prefill_only && !many_only) {
    const double t_cublas = time_us([&](int s) { cublas_rows(1, s); }, reps);
    add({shape, "a: 1 row base", "cuBLAS GemmEx", t_cublas, double(wbytes), 0, ""});
    {  // The floor at this size: one launch that only reads W (and, with a delta, its signs).
      const ReadFloor f = read_floor_us([&](int s) { return std::vector<ReadRegion>{{W(s), wbytes}}; }, reps);
      add({shape, "a: floor", "one launch reading W", f.us, double(wbytes), t_cublas, "x cuBLAS"});
      std::printf("%-12s   (floor's form: %s)\n", shape.c_str(), f.form.c_str());
      const ReadFloor fd = read_floor_us(
          [&](int s) { return std::vector<ReadRegion>{{W(s), wbytes}, {delta(s, 0).signs, sbytes}}; }, reps);
      add({shape, "a: floor", "one launch reading W, signs", fd.us, double(wbytes + sbytes), t_cublas, "x cuBLAS"});
      const auto w_signs = [&](int s) {
        return std::vector<ReadRegion>{{W(s), wbytes}, {delta(s, 0).signs, sbytes}};
      };
      const double fc = read_floor_chain_us(w_signs, fd, 20);
      add({shape, "a: floor", "reading W, signs, chain of 20", fc, double(wbytes + sbytes), t_cublas, "x cuBLAS"});
      // The same chain with the reads after each launch's wait for the one before, or only a first
      // batch before it: the floors of a kernel that needs x from the launch before (every form
      // tried chained; read_floor.h).
      std::vector<std::pair<std::string, ReadFloor>> dependent;
      for (const auto& [wait, tag] : floor_waits) {
        const ReadFloor fw = read_floor_chain_best(w_signs, 20, wait);
        add({shape, "a: floor", std::string("reading W, signs, chain of 20, ") + tag, fw.us, double(wbytes + sbytes),
             t_cublas, "x cuBLAS"});
        std::printf("%-12s   (floor's form, %s: %s)\n", shape.c_str(), tag, fw.form.c_str());
        dependent.emplace_back(std::string("W, signs, chained, ") + tag, fw);
      }
      if (one_row_only) {  // how the floor depends on the bytes each multiprocessor keeps in flight
        dependent.insert(dependent.begin(), {{"W", f}, {"W, signs", fd}});
        for (const auto& [name, r] : dependent) {
          std::printf("%-12s   (floor %s, every form: KB in flight per SM -> us:", shape.c_str(), name.c_str());
          for (auto [kb, us] : r.forms) std::printf(" %g->%.2f", kb, us);
          std::printf(")\n");
        }
      }
    }
    const double bytes = double(wbytes + sbytes) + N * 4.0;
    // One row of variant 0 with these options: timed alone (time_row), or in chains of 20 calls back
    // to back, each free to start during the last (as a step's kernels are: chain_row).
    const auto row_call = [&](const bcuda::DecodeOptions& o) {
      return [&, o](int s) {
        const DeltaRef d = delta(s, 0);
        bcuda::fused_linear_decode(W(s), N, K, X, 1, {&d, 1}, Y, nullptr, o);
      };
    };
    const auto time_row = [&](const bcuda::DecodeOptions& o) { return time_us(row_call(o), reps); };
    const auto chain_row = [&](const bcuda::DecodeOptions& o) { return time_chain_us(row_call(o), 20); };
    // The engine's choice for one row: the register kernel on the balanced grid.
    add({shape, "a: 1 row 1 variant", "balanced grid (default)", time_row({0, 0, kBalanced}), bytes, t_cublas,
         "x cuBLAS"});
    for (int ks : {0, 2, 4, 8})
      add({shape, "a: 1 row 1 variant",
           "registers ks=" + std::to_string(ks ? ks : bcuda::decode_default_k_split(N, 1)) +
               (ks ? "" : " (its rule)"),
           time_row({ks, 0, kRegisters}), bytes, t_cublas, "x cuBLAS"});
    {  // The same, timed call by call alternating with cuBLAS (as case c is): the clocks' drift over the
       // run (cuBLAS's GEMV alone took 14.7–21.4 µs at 4096² in runs 113–129) falls on both alike.
      for (auto kernel : {kBalanced, kRegisters}) {
        const auto [tc, t] = time_pair_us(
            [&](int s) { cublas_rows(1, s); },
            [&](int s) {
              const DeltaRef d = delta(s, 0);
              bcuda::fused_linear_decode(W(s), N, K, X, 1, {&d, 1}, Y, nullptr, {0, 0, kernel});
            },
            reps);
        add({shape, "a: 1 row base", "cuBLAS, alternating", tc, double(wbytes), 0, ""});
        add({shape, "a: 1 row 1 variant", kernel == kBalanced ? "balanced, alternating" : "registers, alternating", t,
             bytes, tc, "x cuBLAS alt."});
      }
    }
    {  // x quantized before the call (as a kernel producing x can leave it; without, the balanced grid
       // quantizes x in each block): the linear alone, and the quantizing launch alone
      DeviceMem xq(bcuda::quantized_x_bytes(1, K));
      auto* q = static_cast<uint8_t*>(xq.ptr);
      bcuda::quantize_x(X, 1, K, q, nullptr);
      bcuda::DecodeOptions o{0, 0, kRegisters};
      o.xq = q;
      add({shape, "a: 1 row 1 variant", "registers, x quantized before", time_row(o), bytes, t_cublas, "x cuBLAS"});
      for (auto kernel : {kBalanced, kRegisters}) {
        const double tc = chain_row({0, 0, kernel});
        add({shape, "a: 1 row 1 variant", kernel == kBalanced ? "balanced, chain of 20" : "registers, chain of 20", tc,
             bytes, t_cublas, "x cuBLAS"});
      }
      {  // The chain's share of the quantizing launch (the register kernel with x quantized before),
         // and the balanced grid with no delta at all.
        const double tq20 = chain_row(o);
        add({shape, "a: 1 row 1 variant", "registers, chain of 20, x quantized before", tq20, bytes, t_cublas,
             "x cuBLAS"});
        const DeltaRef none{};
        const double tn20 = time_chain_us(
            [&](int s) { bcuda::fused_linear_decode(W(s), N, K, X, 1, {&none, 1}, Y, nullptr, {0, 0, kBalanced}); },
            20);
        add({shape, "a: 1 row base", "balanced, chain of 20, no delta", tn20, double(wbytes) + N * 4.0, t_cublas,
             "x cuBLAS"});
      }
      if (normed) {  // The step's form: each linear after the one-row norm that writes its x (NormedX), so
        // that what the linear issues before its wait overlaps a light launch rather than the blocks of
        // a linear before it (NOTES.md, part 50). Chains of 20 (norm, linear) pairs, less a chain of 20
        // norms alone: the linear's share.
        const double tnorm = time_chain_us([&](int) { normed->norm(1, nullptr); }, 20);
        add({shape, "a: norm", "add_rmsnorm alone (1 row), chain of 20", tnorm, K * 6.0, 0, ""});
        for (const bool with_delta : {true, false}) {
          const double tp = time_chain_us(
              [&](int s) {
                normed->norm(1, nullptr);
                const DeltaRef d = with_delta ? delta(s, 0) : DeltaRef{};
                bcuda::fused_linear_decode(W(s), N, K, normed->x(), 1, {&d, 1}, Y, nullptr, {0, 0, kBalanced});
              },
              20);
          if (with_delta)
            add({shape, "a: 1 row 1 variant", "balanced, after a norm, chain of 20 pairs less the norms", tp - tnorm,
                 bytes, t_cublas, "x cuBLAS"});
          else
            add({shape, "a: 1 row base", "balanced, after a norm, chain of 20 pairs less the norms, no delta",
                 tp - tnorm, double(wbytes) + N * 4.0, t_cublas, "x cuBLAS"});
        }
        // The same launches captured into a CUDA graph and replayed, as the engine's decode step is
        // (NOTES.md, part 51: neither the chains above nor the chained pairs find the stage of part 49
        // faster, the 7B step does). what: 1 the norm, 2 the linear, 4 with the delta.
        const auto graph_of_20 = [&](int s, int what) {
          cudaGraphExec_t& e = graphs.exec[{W(s), nullptr, 0, false, 20, 100 + what}];
          if (!e)
            e = make_graph([&](cudaStream_t st) {
              for (int i = 0; i < 20; ++i) {
                if (what & 1) normed->norm(1, st);
                if (what & 2) {
                  const DeltaRef d = (what & 4) ? delta(s + i, 0) : DeltaRef{};
                  bcuda::fused_linear_decode(W(s + i), N, K, normed->x(), 1, {&d, 1}, Y, st, {0, 0, kBalanced});
                }
              }
            });
          BITDELTA_CUDA_CHECK(cudaGraphLaunch(e, nullptr));
        };
        const auto graph_us = [&](int what) { return time_us([&](int s) { graph_of_20(s * 20, what); }, reps) / 20; };
        const double gnorm = graph_us(1);
        add({shape, "a: norm", "add_rmsnorm alone (1 row), graph of 20", gnorm, K * 6.0, 0, ""});
        add({shape, "a: 1 row 1 variant", "balanced, graph of 20", graph_us(2 | 4), bytes, t_cublas, "x cuBLAS"});
        add({shape, "a: 1 row 1 variant", "balanced, after a norm, graph of 20 pairs less the norms",
             graph_us(1 | 2 | 4) - gnorm, bytes, t_cublas, "x cuBLAS"});
        add({shape, "a: 1 row base", "balanced, after a norm, graph of 20 pairs less the norms, no delta",
             graph_us(1 | 2) - gnorm, double(wbytes) + N * 4.0, t_cublas, "x cuBLAS"});
      }
      const double tcb = time_chain_us([&](int s) { cublas_rows(1, s); }, 20);
      add({shape, "a: 1 row base", "cuBLAS, chain of 20 calls", tcb, double(wbytes), t_cublas, "x cuBLAS"});
      {  // The balanced grid with x quantized before (by the kernel producing x, in the engine's one-row
         // step), alone and in a chain of 20.
        bcuda::DecodeOptions ob{0, 0, kBalanced};
        ob.xq = q;
        add({shape, "a: 1 row 1 variant", "balanced, x quantized before", time_row(ob), bytes, t_cublas, "x cuBLAS"});
        add({shape, "a: 1 row 1 variant", "balanced, chain of 20, x quantized before", chain_row(ob), bytes,
             t_cublas, "x cuBLAS"});
      }
      const double tq = time_us([&](int) { bcuda::quantize_x(X, 1, K, q, nullptr); }, reps);
      add({shape, "a: quantize x", "quantize_x alone (1 row)", tq, K * 2.0 + double(bcuda::quantized_x_bytes(1, K)), 0, ""});
    }
    if (stream_runs) add({shape, "a: 1 row 1 variant", "stream", time_row({0, 0, kStream}), bytes, t_cublas, "x cuBLAS"});
    const DeltaRef none{};
    for (auto kernel : {kBalanced, kRegisters, kStream}) {
      if (kernel == kStream && !stream_runs) continue;
      const double t_base = time_us(
          [&](int s) { bcuda::fused_linear_decode(W(s), N, K, X, 1, {&none, 1}, Y, nullptr, {0, 0, kernel}); },
          reps);
      add({shape, "a: 1 row base",
           kernel == kStream      ? "stream kernel, no delta"
           : kernel == kBalanced ? "balanced grid, no delta"
                                 : "registers kernel, no delta",
           t_base, double(wbytes), t_cublas, "x cuBLAS"});
    }
  }
  if (one_row_only) return;
  if (trace_only == 2) {  // --route-trace: (b)'s route, its two branches on one timeline
#ifdef BITDELTA_STREAM_TRACE
    route_trace(shape, [&](int l, int parts) {
      side_by_side(l * 20, [&](int s) {
        std::vector<DeltaRef> d(kVariants);
        for (int v = 0; v < kVariants; ++v) d[size_t(v)] = delta(s, v);
        return d;
      }, false, 20, parts);
    }, {{kBoth | kStreamBase, "stream base | terms"},
        {kBoth | kStreamBase | kBaseFirst, "stream base first | terms"},
        {kBoth | kStreamBase | kXqBefore, "stream base | terms, xq before"},
        {kBoth | kStreamBase | 64 << kBlocksShift, "stream base 64 blocks | terms"},
        {kBoth | kStreamBase | kBaseFirst | 64 << kBlocksShift, "stream base 64 blocks first | terms"},
        {kBoth, "cuBLAS | terms"},
        {kBoth | kXqBefore, "cuBLAS | terms, xq before"},
        {kTermsAlone, "terms alone"},
        {kBaseAlone | kStreamBase, "stream base alone"}});
#else
    std::printf("%-12s route trace: build with -DBITDELTA_STREAM_TRACE=ON (CMake) for the timeline\n", shape.c_str());
#endif
    return;
  }
  if (trace_only) {  // --stream-trace: the streaming kernel's timeline at 16 rows (16 variants, none) and 32 rows
    // x quantized before (by an earlier launch: the kernel's own quantization off), for 16 and 32 rows.
    DeviceMem xq16(bcuda::quantized_x_bytes(kVariants, K)), xq32(bcuda::quantized_x_bytes(32, K));
    bcuda::quantize_x(X, kVariants, K, static_cast<uint8_t*>(xq16.ptr), nullptr);
    bcuda::quantize_x(X, 32, K, static_cast<uint8_t*>(xq32.ptr), nullptr);
    const auto b16 = [&](int s, bool with_deltas, bool before = false) {
      DeltaRef d[kVariants] = {};
      if (with_deltas)
        for (int v = 0; v < kVariants; ++v) d[v] = delta(s, v);
      bcuda::DecodeOptions o{0, 0, kStream};
      if (before) o.xq = static_cast<const uint8_t*>(xq16.ptr);
      bcuda::fused_linear_decode(W(s), N, K, X, kVariants, d, Y, nullptr, o);
    };
    const auto e32 = [&](int s, bool before = false) {
      DeltaRef d[32];
      for (int r = 0; r < 32; ++r) d[r] = delta(s, r * 14 / 32);
      bcuda::DecodeOptions o{0, 0, kStream};
      if (before) o.xq = static_cast<const uint8_t*>(xq32.ptr);
      bcuda::fused_linear_decode(W(s), N, K, X, 32, {d, 32}, Y, nullptr, o);
    };
    trace_stream(shape, "16 rows 16 variants", [&](int s) { b16(s, true); });
    trace_stream(shape, "16 rows base", [&](int s) { b16(s, false); });
    trace_stream(shape, "32 rows 14 variants", [&](int s) { e32(s); });
    trace_stream(shape, "16r16v x before", [&](int s) { b16(s, true, true); });
    trace_stream(shape, "32r14v x before", [&](int s) { e32(s, true); });
#ifdef BITDELTA_STREAM_TRACE
    // Knockouts (wrong results; fused_linear_stream.cuh): what each part of the work costs.
    const std::pair<int, const char*> knocks[] = {{bcuda::kKnockWrite, "no write"},
                                                  {bcuda::kKnockEpilogue, "no epilogue"},
                                                  {bcuda::kKnockDelta, "no delta mma"},
                                                  {bcuda::kKnockXCopies, "no x copies"},
                                                  {bcuda::kKnockXCopies | bcuda::kKnockDelta, "no x, no delta"}};
    for (const auto& [bits, name] : knocks) {
      bcuda::stream_knockout(bits);
      trace_stream(shape, std::string("16r16v ") + name, [&](int s) { b16(s, true); });
      trace_stream(shape, std::string("32r14v ") + name, [&](int s) { e32(s); });
    }
    bcuda::stream_knockout(0);
#endif
    trace_floor(shape, "floor: W + 16 signs", [&](int s) {
      std::vector<ReadRegion> r{{W(s), wbytes}};
      for (int v = 0; v < kVariants; ++v) r.push_back({delta(s, v).signs, sbytes});
      return r;
    });
    trace_floor(shape, "floor: W", [&](int s) { return std::vector<ReadRegion>{{W(s), wbytes}}; });
    return;
  }
  // (b) 16 rows from 16 distinct variants.
  if (!prefill_only) {
    const double bytes = double(wbytes) + kVariants * (double(sbytes) + N * 4.0);
    const double roof = bytes / copy_bw * 1e6;
    add({shape, "b: roofline", "bytes / copy bandwidth", roof, bytes, 0, ""});
    {  // The floor at this size: one launch that only reads W and the 16 variants' signs.
      const auto regions = [&](int s) {
        std::vector<ReadRegion> r{{W(s), wbytes}};
        for (int v = 0; v < kVariants; ++v) r.push_back({delta(s, v).signs, sbytes});
        return r;
      };
      const ReadFloor f = read_floor_us(regions, reps);
      add({shape, "b: floor", "one launch reading them", f.us, bytes, roof, "x roofline"});
      std::printf("%-12s   (floor's form: %s)\n", shape.c_str(), f.form.c_str());
      add({shape, "b: floor", "reading them, chain of 20", read_floor_chain_us(regions, f, 20), bytes, roof,
           "x roofline"});
      for (const auto& [wait, tag] : floor_waits) {  // as (a)'s: a kernel that needs x from the launch before
        const ReadFloor fw = read_floor_chain_best(regions, 20, wait);
        add({shape, "b: floor", std::string("reading them, chain of 20, ") + tag, fw.us, bytes, roof, "x roofline"});
        std::printf("%-12s   (floor's form, %s: %s)\n", shape.c_str(), tag, fw.form.c_str());
      }
    }
    const double t_cublas = time_us([&](int s) { cublas_rows(16, s); }, reps);
    add({shape, "b: 16 rows base", "cuBLAS GemmEx", t_cublas, double(wbytes), 0, ""});
    // The stream kernel also with a ring of one stage (how much the ring's depth matters).
    struct Form {
      bcuda::DecodeKernel kernel;
      int stages;
    };
    const Form forms[] = {{kRegisters, 0}, {kStream, 0}, {kStream, 1}};
    const auto form_name = [](const Form& f) {
      return f.kernel == kRegisters ? std::string("registers")
             : f.stages             ? "stream stages=" + std::to_string(f.stages)
                                    : std::string("stream");
    };
    if (stream_runs) {  // the base alone at 16 rows: W and x through the ring, no delta
      const double t = time_us(
          [&](int s) {
            DeltaRef d[kVariants] = {};
            bcuda::fused_linear_decode(W(s), N, K, X, kVariants, d, Y, nullptr, {0, 0, kStream});
          },
          reps);
      add({shape, "b: 16 rows base", "stream kernel, no delta", t, double(wbytes), t_cublas, "x cuBLAS 16 rows"});
    }
    for (const Form& f : forms) {
      const auto [kernel, stages] = f;
      if (kernel == kStream && !stream_runs) continue;
      const double t = time_us(
          [&](int s) {
            DeltaRef d[kVariants];
            for (int v = 0; v < kVariants; ++v) d[v] = delta(s, v);
            bcuda::fused_linear_decode(W(s), N, K, X, kVariants, d, Y, nullptr, {0, 0, kernel, stages});
          },
          reps);
      add({shape, "b: 16 rows 16 variants", form_name(f), t, bytes, roof, "x roofline"});
    }
    {  // cuBLAS on the base + the delta terms alone (the engine's path for 3 or more gathered rows where
       // the streaming kernel does not run, kDeltaTermsRows), at 16 rows: against the register kernel above
      const double t = time_us(
          [&](int s) {
            DeltaRef d[kVariants];
            for (int v = 0; v < kVariants; ++v) d[v] = delta(s, v);
            cublas_rows(kVariants, s);
            bcuda::DecodeOptions o;
            o.delta_only = true;
            bcuda::fused_linear_decode(W(s), N, K, X, kVariants, d, Y, nullptr, o);
          },
          reps);
      add({shape, "b: 16 rows 16 variants", "cuBLAS + delta-only", t, bytes, roof, "x roofline"});
      const auto deltas = [&](int s) {
        std::vector<DeltaRef> d(kVariants);
        for (int v = 0; v < kVariants; ++v) d[size_t(v)] = delta(s, v);
        return d;
      };
      for (const auto& [with_add, chain] : {std::pair{false, 1}, {true, 1}, {false, 20}, {true, 20}, {true, 0}}) {
        const double ts = time_us([&](int s) { side_by_side(s * std::max(chain, 1), deltas, with_add, chain); }, reps) /
                          std::max(chain, 1);
        add({shape, "b: 16 rows 16 variants",
             std::string(with_add ? "cuBLAS | terms, + add_to" : "cuBLAS | terms, folded") +
                 (chain == 0 ? ", calls" : chain == 1 ? ", graph" : ", graph of 20"),
             ts, bytes, roof, "x roofline"});
      }
      // Each branch of the route alone in a graph of 20 (its base as cuBLAS and as the streaming kernel;
      // both together are the rows below).
      for (int parts : {int(kBaseAlone), int(kTermsAlone), kBaseAlone | kStreamBase}) {
        if ((parts & kStreamBase) && !stream_runs) continue;
        const double ts = time_us([&](int s) { side_by_side(s * 20, deltas, false, 20, parts); }, reps) / 20;
        const char* name = parts == kBaseAlone    ? "route's cuBLAS alone, graph of 20"
                           : parts == kTermsAlone ? "route's terms alone, graph of 20"
                                                  : "stream kernel base alone, graph of 20";
        add({shape, "b: 16 rows 16 variants", name, ts, parts == kTermsAlone ? bytes - double(wbytes) : double(wbytes),
             roof, "x roofline"});
      }
      // The engine's route (kEngineBase) alternated twice with: the same with the terms on 4 or 8
      // warps along K (the estimate's choice for 16 single-row slots is 2 at K = 4096 where their
      // blocks fill two waves at 4, and 4 at K = 8192 where 4 and 8 tie: session 56, runs 384-385);
      // cuBLAS as its base (the engine's until session 56); the streaming base on 64 blocks (on its own
      // grid it is the engine's route where it runs); and x quantized before with cuBLAS or the streaming base as the base (at 4096² these
      // met (b), 1.24× in run 352, but in the 7B mixed steps the norms and SwiGLU writing x quantized
      // made the step slower, 8.78 → 9.40 ms at batch 16: dropped). Session 55's other forms (the base
      // issued first, on 32 blocks; runs 376 and 378) are slower at 4096² and 11008x4096: left out.
      constexpr int kSB = kBoth | kStreamBase;
      for (int round = 0; round < 2; ++round)
        for (int parts : {kBoth | kEngineBase, kBoth | kEngineBase | 4 << kWkShift,
                          kBoth | kEngineBase | 8 << kWkShift, int(kBoth), kSB | 64 << kBlocksShift,
                          kBoth | kXqBefore, kSB | kXqBefore}) {
          if ((parts & kStreamBase) && !stream_runs) continue;
          const double ts = time_us([&](int s) { side_by_side(s * 20, deltas, false, 20, parts); }, reps) / 20;
          const int blocks = (parts >> kBlocksShift) & kBlocksMask, wk = parts >> kWkShift;
          std::string name = parts == (kBoth | kEngineBase) ? "route, folded, graph of 20"
                             : (parts & kEngineBase)
                                 ? "route, terms on " + std::to_string(wk) + " warps along K, graph of 20"
                             : parts == kBoth               ? "cuBLAS | terms, folded, graph of 20, alternated"
                             : (parts & kStreamBase) == 0   ? "route, folded, graph of 20, x quantized before"
                             : (parts & kXqBefore) ? "route, folded, graph of 20, x quantized before, stream base"
                                                   : "stream base";
          if ((parts & kStreamBase) && !(parts & kXqBefore)) {
            if (blocks) name += " on " + std::to_string(blocks) + " blocks";
            name += " | terms, graph of 20";
          }
          add({shape, "b: 16 rows 16 variants", name, ts, bytes, roof, "x roofline"});
        }
      {
        const double ts =
            time_us([&](int s) { side_by_side(s * 20, deltas, false, 20, kTermsAlone | kXqBefore); }, reps) / 20;
        add({shape, "b: 16 rows 16 variants", "route's terms alone, x quantized before, graph of 20", ts,
             bytes - double(wbytes), roof, "x roofline"});
      }
      if (normed) {  // The step's form: each route after the norm that writes its 16 rows of x, graphs of
                     // 20 (norm, route) pairs less graphs of 20 norms alone.
        const double tn = time_us([&](int s) { side_by_side(s * 20, deltas, false, 20, kAfterNorm); }, reps) / 20;
        const int route_after_norm = kBoth | kAfterNorm | kEngineBase;
        const double tp = time_us([&](int s) { side_by_side(s * 20, deltas, false, 20, route_after_norm); }, reps) / 20;
        add({shape, "b: norm", "add_rmsnorm alone (16 rows), graph of 20", tn, kVariants * K * 6.0, 0, ""});
        add({shape, "b: 16 rows 16 variants", "route, after a norm, graph of 20 pairs less the norms", tp - tn, bytes,
             roof, "x roofline"});
      }
    }
    if (stream_runs) {  // x quantized before the call: the linear alone, and the quantizing launch alone
      DeviceMem xq(bcuda::quantized_x_bytes(kVariants, K));
      auto* q = static_cast<uint8_t*>(xq.ptr);
      bcuda::quantize_x(X, kVariants, K, q, nullptr);
      bcuda::DecodeOptions o{0, 0, kStream};
      o.xq = q;
      const double t = time_us(
          [&](int s) {
            DeltaRef d[kVariants];
            for (int v = 0; v < kVariants; ++v) d[v] = delta(s, v);
            bcuda::fused_linear_decode(W(s), N, K, X, kVariants, d, Y, nullptr, o);
          },
          reps);
      add({shape, "b: 16 rows 16 variants", "stream, x quantized before", t, bytes, roof, "x roofline"});
      const double tc = time_chain_us(
          [&](int s) {
            DeltaRef d[kVariants];
            for (int v = 0; v < kVariants; ++v) d[v] = delta(s, v);
            bcuda::fused_linear_decode(W(s), N, K, X, kVariants, d, Y, nullptr, {0, 0, kStream});
          },
          20);
      add({shape, "b: 16 rows 16 variants", "stream, chain of 20 calls", tc, bytes, roof, "x roofline"});
      const double tq = time_us([&](int) { bcuda::quantize_x(X, kVariants, K, q, nullptr); }, reps);
      add({shape, "b: quantize x", "quantize_x alone (16 rows)", tq,
           kVariants * K * 2.0 + double(bcuda::quantized_x_bytes(kVariants, K)), 0, ""});
    }
    // The same 16 rows of one variant (a decode batch of one fine-tune), and of 8 variants with 2
    // adjacent rows each; slots chosen by the kernel, one per row, and one per variant and 4 rows.
    for (int nv : {1, 8}) {
      const double bytes1 = double(wbytes) + nv * (double(sbytes) + N * 4.0);
      for (const Form& f : forms) {
        const auto [kernel, stages] = f;
        if (kernel == kStream && !stream_runs) continue;
        const double t = time_us(
            [&](int s) {
              DeltaRef d[kVariants];
              for (int v = 0; v < kVariants; ++v) d[v] = delta(s, v * nv / kVariants);
              bcuda::fused_linear_decode(W(s), N, K, X, kVariants, d, Y, nullptr, {0, 0, kernel, stages});
            },
            reps);
        add({shape, nv == 1 ? "b: 16 rows 1 variant" : "b: 16 rows 8 variants x 2", form_name(f), t,
             bytes1, t_cublas, "x cuBLAS 16 rows"});
      }
    }
    // Few rows, each its own variant (a decode batch of several fine-tunes): both kernels against
    // the byte roofline (base + each variant's bits).
    for (int nr : {2, 4, 8}) {
      const double bytes_r = double(wbytes) + nr * (double(sbytes) + N * 4.0);
      for (auto kernel : {kRegisters, kStream}) {
        if (kernel == kStream && !stream_runs) continue;
        const double t = time_us(
            [&](int s) {
              DeltaRef d[kVariants];
              for (int v = 0; v < nr; ++v) d[v] = delta(s, v);
              bcuda::fused_linear_decode(W(s), N, K, X, nr, {d, size_t(nr)}, Y, nullptr, {0, 0, kernel});
            },
            reps);
        add({shape, "d: " + std::to_string(nr) + " rows " + std::to_string(nr) + " variants",
             kernel == kStream ? "stream" : "registers", t, bytes_r, bytes_r / copy_bw * 1e6, "x roofline"});
      }
    }
    // 32 rows of 14 variants (a decode batch of 32 with the 7B benchmark's 14 fine-tunes mixed, rows
    // of a variant adjacent): the register kernel takes them in two launches of 16 rows (two reads of
    // W), the streaming kernel in one.
    {
      const int nv = 14;
      const double bytes_e = double(wbytes) + nv * (double(sbytes) + N * 4.0);
      for (auto kernel : {kRegisters, kStream}) {
        if (kernel == kStream && !stream_runs) continue;
        const double t = time_us(
            [&](int s) {
              DeltaRef d[32];
              for (int r = 0; r < 32; ++r) d[r] = delta(s, r * nv / 32);
              bcuda::fused_linear_decode(W(s), N, K, X, 32, {d, 32}, Y, nullptr,
                                         {0, 0, kernel});
            },
            reps);
        add({shape, "e: 32 rows 14 variants", kernel == kStream ? "stream (one launch)" : "registers (2 x 16)", t,
             bytes_e, bytes_e / copy_bw * 1e6, "x roofline"});
        if (kernel == kStream) {
          const double tc = time_chain_us(
              [&](int s) {
                DeltaRef d[32];
                for (int r = 0; r < 32; ++r) d[r] = delta(s, r * nv / 32);
                bcuda::fused_linear_decode(W(s), N, K, X, 32, {d, 32}, Y, nullptr, {0, 0, kernel});
              },
              20);
          add({shape, "e: 32 rows 14 variants", "stream, chain of 20 calls", tc, bytes_e, bytes_e / copy_bw * 1e6,
               "x roofline"});
        }
      }
      // Where the streaming kernel does not run, the engine takes these rows as cuBLAS on the base
      // (W read once) + the delta terms alone (DecodeOptions::delta_only, x quantized in a launch
      // before): that path, and the delta terms alone against the bytes of the 14 variants' signs.
      const auto delta_terms = [&](int s) {
        DeltaRef d[32];
        for (int r = 0; r < 32; ++r) d[r] = delta(s, r * nv / 32);
        bcuda::DecodeOptions o;
        o.delta_only = true;
        bcuda::fused_linear_decode(W(s), N, K, X, 32, {d, 32}, Y, nullptr, o);
      };
      const double tdo = time_us(
          [&](int s) {
            cublas_rows(32, s);
            delta_terms(s);
          },
          reps);
      add({shape, "e: 32 rows 14 variants", "cuBLAS + delta-only", tdo, bytes_e, bytes_e / copy_bw * 1e6,
           "x roofline"});
      const auto deltas_e = [&](int s) {
        std::vector<DeltaRef> d(32);
        for (int r = 0; r < 32; ++r) d[size_t(r)] = delta(s, r * nv / 32);
        return d;
      };
      for (const bool with_add : {true, false}) {
        const double t = time_us([&](int s) { side_by_side(s * 20, deltas_e, with_add, 20); }, reps) / 20;
        add({shape, "e: 32 rows 14 variants",
             with_add ? "cuBLAS | terms, + add_to, graph of 20" : "cuBLAS | terms, folded, graph of 20", t, bytes_e,
             bytes_e / copy_bw * 1e6, "x roofline"});
      }
      const double bytes_d = nv * (double(sbytes) + N * 4.0);
      const double td = time_us(delta_terms, reps);
      add({shape, "e: 32 rows 14 variants", "delta-only alone", td, bytes_d, bytes_d / copy_bw * 1e6, "x roofline"});
      // The same 32 rows from fewer variants, more rows each (a half of a 64-row step of 14 variants
      // has about 7, 4-5 rows each): the delta terms alone.
      for (const int nf : {7, 4}) {
        const double t_few = time_us(
            [&](int s) {
              DeltaRef d[32];
              for (int r = 0; r < 32; ++r) d[r] = delta(s, r * nf / 32);
              bcuda::DecodeOptions o;
              o.delta_only = true;
              bcuda::fused_linear_decode(W(s), N, K, X, 32, {d, 32}, Y, nullptr, o);
            },
            reps);
        const double bytes_f = nf * (double(sbytes) + N * 4.0);
        add({shape, "e: 32 rows " + std::to_string(nf) + " variants", "delta-only alone", t_few, bytes_f,
             bytes_f / copy_bw * 1e6, "x roofline"});
      }
    }
    if (profile_only || many_only) return;
  }
  // (c) 512 rows (or prefill_rows), one variant.
  using M = bcuda::PrefillMethod;
  using FC = bcuda::PrefillLinear::FusedConfig;
  using FS = bcuda::FusedSplit;
  const int preps = profile_only ? 2 : wbytes > (200u << 20) ? 20 : 50;
  const double w_s_bytes = double(wbytes + sbytes);  // W and one variant's signs
  if (!few_rows_only) {
    // x copied into place before a call (untimed), so that the call finds it as a model's prompt
    // does, just written by the kernel before, rather than as the call before left it (read, clean
    // in L2): with fresh_x for every call of (c), else for the engine's choice and cuBLAS once more
    // at the end.
    const size_t x_bytes = size_t(kPrefillRows) * K * 2;
    DeviceMem x_src(x_bytes);
    BITDELTA_CUDA_CHECK(cudaMemcpy(x_src.ptr, x.ptr, x_bytes, cudaMemcpyDeviceToDevice));
    const std::function<void(int)> put_x = [&](int) {
      BITDELTA_CUDA_CHECK(cudaMemcpyAsync(x.ptr, x_src.ptr, x_bytes, cudaMemcpyDeviceToDevice));
    };
    const std::function<void(int)> before = fresh_x ? put_x : std::function<void(int)>{};
    if (fresh_x) std::printf("%-12s (c) with x copied into place before each call (untimed)\n", shape.c_str());
    const double t_cublas = time_us([&](int s) { cublas_rows(kPrefillRows, s); }, preps, 3, before);
    const double flops = 2.0 * kPrefillRows * N * K;
    add({shape, c_rows + " base",
         "cuBLAS GemmEx " + std::to_string(int(flops / t_cublas / 1e6)) + " TF/s", t_cublas,
         double(wbytes), 0, ""});
    struct Config {
      M method;
      const char* name;
      int chunk, expand_blocks;
      FC fused;
    };
    const Config configs[] = {{M::kTwoGemms, "two GEMMs", 8192, 0, {}},
                              {M::kMaterialize, "materialize", 4096, 0, {}},
                              {M::kMaterialize, "materialize", 8192, 0, {}},
                              {M::kPipelined, "pipelined", 2048, 0, {}},
                              {M::kPipelined, "pipelined", 4096, 0, {}},
                              {M::kFused, "fused GEMM 128x128 tile/block", 0, 0, {128, 128, FS::kTilePerBlock}},
                              {M::kFused, "fused GEMM 64x256 tile/block", 0, 0, {64, 256, FS::kTilePerBlock}},
                              {M::kFused, "fused GEMM 128x256 tile/block", 0, 0, {128, 256, FS::kTilePerBlock}},
                              {M::kFused, "fused GEMM 128x176 tile/block", 0, 0, {128, 176, FS::kTilePerBlock}},
                              {M::kFused, "fused GEMM 128x176 persistent", 0, 0, {128, 176, FS::kPersistent}},
                              {M::kFused, "fused GEMM 128x256 persistent", 0, 0, {128, 256, FS::kPersistent}},
                              {M::kFused, "fused GEMM 64x256 persistent", 0, 0, {64, 256, FS::kPersistent}},
                              {M::kFused, "fused GEMM 128x128 stream-K", 0, 0, {128, 128, FS::kStreamK}},
                              {M::kFused, "fused GEMM 128x256 stream-K", 0, 0, {128, 256, FS::kStreamK}},
                              {M::kFused, "fused GEMM 64x256 stream-K", 0, 0, {64, 256, FS::kStreamK}},
                              {M::kFused, "fused GEMM, the engine's choice", 0, 0, {}},
                              // The portable fused GEMM (mma.sync, W_eff formed in registers): what
                              // kFused runs where the sm_90a kernel does not. K split as it chooses, or not.
                              {M::kFusedMma, "portable fused GEMM 128 rows, 3 stages", 0, 0, {0, 0, FS::kStreamK, 128, 3}},
                              {M::kFusedMma, "portable fused GEMM 128 rows, 4 stages", 0, 0, {0, 0, FS::kStreamK, 128, 4}},
                              {M::kFusedMma, "portable fused GEMM 64 rows, 3 stages", 0, 0, {0, 0, FS::kStreamK, 64, 3}},
                              {M::kFusedMma, "portable fused GEMM 64 rows, 4 stages", 0, 0, {0, 0, FS::kStreamK, 64, 4}},
                              {M::kFusedMma, "portable fused GEMM 128 rows, 3 stages, K not split", 0, 0,
                               {0, 0, FS::kStreamK, 128, 3, 1}}};
    for (const Config& c : configs) {
      if (c.chunk > N && c.chunk != 8192) continue;
      if (profile_only && c.method != M::kFused) continue;
      // Where the sm_90a kernel does not run, kFused is the portable one: timed once, below.
      if (c.method == M::kFused && !prefill.fused_available()) continue;
      // Each form alternates with cuBLAS call by call, and its ratio is to that cuBLAS time.
      prefill.set_fused_config(c.fused);
      const auto cublas = [&](int s) { cublas_rows(kPrefillRows, s); };
      const auto [tc, t] = time_pair_us(
          cublas,
          [&](int s) { prefill.run(c.method, W(s), N, K, X, kPrefillRows, delta(s, 0), Y, c.chunk, c.expand_blocks); },
          preps, 3, before);
      if (c.method == M::kFused || c.method == M::kFusedMma) {  // the same kernel on W alone: the cost of the ±α expansion
        const auto [tcb, tb] = time_pair_us(
            cublas, [&](int s) { prefill.run(c.method, W(s), N, K, X, kPrefillRows, DeltaRef{}, Y); }, preps, 3,
            before);
        add({shape, c_rows + " base", std::string(c.name) + ", no delta", tb, double(wbytes), tcb, "x cuBLAS"});
      }
      add({shape, c_rows + " 1 variant",
           std::string(c.name) + (c.chunk ? " chunk " + std::to_string(std::min(c.chunk, N)) : std::string()),
           t, w_s_bytes, tc, "x cuBLAS"});
    }
    prefill.set_fused_config({});
    if (!fresh_x && !profile_only && prefill.fused_available()) {
      const auto [tc, t] = time_pair_us(
          [&](int s) { cublas_rows(kPrefillRows, s); },
          [&](int s) { prefill.run(M::kFused, W(s), N, K, X, kPrefillRows, delta(s, 0), Y); }, preps, 3, put_x);
      add({shape, c_rows + " base", "cuBLAS GemmEx, x just written", tc, double(wbytes), 0, ""});
      add({shape, c_rows + " 1 variant", "fused GEMM, the engine's choice, x just written", t, w_s_bytes, tc,
           "x cuBLAS"});
    }
    // cuBLAS alone again, after all the forms: how far the clocks moved since the first row.
    const double t_cublas_after = time_us([&](int s) { cublas_rows(kPrefillRows, s); }, preps, 3, before);
    add({shape, c_rows + " base",
         "cuBLAS GemmEx again, after the forms " + std::to_string(int(flops / t_cublas_after / 1e6)) + " TF/s",
         t_cublas_after, double(wbytes), 0, ""});
  }
  // Few rows of one variant (a decode batch of one fine-tune): 32-row fused decode launches (each
  // reading W) against the fused GEMM (one read of W), next to cuBLAS on the base.
  {
    if (!profile_only && !c_only)
      for (int rows : {2, 4, 8, 12, 16, 17, 24, 32, 48}) {
        const std::string cs = "c': " + std::to_string(rows) + " rows 1 variant";
        const double tb = time_us([&](int s) { cublas_rows(rows, s); }, preps);
        add({shape, cs, "cuBLAS base-only", tb, double(wbytes), 0, ""});
        if (rows <= 32) {  // the base alone through the decode kernel: where cuBLAS takes over
          const double tn = time_us(
              [&](int s) {
                DeltaRef none[32];
                bcuda::fused_linear_decode(W(s), N, K, X, rows, {none, size_t(rows)}, Y, nullptr);
              },
              preps);
          add({shape, cs.substr(0, cs.size() - 9) + "base", "fused decode, no delta", tn, double(wbytes), tb, "x cuBLAS"});
        }
        const double td = time_us(
            [&](int s) {
              DeltaRef d[32];
              for (int v = 0; v < 32; ++v) d[v] = delta(s, 0);
              for (int r0 = 0; r0 < rows; r0 += 32)
                bcuda::fused_linear_decode(W(s), N, K, X + size_t(r0) * K, std::min(32, rows - r0),
                                           {d, size_t(std::min(32, rows - r0))}, Y + size_t(r0) * N, nullptr);
            },
            preps);
        add({shape, cs, "fused decode, 32-row calls", td, w_s_bytes, tb, "x cuBLAS"});
        if (rows <= 32) {
          if (stream_runs) {  // the streaming kernel with W_eff formed in its stages (one launch)
            const double tw = time_us(
                [&](int s) {
                  DeltaRef d[32];
                  for (int v = 0; v < rows; ++v) d[v] = delta(s, 0);
                  bcuda::DecodeOptions o{0, 0, kStream};
                  o.form_weights = true;
                  bcuda::fused_linear_decode(W(s), N, K, X, rows, {d, size_t(rows)}, Y, nullptr, o);
                },
                preps);
            add({shape, cs, "stream, W_eff formed", tw, w_s_bytes, tb, "x cuBLAS"});
          }
          // Where the streaming kernel does not run (other GPUs; here with kRegisters): the register
          // kernel's W_eff form, against what the engine took before it: 16-row register-kernel
          // launches (each reading W), and past 16 rows cuBLAS on the base + the delta-only launches.
          // Its warps per tile along K (k_split): the engine's choice, and 8, 4 and 2.
          for (int ks : {0, 8, 4, 2}) {
            const double tk = time_us(
                [&](int s) {
                  DeltaRef d[32];
                  for (int v = 0; v < rows; ++v) d[v] = delta(s, 0);
                  bcuda::DecodeOptions o{ks, 0, kRegisters};
                  o.form_weights = true;
                  bcuda::fused_linear_decode(W(s), N, K, X, rows, {d, size_t(rows)}, Y, nullptr, o);
                },
                preps);
            add({shape, cs, "registers, W_eff formed" + (ks ? ", ks=" + std::to_string(ks) : std::string()), tk,
                 w_s_bytes, tb, "x cuBLAS"});
          }
          const double tg = time_us(
              [&](int s) {
                DeltaRef d[32];
                for (int v = 0; v < rows; ++v) d[v] = delta(s, 0);
                bcuda::fused_linear_decode(W(s), N, K, X, rows, {d, size_t(rows)}, Y, nullptr, {0, 0, kRegisters});
              },
              preps);
          add({shape, cs, "registers, 16-row calls", tg, w_s_bytes, tb, "x cuBLAS"});
          if (rows > 16) {
            const double tdo = time_us(
                [&](int s) {
                  DeltaRef d[32];
                  for (int v = 0; v < rows; ++v) d[v] = delta(s, 0);
                  cublas_rows(rows, s);
                  bcuda::DecodeOptions o;
                  o.delta_only = true;
                  bcuda::fused_linear_decode(W(s), N, K, X, rows, {d, size_t(rows)}, Y, nullptr, o);
                },
                preps);
            add({shape, cs, "cuBLAS base + delta-only launches", tdo, w_s_bytes, tb, "x cuBLAS"});
          }
        }
        {
          const double tm = time_us(
              [&](int s) { prefill.run(M::kMaterialize, W(s), N, K, X, rows, delta(s, 0), Y); }, preps);
          add({shape, cs, "materialize + cuBLAS", tm, w_s_bytes, tb, "x cuBLAS"});
        }
        struct Form {
          const char* name;
          M method;
          FC config;
        };
        const Form forms[] = {{"fused GEMM", M::kFused, {}},
                              {"fused GEMM tile/block", M::kFused, {64, 64, FS::kTilePerBlock}},
                              {"fused GEMM stream-K", M::kFused, {64, 64, FS::kStreamK}},
                              {"portable fused GEMM", M::kFusedMma, {}},
                              {"portable fused GEMM, K not split", M::kFusedMma, {0, 0, FS::kStreamK, 0, 0, 1}}};
        for (const auto& [name, method, config] : forms) {
          if (method == M::kFused && !prefill.fused_available()) continue;  // the portable one, timed below
          prefill.set_fused_config(config);
          const double tf = time_us(
              [&](int s) { prefill.run(method, W(s), N, K, X, rows, delta(s, 0), Y); }, preps);
          add({shape, cs, name, tf, w_s_bytes, tb, "x cuBLAS"});
        }
        prefill.set_fused_config({});
      }
  }
  BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
}

// The portable fused GEMM (mma.sync, fused_gemm_mma.cuh) over its configurations at few rows of one
// variant: tiles of 64 or 128 rows of x, 3 or 4 stages, K split 1 to 8 ways, with the delta; beside
// cuBLAS on the base, materialize + cuBLAS, and the configuration mma_gemm_choose picks. The data for
// that choice.
void bench_portable_sweep(const RandomFill& rnd, bcuda::PrefillLinear& prefill, int N, int K,
                          const std::vector<int>& row_counts) {
  using M = bcuda::PrefillMethod;
  using FS = bcuda::FusedSplit;
  const size_t wbytes = size_t(N) * K * 2, sbytes = bcuda::packed_signs_bytes(N, K);
  const WeightSets sets(rnd, N, K, 1);
  const int max_rows = *std::max_element(row_counts.begin(), row_counts.end());
  DeviceMem x(size_t(max_rows) * K * 2), y(size_t(max_rows) * N * 4);
  rnd.fill(x.ptr, size_t(max_rows) * K * 2, true);
  auto W = [&](int s) { return sets.W(s); };
  auto delta = [&](int s) { return sets.delta(s, 0); };
  const auto* X = static_cast<const bf16*>(x.ptr);
  float* Y = static_cast<float*>(y.ptr);
  const std::string shape = std::to_string(N) + "x" + std::to_string(K);
  const int reps = wbytes > (200u << 20) ? 20 : 50;
  const double bytes = double(wbytes + sbytes);
  for (int rows : row_counts) {
    const std::string cs = "s: " + std::to_string(rows) + " rows 1 variant";
    const double tb = time_us([&](int s) { cublas_base(prefill, W(s), N, K, X, rows, Y); }, reps);
    add({shape, cs, "cuBLAS base-only", tb, double(wbytes), 0, ""});
    const double tm = time_us([&](int s) { prefill.run(M::kMaterialize, W(s), N, K, X, rows, delta(s), Y); }, reps);
    add({shape, cs, "materialize + cuBLAS", tm, bytes, tb, "x cuBLAS"});
    prefill.set_fused_config({});
    const double tc = time_us([&](int s) { prefill.run(M::kFusedMma, W(s), N, K, X, rows, delta(s), Y); }, reps);
    add({shape, cs, "portable, its choice", tc, bytes, tb, "x cuBLAS"});
    for (int bn : {64, 128})
      for (int stages : {3, 4})
        for (int split : {1, 2, 3, 4, 6, 8}) {
          if (split > K / 64) continue;
          prefill.set_fused_config({0, 0, FS::kStreamK, bn, stages, split});
          const double t = time_us([&](int s) { prefill.run(M::kFusedMma, W(s), N, K, X, rows, delta(s), Y); }, reps);
          add({shape, cs,
               "portable " + std::to_string(bn) + "/" + std::to_string(stages) + " split " + std::to_string(split), t,
               bytes, tb, "x cuBLAS"});
        }
    prefill.set_fused_config({});
  }
  BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
}

// The TMA ring of the streaming kernel with nothing consuming it (tile_read.h), in several stage
// geometries, against the floor of a plain read of the same bytes: W alone, and W with 16 variants'
// signs (case b).
void bench_tile_read(const RandomFill& rnd, int N, int K) {
  using bitdelta::bench::TileReadConfig;
  using bitdelta::bench::TileReadSet;
  const size_t wbytes = size_t(N) * K * 2, sbytes = bcuda::packed_signs_bytes(N, K);
  const int kVariants = 16, nsets = int(std::max<size_t>(2, (240u << 20) / (wbytes + kVariants * sbytes) + 1));
  std::vector<std::unique_ptr<DeviceMem>> mem;
  std::vector<TileReadSet> sets;
  for (int s = 0; s < nsets; ++s) {
    mem.push_back(std::make_unique<DeviceMem>(wbytes));
    rnd.fill(mem.back()->ptr, wbytes, true);
    TileReadSet set{mem.back()->ptr, {}};
    for (int v = 0; v < kVariants; ++v) {
      mem.push_back(std::make_unique<DeviceMem>(sbytes));
      rnd.fill(mem.back()->ptr, sbytes, false);
      set.signs.push_back(mem.back()->ptr);
    }
    sets.push_back(set);
  }
  const std::string shape = std::to_string(N) + "x" + std::to_string(K);
  const int reps = wbytes > (200u << 20) ? 30 : 60;
  const ReadFloor fw = read_floor_us([&](int s) { return std::vector<ReadRegion>{{sets[s % nsets].w, wbytes}}; }, reps);
  const ReadFloor fb = read_floor_us(
      [&](int s) {
        std::vector<ReadRegion> r{{sets[s % nsets].w, wbytes}};
        for (int v = 0; v < kVariants; ++v) r.push_back({sets[s % nsets].signs[size_t(v)], sbytes});
        return r;
      },
      reps);
  add({shape, "t: floor", "W", fw.us, double(wbytes), 0, ""});
  add({shape, "t: floor", "W + 16 signs", fb.us, double(wbytes + kVariants * sbytes), 0, ""});
  // {rows, cols, stages, blocks per SM, variants, side bytes, rotate}
  // The streaming kernel's other bytes per stage at 16 rows: x (16 × 256 bf16) and its bit-planes
  // (quantized_x_block(16) = 256 + 16 · 512, delta_b1.cuh).
  const int x16 = 16 * 256 * 2 + 256 + 16 * 512;
  const std::vector<TileReadConfig> configs = {
      {64, 256, 2}, {64, 256, 3}, {64, 256, 4}, {64, 256, 5}, {64, 256, 6}, {64, 256, 5, 1, 0, 8192},
      {64, 256, 5, 1, 0, 0, true}, {64, 256, 3, 2}, {32, 256, 6}, {32, 256, 8}, {32, 256, 6, 2},
      {32, 512, 4}, {32, 512, 6}, {16, 1024, 4}, {16, 1024, 6}, {16, 512, 8}, {128, 256, 3}, {64, 512, 3},
      {64, 256, 2, 1, 16, x16}, {64, 256, 2, 1, 16}, {64, 256, 3, 1, 16}, {64, 256, 3, 1, 16, 0, true},
      {32, 256, 4, 1, 16}, {32, 256, 6, 1, 16}, {32, 256, 4, 1, 16, x16}, {32, 256, 3, 2, 16},
      {32, 512, 3, 1, 16}, {16, 256, 8, 1, 16}, {16, 512, 6, 1, 16}};
  for (const TileReadConfig& c : configs) {
    if (K % c.cols) continue;
    const double bytes = double(wbytes) + (c.variants ? double(c.variants) * sbytes : 0.0);
    try {
      const double t = bitdelta::bench::tile_read_us(c, sets, N, K, reps);
      add({shape, "t: TMA ring", c.name(), t, bytes, c.variants ? fb.us : fw.us, "x floor"});
    } catch (const std::exception& e) {
      std::printf("%-12s t: %s: %s\n", shape.c_str(), c.name().c_str(), e.what());
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    cudaDeviceProp prop{};
    BITDELTA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
                prop.l2CacheSize >> 20);
    RandomFill rnd;
    copy_bw = bitdelta::bench::copy_bandwidth();  // the roofline
    std::printf("device-to-device copy of 2 GiB: %.0f GB/s, read + written (the roofline below)\n\n", copy_bw / 1e9);
    std::printf("%-12s %-22s %-26s %10s %10s %8s %7s %7s\n", "shape", "case", "version", "time_us",
                "MB", "GB/s", "roof/t", "ratio");
    bcuda::PrefillLinear prefill(nullptr, size_t(8192) * 11008);
    std::vector<std::pair<int, int>> shapes = {
        {4096, 4096}, {11008, 4096}, {4096, 11008}, {8192, 8192}, {28672, 8192}};
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "--profile") {  // [N K], default 8192 8192
      const int pn = argc > 3 ? std::atoi(argv[2]) : 8192, pk = argc > 3 ? std::atoi(argv[3]) : 8192;
      return bench_shape(rnd, prefill, pn, pk, true), 0;
    }
    if (mode == "--profile-prefill") {  // [N K [rows]], default 4096 4096 512
      const int pn = argc > 3 ? std::atoi(argv[2]) : 4096, pk = argc > 3 ? std::atoi(argv[3]) : 4096;
      const int rows = argc > 4 ? std::atoi(argv[4]) : 512;
      if (rows < 1) throw std::runtime_error("--profile-prefill: rows must be at least 1");
      return bench_shape(rnd, prefill, pn, pk, true, true, rows), 0;
    }
    if (mode == "--tile-read") {  // [N K ...], default the five shapes
      if (argc > 3) {
        shapes.clear();
        for (int i = 2; i + 1 < argc; i += 2) shapes.emplace_back(std::atoi(argv[i]), std::atoi(argv[i + 1]));
      }
      for (auto [N, K] : shapes) bench_tile_read(rnd, N, K);
      return 0;
    }
    if (mode == "--quick") shapes.resize(1);
    if (mode == "--stream-trace" || mode == "--route-trace") {  // [N K ...], default the five shapes
      if (argc > 3) {
        shapes.clear();
        for (int i = 2; i + 1 < argc; i += 2) shapes.emplace_back(std::atoi(argv[i]), std::atoi(argv[i + 1]));
      }
      for (auto [N, K] : shapes)
        bench_shape(rnd, prefill, N, K, false, false, 512, false, false, true, mode == "--stream-trace" ? 1 : 2);
      return 0;
    }
    if ((mode == "--one-row" || mode == "--many-variants") && argc > 3) {  // [N K ...]: those shapes
      shapes.clear();
      for (int i = 2; i + 1 < argc; i += 2) shapes.emplace_back(std::atoi(argv[i]), std::atoi(argv[i + 1]));
    }
    int prefill_rows = 512;
    if (mode == "--prefill-rows") {  // --prefill-rows R [N K ...]: case (c) with R rows instead of 512
      if (argc < 3 || std::atoi(argv[2]) < 1) throw std::runtime_error("--prefill-rows takes a row count");
      prefill_rows = std::atoi(argv[2]);
      if (argc > 4) {
        shapes.clear();
        for (int i = 3; i + 1 < argc; i += 2) shapes.emplace_back(std::atoi(argv[i]), std::atoi(argv[i + 1]));
      }
      for (auto [N, K] : shapes) bench_shape(rnd, prefill, N, K, false, true, prefill_rows, false, false, false, false, true);
      return 0;
    }
    if (mode == "--portable-sweep") {  // --portable-sweep R1,R2,... [N K ...]: the portable GEMM's configurations
      if (argc < 3) throw std::runtime_error("--portable-sweep takes row counts, e.g. 33,48,64,96,128");
      std::vector<int> rows;
      for (const char* p = argv[2]; *p;) {
        rows.push_back(std::atoi(p));
        while (*p && *p != ',') ++p;
        if (*p == ',') ++p;
      }
      if (rows.empty() || *std::min_element(rows.begin(), rows.end()) < 1)
        throw std::runtime_error("--portable-sweep: row counts must be at least 1");
      if (argc > 4) {
        shapes.clear();
        for (int i = 3; i + 1 < argc; i += 2) shapes.emplace_back(std::atoi(argv[i]), std::atoi(argv[i + 1]));
      }
      for (auto [N, K] : shapes) bench_portable_sweep(rnd, prefill, N, K, rows);
      return 0;
    }
    if (mode == "--prefill-fresh-x") {  // [N K ...]: case (c) with x copied into place before each call
      if (argc > 3) {
        shapes.clear();
        for (int i = 2; i + 1 < argc; i += 2) shapes.emplace_back(std::atoi(argv[i]), std::atoi(argv[i + 1]));
      }
      for (auto [N, K] : shapes)
        bench_shape(rnd, prefill, N, K, false, true, 512, false, false, false, 0, true, true);
      return 0;
    }
    if (mode == "--prefill" && argc > 3) {  // --prefill N K [N K ...]: case (c) at these shapes instead
      shapes.clear();
      for (int i = 2; i + 1 < argc; i += 2) shapes.emplace_back(std::atoi(argv[i]), std::atoi(argv[i + 1]));
    }
    if (mode == "--few-rows" && argc > 3) {  // --few-rows N K [N K ...]: case c' only, at these shapes
      shapes.clear();
      for (int i = 2; i + 1 < argc; i += 2) shapes.emplace_back(std::atoi(argv[i]), std::atoi(argv[i + 1]));
    }
    for (auto [N, K] : shapes)
      bench_shape(rnd, prefill, N, K, false, mode == "--prefill" || mode == "--few-rows", 512, mode == "--few-rows",
                  mode == "--one-row", mode == "--many-variants");
    std::printf(
        "\ncolumns: time = median µs; MB = bytes the op must move; GB/s = MB/time; roof/t = (bytes "
        "/ copy "
        "bandwidth) / time, the fraction of the byte roofline; ratio = time / (cuBLAS or roofline "
        "time); in (c) each form's cuBLAS time is its own, timed call by call alternating with it\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_fused_linear: %s\n", e.what());
    return 1;
  }
  return 0;
}
