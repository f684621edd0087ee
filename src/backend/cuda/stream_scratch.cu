#include "stream_scratch.cuh"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <tuple>

#include "bitdelta/error.h"
#include "cuda_check.cuh"

namespace bitdelta::cuda {

namespace {
std::atomic<uint64_t> g_generation{0};
}

uint64_t stream_scratch_generation() { return g_generation.load(); }

void* stream_scratch(ScratchUse use, cudaStream_t stream, size_t bytes, bool zeroed) {
  struct Buffer {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  static std::mutex mutex;
  static std::map<std::tuple<int, cudaStream_t, ScratchUse>, Buffer> buffers;
  int dev = 0;
  BITDELTA_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard lock(mutex);
  Buffer& b = buffers[{dev, stream, use}];
  if (b.bytes < bytes) {
    // Not inside a graph's capture: the copies and frees below must run now (the model captures a
    // step only after running the same launches once, so the buffers are large enough by then).
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    BITDELTA_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    if (capturing != cudaStreamCaptureStatusNone) fail("cuda: a step buffer would grow while a graph is captured");
    if (b.ptr) {
      BITDELTA_CUDA_CHECK(cudaStreamSynchronize(stream));
      BITDELTA_CUDA_CHECK(cudaFree(b.ptr));
    }
    // At least double, so that a growing workload reallocates O(log size) times.
    b.bytes = std::max({bytes, 2 * b.bytes, size_t(64) << 10});
    BITDELTA_CUDA_CHECK(cudaMalloc(&b.ptr, b.bytes));
    ++g_generation;
    if (zeroed) BITDELTA_CUDA_CHECK(cudaMemsetAsync(b.ptr, 0, b.bytes, stream));
  }
  return b.ptr;
}

}  // namespace bitdelta::cuda
