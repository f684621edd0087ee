// Shared by the CUDA benchmarks: device buffers, the median time of many calls (each between CUDA
// events), and the device-to-device copy bandwidth (bytes read + written per second) that their
// rooflines divide by.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_check.cuh"

namespace bitdelta::bench {

// Device memory of a benchmark case (at least one byte).
struct DeviceMem {
  void* ptr = nullptr;
  explicit DeviceMem(size_t bytes) { BITDELTA_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(bytes, 1))); }
  ~DeviceMem() { cudaFree(ptr); }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
};

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median µs of fn(rep) over reps calls on the default stream, after `warmup` calls (rep counts on
// through them, so that callers can cycle through buffers). before(rep), if given, runs before each
// call, outside the timed interval (a launch that puts the call's input in place).
inline double time_us(const std::function<void(int)>& fn, int reps, int warmup = 3,
                      const std::function<void(int)>& before = {}) {
  for (int i = 0; i < warmup; ++i) {
    if (before) before(i);
    fn(i);
  }
  BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(2 * size_t(reps));
  for (auto& e : ev) BITDELTA_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    if (before) before(warmup + i);
    BITDELTA_CUDA_CHECK(cudaEventRecord(ev[2 * size_t(i)], nullptr));
    fn(warmup + i);
    BITDELTA_CUDA_CHECK(cudaEventRecord(ev[2 * size_t(i) + 1], nullptr));
  }
  BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> t(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    float ms = 0;
    BITDELTA_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * size_t(i)], ev[2 * size_t(i) + 1]));
    t[size_t(i)] = ms * 1e3;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return median(std::move(t));
}

// Median µs of fa and of fb over reps calls of each, alternating (fa, fb, fa, …) so that both see the
// same clocks: a GPU running GEMMs back to back reaches its power limit and lowers its clock (run
// 91: 1980 → 1410–1920 MHz; run 85: one configuration timed twice, seconds apart, came out 8%
// apart). fa gets even indices and fb odd ones, so that callers cycling through buffers by index
// never give both the same one. before(index), if given, runs before each call, untimed.
inline std::pair<double, double> time_pair_us(const std::function<void(int)>& fa, const std::function<void(int)>& fb,
                                              int reps, int warmup = 3,
                                              const std::function<void(int)>& before = {}) {
  const auto call = [&](const std::function<void(int)>& f, int i) {
    if (before) before(i);
    f(i);
  };
  std::vector<double> ta, tb;
  for (int i = 0; i < warmup; ++i) call(fa, 2 * i), call(fb, 2 * i + 1);
  std::vector<cudaEvent_t> ev(4 * size_t(reps));
  for (auto& e : ev) BITDELTA_CUDA_CHECK(cudaEventCreate(&e));
  BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
  for (int i = 0; i < reps; ++i) {
    cudaEvent_t* e = &ev[4 * size_t(i)];
    const int ia = 2 * (warmup + i), ib = ia + 1;
    if (before) before(ia);
    BITDELTA_CUDA_CHECK(cudaEventRecord(e[0], nullptr));
    fa(ia);
    BITDELTA_CUDA_CHECK(cudaEventRecord(e[1], nullptr));
    if (before) before(ib);
    BITDELTA_CUDA_CHECK(cudaEventRecord(e[2], nullptr));
    fb(ib);
    BITDELTA_CUDA_CHECK(cudaEventRecord(e[3], nullptr));
  }
  BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
  for (int i = 0; i < reps; ++i) {
    const cudaEvent_t* e = &ev[4 * size_t(i)];
    float a = 0, b = 0;
    BITDELTA_CUDA_CHECK(cudaEventElapsedTime(&a, e[0], e[1]));
    BITDELTA_CUDA_CHECK(cudaEventElapsedTime(&b, e[2], e[3]));
    ta.push_back(a * 1e3), tb.push_back(b * 1e3);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return {median(std::move(ta)), median(std::move(tb))};
}

// Median µs per call of `calls` calls back to back between two events (15 times): what a call
// costs where the launches before and after it overlap its start and end (programmatic dependent
// launch, src/backend/cuda/launch.cuh), as the kernels of a decode step do. fn(i) as in time_us.
inline double time_chain_us(const std::function<void(int)>& fn, int calls) {
  return time_us([&](int r) { for (int i = 0; i < calls; ++i) fn(r * calls + i); }, 15, 1) / calls;
}

// A device-to-device copy of 2 GiB, median of 20: bytes read + written per second.
inline double copy_bandwidth() {
  const size_t bytes = size_t(2) << 30;
  DeviceMem a(bytes), b(bytes);
  BITDELTA_CUDA_CHECK(cudaMemset(a.ptr, 1, bytes));
  const double t = time_us(
      [&](int) { BITDELTA_CUDA_CHECK(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice, nullptr)); }, 20);
  return 2.0 * double(bytes) / (t * 1e-6);
}

}  // namespace bitdelta::bench
