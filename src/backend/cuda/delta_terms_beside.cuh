// A linear's delta terms on a second stream beside its base on the first: the route of a decode
// step's rows gathered from several variants of one weight (device_model.cu, linear()), and the
// same calls timed by bench_cuda_fused_linear ("route"). The base (the streaming kernel with no
// delta where it runs, else cuBLAS) reads W once for all the rows while the terms read each
// variant's signs once (delta_terms.cuh); side by side the two reads overlap (bench/cuda/NOTES.md,
// parts 40 and 55-56).
//
// One use, on the caller's stream s:  fork(s, terms, n);  add_terms(...) for each run of rows;
// the base on s;  join(s);  then y + terms, either added (ops.cuh add_to) or read as a second
// addend by the kernel that consumes y (add_rmsnorm, bias_rope_store, swiglu). Captured into a
// CUDA graph, the fork and the join become the graph's edges.
//
// The terms kernel writes its rows (DecodeOptions::delta_store), and the join zeroes only the rows
// of the buffer that no add_terms wrote (none where every gathered row has a variant): no memset
// node at the fork, where it stood between the kernel that writes x and the side stream's first
// kernel. Run 374 (H200, alternated twice): the terms branch alone at 4096², 16 rows of 16
// variants, 13.96 → 12.86 µs; the 7B mixed step of 14 variants at batch 32 11.19 / 11.03 →
// 10.96 / 10.97 ms (bench/cuda/NOTES.md, part 53).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "bitdelta/delta_ref.h"

namespace bitdelta::cuda {

class DeltaTermsBeside {
 public:
  DeltaTermsBeside();  // its stream (non-blocking) and two events, on the current device
  ~DeltaTermsBeside();
  DeltaTermsBeside(const DeltaTermsBeside&) = delete;
  DeltaTermsBeside& operator=(const DeltaTermsBeside&) = delete;

  // The side stream starts after the work on `stream` so far; terms[0, n) (device memory) is the
  // buffer, all of it zeros or terms after the join.
  void fork(cudaStream_t stream, float* terms, size_t n);
  // On the side stream: terms[rows, N] = α_v(r) ⊙ (x[r]·S_v(r)ᵀ) for x's rows (deltas[r]: row r's
  // variant; rows without signs are zeroed at the join), in launches of up to kMaxDecodeRows rows
  // that read their variants' signs once each and not W (fused_linear_decode, DecodeOptions::
  // delta_only and delta_store; w only names the shape's weight). The rows lie in the forked buffer,
  // and no two calls between a fork and its join take the same row. xq: x's rows quantized before, in
  // pairs (quantize_x's pairs form; then at most kMaxDecodeRows rows), or null: quantized by a
  // launch on the side stream. warps_along_k: DecodeOptions::k_split (0 = the kernel's choice).
  void add_terms(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows,
                 std::span<const DeltaRef> deltas, float* terms, const uint8_t* xq = nullptr,
                 int warps_along_k = 0);
  // On the side stream the buffer's floats that no add_terms wrote are zeroed; then the work on
  // `stream` from here on waits for the side stream's so far.
  void join(cudaStream_t stream);

  cudaStream_t stream() const { return side_; }

 private:
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  float* terms_ = nullptr;  // the forked buffer, n_ floats
  size_t n_ = 0;
  std::vector<std::pair<size_t, size_t>> written_;  // the ranges of it that add_terms wrote
};

}  // namespace bitdelta::cuda
