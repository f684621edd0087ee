// A linear's delta terms on a second stream beside its base's GEMM on the first: the route of a
// decode step's rows gathered from several variants of one weight (device_model.cu, linear()), and
// the same calls timed by bench_cuda_fused_linear ("cuBLAS | delta terms"). The GEMM reads W once
// for all the rows while the terms read each variant's signs once (delta_terms.cuh); side by side
// the two reads overlap (bench/cuda/NOTES.md, part 40).
//
// One use, on the caller's stream s:  fork(s, terms, n);  add_terms(...) for each run of rows;
// the GEMM on s;  join(s);  then y + terms, either added (ops.cuh add_to) or read as a second
// addend by the kernel that consumes y (add_rmsnorm, bias_rope_store, swiglu). Captured into a
// CUDA graph, the fork and the join become the graph's edges.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <span>

#include "bitdelta/delta_ref.h"

namespace bitdelta::cuda {

class DeltaTermsBeside {
 public:
  DeltaTermsBeside();  // its stream (non-blocking) and two events, on the current device
  ~DeltaTermsBeside();
  DeltaTermsBeside(const DeltaTermsBeside&) = delete;
  DeltaTermsBeside& operator=(const DeltaTermsBeside&) = delete;

  // The side stream starts after the work on `stream` so far and zeroes terms[0, n) (device memory).
  void fork(cudaStream_t stream, float* terms, size_t n);
  // On the side stream: terms[rows, N] += α_v(r) ⊙ (x[r]·S_v(r)ᵀ) for x's rows (deltas[r]: row r's
  // variant; rows without signs add nothing), in launches of up to kMaxDecodeRows rows that read
  // their variants' signs once each and not W (fused_linear_decode, DecodeOptions::delta_only; w
  // only names the shape's weight). xq: x's rows quantized before, in pairs (quantize_x's pairs
  // form; then at most kMaxDecodeRows rows), or null: quantized by a launch on the side stream.
  void add_terms(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows,
                 std::span<const DeltaRef> deltas, float* terms, const uint8_t* xq = nullptr);
  // The work on `stream` from here on waits for the side stream's so far.
  void join(cudaStream_t stream);

  cudaStream_t stream() const { return side_; }

 private:
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
};

}  // namespace bitdelta::cuda
