// The least time one kernel launch takes to read given bytes from device memory: the floor under
// any kernel that must read them, at that size, timed as the benchmarks time theirs (one launch
// between CUDA events, buffers rotated past L2). Of the copy-bandwidth roofline, a small read pays
// the launch, the ramp of the first requests and the last blocks' tail on top of its bytes.
#include "read_floor.h"

#include <cstdio>
#include <string>
#include <type_traits>
#include <utility>

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
// Wait (ChainWait, read_floor.h): alone, or chained, i.e. launched to start while the launch before
// still runs (programmatic dependent launch, as the engine's decode kernels are, launch.cuh), and
// reading before its wait for that launch, after it, or its first batch only before it (into
// registers, or sent to L2).
template <int U, bool Trace = false, int Wait = -1>
__global__ void read_kernel(const __grid_constant__ Regions r, unsigned* sink, unsigned long long* trace = nullptr) {
  constexpr bool kChained = Wait >= 0;
  constexpr int kBefore = int(ChainWait::kBefore), kAfter = int(ChainWait::kAfter);
  constexpr int kFirst = int(ChainWait::kFirstBatchBefore), kFirstL2 = int(ChainWait::kFirstBatchToL2);
  if constexpr (kChained) bitdelta::cuda::pdl_launch_dependents();
  if constexpr (Wait == kAfter) bitdelta::cuda::pdl_wait();
  if constexpr (Trace) {
    if (threadIdx.x == 0) {
      unsigned long long t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      trace[3 * blockIdx.x] = t;
    }
  }
  bool waiting = Wait == kFirst || Wait == kFirstL2;  // the wait still to come, after the first batch
  unsigned acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x, first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int j = 0; j < r.count; ++j) {
    const uint4* p = r.p[j];
    const size_t n = r.n[j];
    size_t i = first;
    for (; i + (U - 1) * stride < n; i += U * stride) {
      uint4 v[U];
      if (Wait == kFirstL2 && waiting) {
#pragma unroll
        for (int u = 0; u < U; ++u) bitdelta::cuda::prefetch_l2(p + i + u * stride);
        bitdelta::cuda::pdl_wait();
        waiting = false;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = __ldcs(p + i + u * stride);
      if (Wait == kFirst && waiting) {  // the batch's loads are on their way; their use waits
        bitdelta::cuda::pdl_wait();
        waiting = false;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (waiting) bitdelta::cuda::pdl_wait(), waiting = false;  // no whole batch in this region
    for (; i < n; i += stride) {
      const uint4 v = __ldcs(p + i);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  if (waiting) bitdelta::cuda::pdl_wait();  // no region
  if constexpr (Wait == kBefore) bitdelta::cuda::pdl_wait();
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

// The forms tried: (blocks per multiprocessor, threads per block), at most 2048 threads per SM.
std::vector<std::pair<int, int>> floor_forms() {
  std::vector<std::pair<int, int>> forms;
  for (int threads : {256, 512, 1024})
    for (int per_sm : {1, 2, 4, 8})
      if (threads * per_sm <= 2048) forms.emplace_back(per_sm, threads);
  return forms;
}
std::string form_name(const ReadFloor& f) {
  return std::to_string(f.per_sm) + " x " + std::to_string(f.threads) + " threads per SM, " +
         std::to_string(f.unroll) + " loads of 16 B in flight per thread";
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
  for (const auto& [per_sm, threads] : floor_forms())
    for (int unroll : {4, 8}) {
      const double t = time_us([&](int rep) { launch(rep, sms * per_sm, threads, unroll); }, reps);
      best.forms.emplace_back(per_sm * threads * unroll * 16 / 1024.0, t);
      if (t < best.us) best.us = t, best.per_sm = per_sm, best.threads = threads, best.unroll = unroll;
    }
  best.form = form_name(best);
  return best;
}

double read_floor_chain_us(const std::function<std::vector<ReadRegion>(int)>& regions, const ReadFloor& form,
                           int calls, ChainWait wait) {
  const int blocks = multiprocessors() * form.per_sm;
  DeviceMem sink(4);
  const auto launch = [&](const Regions& r, auto kernel) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = bitdelta::cuda::chained_config(dim3(blocks), dim3(form.threads), 0, nullptr, attr);
    unsigned long long* none = nullptr;
    BITDELTA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, r, static_cast<unsigned*>(sink.ptr), none));
  };
  const auto with_wait = [&](const Regions& r, auto unroll) {
    constexpr int U = decltype(unroll)::value;
    switch (wait) {
      case ChainWait::kBefore:
        return launch(r, read_kernel<U, false, int(ChainWait::kBefore)>);
      case ChainWait::kAfter:
        return launch(r, read_kernel<U, false, int(ChainWait::kAfter)>);
      case ChainWait::kFirstBatchBefore:
        return launch(r, read_kernel<U, false, int(ChainWait::kFirstBatchBefore)>);
      case ChainWait::kFirstBatchToL2:
        return launch(r, read_kernel<U, false, int(ChainWait::kFirstBatchToL2)>);
    }
  };
  return time_chain_us(
      [&](int rep) {
        const Regions r = to_regions(regions(rep));
        if (form.unroll == 4)
          with_wait(r, std::integral_constant<int, 4>{});
        else
          with_wait(r, std::integral_constant<int, 8>{});
      },
      calls);
}
ReadFloor read_floor_chain_best(const std::function<std::vector<ReadRegion>(int)>& regions, int calls,
                                ChainWait wait) {
  ReadFloor best{1e30, "", {}, 0, 0, 0};
  for (const auto& [per_sm, threads] : floor_forms())
    for (int unroll : {4, 8}) {
      ReadFloor f{0, "", {}, per_sm, threads, unroll};
      const double t = read_floor_chain_us(regions, f, calls, wait);
      best.forms.emplace_back(per_sm * threads * unroll * 16 / 1024.0, t);
      if (t < best.us) best.us = t, best.per_sm = per_sm, best.threads = threads, best.unroll = unroll;
    }
  best.form = form_name(best);
  return best;
}
}  // namespace bitdelta::bench
