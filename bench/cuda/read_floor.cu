// The least time one kernel launch takes to read given bytes from device memory: the floor under
// any kernel that must read them, at that size, timed as the benchmarks time theirs (one launch
// between CUDA events, buffers rotated past L2). Of the copy-bandwidth roofline, a small read pays
// the launch, the ramp of the first requests and the last blocks' tail on top of its bytes.
#include "read_floor.h"

#include <cstdio>
#include <string>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/launch.cuh"
#include "common.h"

namespace bitdelta::bench {
namespace {

struct Regions {
  const uint4* p[kMaxReadRegions];
  size_t n[kMaxReadRegions];  // 16-byte words
  int count;
};

// Every thread reads U words of a region at a time (stride apart, all in flight), XOR-folds them and
// writes only if the fold hits a value random data almost never gives: the loads cannot be dropped.
// Trace: per block {entry, end, %smid} into trace (%globaltimer ns), for read_floor_trace; the timed
// form (Trace false) has none of it.
// Chained: launched to start while the launch before still runs (programmatic dependent launch, as
// the engine's decode kernels are, launch.cuh): it lets the next start at once and reads before
// waiting, as those read weights before their wait.
template <int U, bool Trace = false, bool Chained = false>
__global__ void read_kernel(const __grid_constant__ Regions r, unsigned* sink, unsigned long long* trace = nullptr) {
  if constexpr (Chained) bitdelta::cuda::pdl_launch_dependents();
  if constexpr (Trace) {
    if (threadIdx.x == 0) {
      unsigned long long t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      trace[3 * blockIdx.x] = t;
    }
  }
  unsigned acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x, first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int j = 0; j < r.count; ++j) {
    const uint4* p = r.p[j];
    const size_t n = r.n[j];
    size_t i = first;
    for (; i + (U - 1) * stride < n; i += U * stride) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = __ldcs(p + i + u * stride);
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) {
      const uint4 v = __ldcs(p + i);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  if constexpr (Chained) bitdelta::cuda::pdl_wait();
  if (acc == 0x9e3779b9u) sink[0] = acc;
  if constexpr (Trace) {
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long t;
      unsigned smid;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
      trace[3 * blockIdx.x + 1] = t, trace[3 * blockIdx.x + 2] = smid;
    }
  }
}

Regions to_regions(const std::vector<ReadRegion>& regions) {
  Regions r{};
  for (const ReadRegion& g : regions) {
    if (r.count == kMaxReadRegions) fail("read_floor: more than ", kMaxReadRegions, " regions");
    if ((reinterpret_cast<uintptr_t>(g.ptr) & 15) != 0) fail("read_floor: a region is not 16-byte aligned");
    r.p[r.count] = static_cast<const uint4*>(g.ptr), r.n[r.count++] = g.bytes / 16;
  }
  return r;
}

int multiprocessors() {
  int device = 0, sms = 0;
  BITDELTA_CUDA_CHECK(cudaGetDevice(&device));
  BITDELTA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

}  // namespace

std::vector<unsigned long long> read_floor_trace(const std::vector<ReadRegion>& regions, int per_sm, int threads) {
  const int blocks = multiprocessors() * per_sm;
  DeviceMem sink(4), trace(size_t(blocks) * 3 * 8);
  read_kernel<4, true><<<blocks, threads>>>(to_regions(regions), static_cast<unsigned*>(sink.ptr),
                                            static_cast<unsigned long long*>(trace.ptr));
  BITDELTA_CUDA_CHECK(cudaGetLastError());
  std::vector<unsigned long long> v(size_t(blocks) * 3);
  BITDELTA_CUDA_CHECK(cudaMemcpy(v.data(), trace.ptr, v.size() * 8, cudaMemcpyDeviceToHost));
  return v;
}

ReadFloor read_floor_us(const std::function<std::vector<ReadRegion>(int)>& regions, int reps) {
  const int sms = multiprocessors();
  DeviceMem sink(4);
  const auto launch = [&](int rep, int blocks, int threads, int unroll) {
    const Regions r = to_regions(regions(rep));
    if (unroll == 4)
      read_kernel<4><<<blocks, threads>>>(r, static_cast<unsigned*>(sink.ptr));
    else
      read_kernel<8><<<blocks, threads>>>(r, static_cast<unsigned*>(sink.ptr));
    BITDELTA_CUDA_CHECK(cudaGetLastError());
  };
  ReadFloor best{1e30, "", {}, 0, 0, 0};
  for (int threads : {256, 512, 1024})
    for (int per_sm : {1, 2, 4, 8}) {
      if (threads * per_sm > 2048) continue;
      for (int unroll : {4, 8}) {
        const double t = time_us([&](int rep) { launch(rep, sms * per_sm, threads, unroll); }, reps);
        best.forms.emplace_back(per_sm * threads * unroll * 16 / 1024.0, t);
        if (t < best.us)
          best.us = t, best.per_sm = per_sm, best.threads = threads, best.unroll = unroll,
          best.form = std::to_string(per_sm) + " x " + std::to_string(threads) + " threads per SM, " +
                      std::to_string(unroll) + " loads of 16 B in flight per thread";
      }
    }
  return best;
}

double read_floor_chain_us(const std::function<std::vector<ReadRegion>(int)>& regions, const ReadFloor& form,
                           int calls) {
  const int blocks = multiprocessors() * form.per_sm;
  DeviceMem sink(4);
  return time_chain_us(
      [&](int rep) {
        const Regions r = to_regions(regions(rep));
        cudaLaunchAttribute attr;
        const cudaLaunchConfig_t cfg =
            bitdelta::cuda::chained_config(dim3(blocks), dim3(form.threads), 0, nullptr, attr);
        auto* out = static_cast<unsigned*>(sink.ptr);
        unsigned long long* none = nullptr;
        if (form.unroll == 4)
          BITDELTA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, read_kernel<4, false, true>, r, out, none));
        else
          BITDELTA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, read_kernel<8, false, true>, r, out, none));
      },
      calls);
}

}  // namespace bitdelta::bench
