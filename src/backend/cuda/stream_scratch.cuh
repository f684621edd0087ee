// Scratch device memory that kernels of one stream reuse launch after launch: the quantized rows of
// x, split-K partial sums and their counters. One buffer per (device, stream, use), grown on demand.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace bitdelta::cuda {

enum class ScratchUse {
  kQuantizedX,          // fused_linear_decode: x's rows quantized for the delta term
  kDecodeMeet,          // the balanced one-row decode kernel: where the two sums of a cut tile's row meet
  kStreamMeet,          // the streaming decode kernel: where the two sums of a cut tile meet
  kStreamXReady,        // ... which of x's quantized blocks are written, and how many blocks saw them all
  kAttentionParts,      // attention over positions split over blocks: the parts
  kAttentionCounters,   // ... and their arrival counters
  kPromptQuery,         // attention of a prompt run on GEMMs: its queries in bf16 (high and low parts)
  kPromptScores,        // ... the scores
  kPromptProbs,         // ... the probabilities in bf16
  kPrefillParts,        // the fused prefill GEMM: the sums of tiles split over blocks
  kPrefillCounters,     // ... and their arrival counters
  kDeltaTerms,          // a linear's delta terms computed beside its base (device_model.cu)
};

// A buffer of at least `bytes` for `use` on the current device and `stream`. A larger request
// replaces the buffer after the stream's work so far (which may still use it) has finished. With
// zeroed, a new buffer is zero-filled on the stream: for counters that the kernels leave at zero
// when they finish.
void* stream_scratch(ScratchUse use, cudaStream_t stream, size_t bytes, bool zeroed = false);
// A count of the buffers stream_scratch has (re)allocated: a launch captured in a graph holds its
// buffers' addresses, valid while this is unchanged.
uint64_t stream_scratch_generation();

#ifdef __CUDACC__
// The merge of a result split over blocks: each block writes its part to scratch, then calls this.
// True in the block that arrived last of `parts` at *counter; that block resets the counter (for
// the next launch, the counters' zero state) and on return sees every part's writes. `sync` is a
// barrier over the block's threads that wrote (all of them, or the consumer warpgroups), thread 0
// among them; `flag` is shared memory that no thread reads again before a later barrier.
template <typename Sync>
__device__ __forceinline__ bool last_to_arrive(unsigned* counter, unsigned parts, int& flag, Sync sync) {
  __threadfence();  // this thread's part before the block's arrival
  sync();
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(counter, 1u) == parts - 1;
    if (last) *counter = 0;
    flag = last;
  }
  sync();
  const bool last = flag != 0;
  if (last) __threadfence();  // the other parts' writes before this block's reads
  return last;
}

// The other merge, of a sum cut between exactly two blocks (the decode kernels' cut tiles), with no
// fence and no wait. Each block swaps its sum into the sum's word (scratch that is zero between
// launches): meet_swap returns what was there. Zero: the other block has not arrived, and finishes.
// Else the caller is second and takes meet_sum: own + other, the same float whichever block it is
// (addition is commutative), emptying the word for the next launch (the launch boundary orders that
// store before the next launch's swaps).
__device__ __forceinline__ unsigned long long meet_swap(unsigned long long* word, float own) {
  return atomicExch(word, (1ull << 32) | __float_as_uint(own));  // 2^32 | bits: never zero
}
__device__ __forceinline__ float meet_sum(unsigned long long* word, float own, unsigned long long other) {
  *word = 0;
  return own + __uint_as_float(unsigned(other));
}

#endif

}  // namespace bitdelta::cuda
