// Programmatic dependent launch (sm_90+) along the decode step. Every kernel that the model runs on
// its stream, except cuBLAS's and the prefill path's own (the fused GEMM, the W_eff expansion), is
// launched with launch_chained, so that it may start while the kernel before it still runs. The rule
// that keeps this correct: each such kernel calls pdl_launch_dependents() first (the next kernel may
// then start too) and pdl_wait() before any access to memory that a kernel writes. Only reads of
// weights and deltas (written before any step, with the stream synchronized) and of what a copy on the
// stream put in place before the step's first kernel (the row descriptors, row map and attention tiles
// of the step, RoPE's frequencies: a copy never starts early, so every kernel after it starts after it
// has finished), and a decode row's keys and values at positions before its last (attention; earlier
// steps wrote them) may come before the wait. The linear kernels use that time to start on W (the register
// kernel sends its first block to L2, the streaming kernel copies its first stages of W and the signs
// into shared memory); the norm loads its weights, RoPE computes its sines and cosines. A kernel
// past its wait knows that every earlier kernel on the stream has finished: its predecessor has, and
// that one passed its own wait before finishing.
// A kernel launched the ordinary way (cuBLAS) never signals early, so the next one starts after it.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "code_arch.h"
#include "cuda_check.cuh"

namespace bitdelta::cuda {

// Multiprocessors of the current device (the runtime answers from its cache).
inline int multiprocessors() {
  int dev = 0, sms = 0;
  BITDELTA_CUDA_CHECK(cudaGetDevice(&dev));
  BITDELTA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// A hint that the 128-byte line at p will be read soon (global memory, to L2).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

// loaded_code, sm90a_kernels_run, dependent_launch_supported: code_arch.h.

// The launch of a kernel allowed to start before the previous kernel on the stream finishes (see
// above); attr is its storage.
inline cudaLaunchConfig_t chained_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                         cudaLaunchAttribute& attr) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = dependent_launch_supported() ? 1 : 0;
  return cfg;
}

// The shared-memory configuration a chained kernel prefers: at least `bytes` per multiprocessor (the
// driver rounds up to a configuration it has; the rest of the 256 KB is L1), set when it changes for
// that kernel and device. Every chained kernel prefers 64 KB, the one-row kernel more where two of its
// blocks need more. Left to the driver, each launch took the least shared memory that its blocks'
// occupancy by shared memory alone needs, and a decode step changed configuration 162–258 times in
// 291 launches (ncu, run 236): add_rmsnorm 8 KB, RoPE, attention and SwiGLU 32 KB, the one-row kernel
// 8–100 KB, the streaming kernel 228 KB. With this rule the mixed batch-32 step of the 7B shape took
// 11.83–11.89 ms against 12.22–12.23, every other step level (run 238, interleaved). Larger
// preferences slowed batch 1 (100 KB and more: the one-row kernel's loads need L1; run 236), and a
// preference on the other kernels but not on the one-row kernel made it 40% slower (run 237). Yet ncu
// (run 258) reports the kernels of a step running under different configurations still: add_rmsnorm
// and the streaming kernel 228 KB, the one-row kernel 100 or 132, RoPE 132, attention 100, SwiGLU 64;
// 290 changes in the 291 launches of a batch-1 step. Why the preference does not hold is not known.
constexpr unsigned kPreferredSharedBytes = 64u << 10;
void prefer_shared_config(const void* kernel, unsigned bytes = kPreferredSharedBytes);

// kernel<<<grid, block, smem, stream>>>(args...), chained, preferring `shared` bytes of shared
// memory per multiprocessor.
template <typename... Params, typename... Args>
void launch_chained_shared(unsigned shared, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                           cudaStream_t stream, Args&&... args) {
  prefer_shared_config(reinterpret_cast<const void*>(kernel), shared);
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = chained_config(grid, block, smem, stream, attr);
  BITDELTA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// kernel<<<grid, block, smem, stream>>>(args...), chained.
template <typename... Params, typename... Args>
void launch_chained(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                    Args&&... args) {
  launch_chained_shared(kPreferredSharedBytes, kernel, grid, block, smem, stream, std::forward<Args>(args)...);
}

// The same for a kernel chosen at run time, its arguments as an array of pointers.
inline void launch_chained(const void* kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, void** args) {
  prefer_shared_config(kernel);
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = chained_config(grid, block, smem, stream, attr);
  BITDELTA_CUDA_CHECK(cudaLaunchKernelExC(&cfg, kernel, args));
}

}  // namespace bitdelta::cuda
