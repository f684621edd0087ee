// The per-block timeline of the diagnostic build (CMake option BITDELTA_STREAM_TRACE): what the
// streaming kernel (fused_linear_stream.cu) and the delta terms kernel (delta_terms.cu) share to
// record their blocks' events into a __device__ array of words and read it back.
#pragma once

#ifdef BITDELTA_STREAM_TRACE
#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "cuda_check.cuh"

namespace bitdelta::cuda {

__device__ __forceinline__ unsigned long long trace_clock() {  // %globaltimer, ns
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned long long trace_sm() {  // the multiprocessor's id + 1 (0: no block)
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(id));
  return id + 1ull;
}

// The `words` words of the trace array `symbol`, read after the device is idle, then zeroed.
inline std::vector<unsigned long long> take_trace(const void* symbol, size_t words) {
  std::vector<unsigned long long> v(words);
  BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
  BITDELTA_CUDA_CHECK(cudaMemcpyFromSymbol(v.data(), symbol, words * sizeof(v[0])));
  const std::vector<unsigned long long> zero(words, 0);
  BITDELTA_CUDA_CHECK(cudaMemcpyToSymbol(symbol, zero.data(), words * sizeof(zero[0])));
  return v;
}

}  // namespace bitdelta::cuda
#endif
