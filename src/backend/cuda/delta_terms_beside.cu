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
  terms_ = terms, n_ = n;
  written_.clear();
}

void DeltaTermsBeside::add_terms(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows,
                                 std::span<const DeltaRef> deltas, float* terms, const uint8_t* xq,
                                 int warps_along_k) {
  if (xq && rows > kMaxDecodeRows)
    fail("cuda::DeltaTermsBeside: x quantized before for ", rows, " rows (at most ", kMaxDecodeRows, ")");
  if (terms < terms_ || terms + size_t(rows) * size_t(N) > terms_ + n_)
    fail("cuda::DeltaTermsBeside: terms outside the buffer forked");
  DecodeOptions o;
  o.delta_only = true;
  o.delta_store = true;
  o.xq = xq;
  o.k_split = warps_along_k;
  for (int r = 0; r < rows; ++r)
    if (deltas[size_t(r)].signs) {
      const size_t at = size_t(terms - terms_) + size_t(r) * size_t(N);
      written_.emplace_back(at, at + size_t(N));
    }
  for (int c = 0; c < rows; c += kMaxDecodeRows) {
    const int n = std::min(rows - c, kMaxDecodeRows);
    fused_linear_decode(w, N, K, x + size_t(c) * K, n, deltas.subspan(size_t(c), size_t(n)), terms + size_t(c) * N,
                        side_, o);
  }
}

void DeltaTermsBeside::join(cudaStream_t stream) {
  std::sort(written_.begin(), written_.end());
  size_t at = 0;  // zeros where nothing was written, a memset per gap
  for (const auto& [a, b] : written_) {
    if (a > at) BITDELTA_CUDA_CHECK(cudaMemsetAsync(terms_ + at, 0, (a - at) * sizeof(float), side_));
    at = std::max(at, b);
  }
  if (at < n_) BITDELTA_CUDA_CHECK(cudaMemsetAsync(terms_ + at, 0, (n_ - at) * sizeof(float), side_));
  written_.clear();
  BITDELTA_CUDA_CHECK(cudaEventRecord(join_, side_));
  BITDELTA_CUDA_CHECK(cudaStreamWaitEvent(stream, join_));
}

}  // namespace bitdelta::cuda
