// Compressor row kernels against this machine's measured read bandwidth (the roofline).
// Each benchmark reports bytes moved per second and `roofline` = achieved / measured read bandwidth.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <numeric>
#include <vector>

#include "bitdelta/dtype.h"
#include "delta/compress_kernel.h"

using namespace bitdelta;

namespace {

double g_read_bw = 0;  // bytes/s, one thread, measured below

std::vector<uint64_t> big_buffer(size_t bytes) {
  std::vector<uint64_t> v(bytes / 8);
  std::iota(v.begin(), v.end(), 1);
  return v;
}

void BM_ReadBandwidth(benchmark::State& state) {
  const auto buf = big_buffer(size_t(1) << 30);
  for (auto _ : state) {
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = 0; i < buf.size(); i += 4) {
      a += buf[i], b += buf[i + 1], c += buf[i + 2], d += buf[i + 3];
    }
    benchmark::DoNotOptimize(a + b + c + d);
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(buf.size() * 8));
}

struct Pair {
  std::vector<uint16_t> base, ft;
  size_t rows, cols;
};

Pair make_pair(size_t rows, size_t cols) {
  Pair p{std::vector<uint16_t>(rows * cols), std::vector<uint16_t>(rows * cols), rows, cols};
  uint32_t s = 12345;
  for (size_t i = 0; i < rows * cols; ++i) {
    s = s * 1664525u + 1013904223u;
    const float w = float(int32_t(s >> 8) - (1 << 23)) / float(1 << 23) * 0.05f;
    s = s * 1664525u + 1013904223u;
    const float d = float(int32_t(s >> 8) - (1 << 23)) / float(1 << 23) * 0.002f;
    p.base[i] = f32_to_bf16(w);
    p.ft[i] = f32_to_bf16(w + d);
  }
  return p;
}

template <bool kSimd>
void BM_CompressBf16(benchmark::State& state) {
  const Pair p = make_pair(size_t(state.range(0)), size_t(state.range(1)));
  std::vector<float> b32(p.cols), f32(p.cols);
  std::vector<uint8_t> signs(p.rows * ((p.cols + 7) / 8));
  double sink = 0;
  for (auto _ : state) {
    for (size_t r = 0; r < p.rows; ++r) {
      to_f32(DType::BF16, reinterpret_cast<const std::byte*>(p.base.data() + r * p.cols), b32.data(), p.cols);
      to_f32(DType::BF16, reinterpret_cast<const std::byte*>(p.ft.data() + r * p.cols), f32.data(), p.cols);
      uint8_t* out = signs.data() + r * ((p.cols + 7) / 8);
      const RowSums s = kSimd ? compress_row(b32.data(), f32.data(), p.cols, out)
                              : compress_row_scalar(b32.data(), f32.data(), p.cols, out);
      sink += s.abs;
    }
  }
  benchmark::DoNotOptimize(sink);
  const double bytes = double(p.rows * p.cols * 4);  // two bf16 inputs
  state.SetBytesProcessed(int64_t(state.iterations() * bytes));
  state.counters["roofline"] = benchmark::Counter(bytes / g_read_bw, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  // Measure the roofline first, in this process.
  {
    const auto buf = big_buffer(size_t(1) << 30);
    double best = 0;
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      uint64_t a = 0, b = 0, c = 0, d = 0;
      for (size_t i = 0; i < buf.size(); i += 4) a += buf[i], b += buf[i + 1], c += buf[i + 2], d += buf[i + 3];
      benchmark::DoNotOptimize(a + b + c + d);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, double(buf.size() * 8) / s);
    }
    g_read_bw = best;
    std::printf("measured read bandwidth (1 thread, 1 GiB, best of 5): %.2f GB/s\n", g_read_bw / 1e9);
  }
  benchmark::RegisterBenchmark("ReadBandwidth/1GiB", BM_ReadBandwidth)->Unit(benchmark::kMillisecond);
  for (auto shape : {std::pair{4096, 4096}, std::pair{11008, 4096}}) {
    benchmark::RegisterBenchmark("CompressBf16/simd", BM_CompressBf16<true>)->Args({shape.first, shape.second})->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("CompressBf16/scalar", BM_CompressBf16<false>)->Args({shape.first, shape.second})->Unit(benchmark::kMillisecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
