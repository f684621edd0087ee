// Scratch device memory that kernels of one stream reuse launch after launch: the quantized rows of
// x, split-K partial sums and their counters. One buffer per (device, stream, use), grown on demand.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace bitdelta::cuda {

enum class ScratchUse {
  kQuantizedX,          // fused_linear_decode: x's rows quantized for the delta term
  kStreamParts,         // the streaming decode kernel: split tiles' partial sums
  kStreamCounters,      // ... and their arrival counters
  kAttentionParts,      // attention over positions split over blocks: the parts
  kAttentionCounters,   // ... and their arrival counters
  kPromptQuery,         // attention of a prompt run on GEMMs: its queries in bf16 (high and low parts)
  kPromptScores,        // ... the scores
  kPromptProbs,         // ... the probabilities in bf16
  kPrefillParts,        // the fused prefill GEMM: the sums of tiles split over blocks
  kPrefillCounters,     // ... and their arrival counters
};

// A buffer of at least `bytes` for `use` on the current device and `stream`. A larger request
// replaces the buffer after the stream's work so far (which may still use it) has finished. With
// zeroed, a new buffer is zero-filled on the stream: for counters that the kernels leave at zero
// when they finish.
void* stream_scratch(ScratchUse use, cudaStream_t stream, size_t bytes, bool zeroed = false);

}  // namespace bitdelta::cuda
