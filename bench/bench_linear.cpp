// The fused BitDelta linear on the CPU against this machine's measured read bandwidth.
// For each shape: base-only GEMV (1 row), one variant fused (1 row), 8 rows base-only, and 8 rows
// from 8 distinct variants. Bytes = base weight + each distinct variant's sign bits and α (x and y
// are negligible). Weights rotate among copies totalling > 4× the L3, so every call reads memory.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cpu/fused_linear.h"
#include "bitdelta/dtype.h"
#include "bitdelta/thread_pool.h"

using namespace bitdelta;

namespace {

constexpr size_t kThreads = 2;
double g_read_bw = 0;  // bytes/s with kThreads threads, measured in main()

ThreadPool& pool() {
  static ThreadPool p(kThreads);
  return p;
}

double measure_read_bandwidth() {
  std::vector<uint64_t> buf(size_t(1) << 27);  // 1 GiB
  std::iota(buf.begin(), buf.end(), 0);
  std::vector<uint64_t> sums(kThreads * 8);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    pool().parallel_for(kThreads, [&](size_t b, size_t e) {
      for (size_t t = b; t < e; ++t) {
        const size_t n = buf.size() / kThreads, from = t * n;
        uint64_t a = 0, c = 0, d = 0, f = 0;
        for (size_t i = from; i < from + n; i += 4)
          a += buf[i], c += buf[i + 1], d += buf[i + 2], f += buf[i + 3];
        sums[t * 8] = a + c + d + f;
      }
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(buf.size() * 8) / s);
  }
  benchmark::DoNotOptimize(sums.data());
  return best;
}

struct Setup {
  size_t N, K, copies;
  std::vector<std::vector<uint16_t>> w;
  std::vector<std::vector<cpu::PackedSigns>> signs;  // [copy][variant], the kernel's layout
  std::vector<std::vector<float>> alpha;                 // [variant]
};

Setup make_setup(size_t N, size_t K, size_t variants) {
  Setup s{N, K, std::max<size_t>(2, (160u << 20) / (N * K * 2)), {}, {}, {}};
  std::mt19937 rng(1);
  s.w.resize(s.copies);
  s.signs.resize(s.copies);
  for (size_t c = 0; c < s.copies; ++c) {
    s.w[c].resize(N * K);
    for (auto& v : s.w[c]) v = f32_to_bf16(float(int(rng() % 2001) - 1000) * 1e-4f);
    s.signs[c].resize(variants);
    for (auto& sv : s.signs[c]) {
      std::vector<uint8_t> file(N * ((K + 7) / 8));
      for (auto& b : file) b = uint8_t(rng());
      sv = cpu::pack_signs(file.data(), N, K);
    }
  }
  for (size_t v = 0; v < variants; ++v) s.alpha.emplace_back(N, 1e-3f);
  return s;
}

void BM_Linear(benchmark::State& state) {
  const size_t N = size_t(state.range(0)), K = size_t(state.range(1));
  const size_t rows = size_t(state.range(2)), variants = size_t(state.range(3));
  const auto isa = cpu::Isa(state.range(4));
  Setup s = make_setup(N, K, variants);
  std::vector<float> x(rows * K), y(rows * N);
  std::mt19937 rng(2);
  for (auto& v : x) v = float(int(rng() % 2001) - 1000) * 1e-3f;
  std::vector<DeltaRef> deltas(rows);
  size_t copy = 0;
  for (auto _ : state) {
    for (size_t r = 0; r < rows; ++r)
      deltas[r] = variants ? DeltaRef{nullptr, s.alpha[r % variants].data(), true,
                                      s.signs[copy][r % variants].get()}
                           : DeltaRef{};
    const TensorView w{DType::BF16, {N, K}, std::as_bytes(std::span(s.w[copy]))};
    cpu::fused_linear(w, x, rows, deltas, nullptr, y, pool(), isa);
    copy = (copy + 1) % s.copies;
  }
  const double bytes = double(N * K * 2) + double(variants) * double(cpu::packed_sign_words(N, K) * 4 + N * 4);
  state.SetBytesProcessed(int64_t(double(state.iterations()) * bytes));
  state.counters["MB"] = bytes / 1e6;
  state.counters["roofline"] =
      benchmark::Counter(bytes / g_read_bw, benchmark::Counter::kIsIterationInvariantRate);
}

// The same calls on ONE thread with one small weight (32×4096 bf16 = 256 KB, plus the variants'
// signs, stays in the core's 512 KB L2), repeated: no DRAM traffic and no thread wake-ups, so this
// is the compute ceiling of each tile on one core. Reports weights/s (N·K per call; the batch rows
// reuse the same weights) next to one core's share of the DRAM rate (2-thread read bandwidth / 2
// threads / 2 bytes per bf16 weight): a tile slower than that is compute-bound on cold weights.
void BM_LinearHot(benchmark::State& state) {
  const size_t N = size_t(state.range(0)), K = size_t(state.range(1));
  const size_t rows = size_t(state.range(2)), variants = size_t(state.range(3));
  const auto isa = cpu::Isa(state.range(4));
  std::mt19937 rng(1);
  std::vector<uint16_t> w(N * K);
  for (auto& v : w) v = f32_to_bf16(float(int(rng() % 2001) - 1000) * 1e-4f);
  std::vector<cpu::PackedSigns> signs(variants);
  for (auto& sv : signs) {
    std::vector<uint8_t> file(N * ((K + 7) / 8));
    for (auto& b : file) b = uint8_t(rng());
    sv = cpu::pack_signs(file.data(), N, K);
  }
  const std::vector<float> alpha(N, 1e-3f);
  std::vector<float> x(rows * K), y(rows * N);
  for (auto& v : x) v = float(int(rng() % 2001) - 1000) * 1e-3f;
  std::vector<DeltaRef> deltas(rows);
  for (size_t r = 0; r < rows; ++r)
    if (variants) deltas[r] = DeltaRef{nullptr, alpha.data(), true, signs[r % variants].get()};
  const TensorView wv{DType::BF16, {N, K}, std::as_bytes(std::span(w))};
  ThreadPool one(1);
  for (auto _ : state) cpu::fused_linear(wv, x, rows, deltas, nullptr, y, one, isa);
  state.counters["Gw/s"] =
      benchmark::Counter(double(N * K) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["DRAM_Gw/s"] = g_read_bw / double(kThreads) / 2 / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  g_read_bw = measure_read_bandwidth();
  std::printf("measured read bandwidth (%zu threads, 1 GiB, best of 5): %.2f GB/s\n", kThreads,
              g_read_bw / 1e9);
  // Every SIMD instruction set this CPU has (BITDELTA_CPU_ISA caps it), the widest first: on an
  // AVX-512 machine the AVX2 kernels run beside the AVX-512 ones in the same process.
  std::vector<cpu::Isa> isas;
  for (cpu::Isa isa : {cpu::Isa::avx512, cpu::Isa::avx2})
    if (isa <= cpu::best_isa() && cpu::cpu_has(isa)) isas.push_back(isa);
  if (isas.empty()) isas.push_back(cpu::Isa::scalar);
  std::printf("instruction sets:");
  for (cpu::Isa isa : isas) std::printf(" %s", cpu::isa_name(isa));
  std::printf("\n");
  const auto suffix = [](cpu::Isa isa) { return std::string("/isa:") + cpu::isa_name(isa); };
  for (auto [N, K] : {std::pair<long, long>{4096, 4096}, {11008, 4096}}) {
    for (auto [rows, variants] : {std::pair<long, long>{1, 0}, {1, 1}, {8, 0}, {8, 8}}) {
      for (cpu::Isa isa : isas) {
        const std::string name = std::string(variants ? "fused" : "base") + "/rows:" + std::to_string(rows) +
                                 "/variants:" + std::to_string(variants) + suffix(isa);
        benchmark::RegisterBenchmark(name.c_str(), BM_Linear)
            ->Args({N, K, rows, variants, long(isa)})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
      }
    }
  }
  for (auto [rows, variants] : {std::pair<long, long>{1, 0}, {1, 1}, {8, 0}, {8, 8}}) {
    for (cpu::Isa isa : isas) {
      const std::string name = std::string("hot/") + (variants ? "fused" : "base") + "/rows:" +
                               std::to_string(rows) + "/variants:" + std::to_string(variants) + suffix(isa);
      benchmark::RegisterBenchmark(name.c_str(), BM_LinearHot)
          ->Args({32, 4096, rows, variants, long(isa)})
          ->Unit(benchmark::kMicrosecond);  // one thread: CPU time, robust to other load
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
