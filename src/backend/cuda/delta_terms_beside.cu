#include "delta_terms_beside.cuh"

#include <algorithm>

#include "cuda_check.cuh"
#include "fused_linear_decode.cuh"

namespace bitdelta::cuda {

DeltaTermsBeside::DeltaTermsBeside() {
  BITDELTA_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
  BITDELTA_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  BITDELTA_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
}

DeltaTermsBeside::~DeltaTermsBeside() {
  cudaStreamSynchronize(side_);
  cudaStreamDestroy(side_);
  cudaEventDestroy(fork_);
  cudaEventDestroy(join_);
}

void DeltaTermsBeside::fork(cudaStream_t stream, float* terms, size_t n) {
  BITDELTA_CUDA_CHECK(cudaEventRecord(fork_, stream));
  BITDELTA_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_));
  BITDELTA_CUDA_CHECK(cudaMemsetAsync(terms, 0, n * sizeof(float), side_));
}

void DeltaTermsBeside::add_terms(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows,
                                 std::span<const DeltaRef> deltas, float* terms, const uint8_t* xq) {
  if (xq && rows > kMaxDecodeRows)
    fail("cuda::DeltaTermsBeside: x quantized before for ", rows, " rows (at most ", kMaxDecodeRows, ")");
  DecodeOptions o;
  o.delta_only = true;
  o.xq = xq;
  for (int c = 0; c < rows; c += kMaxDecodeRows) {
    const int n = std::min(rows - c, kMaxDecodeRows);
    fused_linear_decode(w, N, K, x + size_t(c) * K, n, deltas.subspan(size_t(c), size_t(n)), terms + size_t(c) * N,
                        side_, o);
  }
}

void DeltaTermsBeside::join(cudaStream_t stream) {
  BITDELTA_CUDA_CHECK(cudaEventRecord(join_, side_));
  BITDELTA_CUDA_CHECK(cudaStreamWaitEvent(stream, join_));
}

}  // namespace bitdelta::cuda
