// The streaming decode kernel (sm_90a), one of fused_linear_decode's two kernels (1..32 rows of x,
// each with its own variant or none):
//
//   y[r] = x[r]·Wᵀ + α_v(r) ⊙ (x[r]·S_v(r)ᵀ)
//
// Persistent thread blocks (one per multiprocessor) take equal ranges of (64-row tile, 256-column
// block) units: whole tiles, and where that is uneven, a tile cut between two blocks whose sums meet
// in memory by exchange. One producer thread streams, per block, W's 64 × 256 tile, x's rows and
// each distinct variant's 64 × 256 sign bits (2 KB, the packed layout of packed_signs.h) with the
// tensor memory accelerator into a ring of shared-memory stages, and x's bit-planes, which the
// blocks first make themselves (each a share of x's 256-column blocks, published to the others
// through memory). Three consumer warpgroups: the first computes W·xᵀ with wgmma (both operands in
// shared memory: no instruction touches W's bytes); all share the rows' delta terms on the 1-bit mma
// (fused_linear_decode.cuh). The bytes still decide it: W once per launch, each variant's bits once.
// With every row of one variant it can instead form W_eff = W + α·S in each stage (form_weights).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <vector>

#include "bitdelta/delta_ref.h"

namespace bitdelta::cuda {

constexpr int kMaxStreamVariants = 16;  // distinct variants per launch

struct StreamArgs {
  const __nv_bfloat16* w = nullptr;
  int N = 0, K = 0;
  const __nv_bfloat16* x = nullptr;
  int rows = 0;
  const DeltaRef* deltas = nullptr;  // per row (host array of device pointers; packed signs)
  // If any row has a delta, one of: x quantized before (quantize_x), or a buffer of this stream
  // (quantized_x_bytes) that the kernel quantizes x into before it uses it.
  const uint8_t* xq = nullptr;
  uint8_t* xq_scratch = nullptr;
  float* y = nullptr;                // [rows, N]
  int blocks = 0;                    // > 0: that many blocks on equal ranges of units (at most the tiles, or twice)
  int stages = 0;                    // 0 = as many as fit
  // Every row of one variant: W_eff = W + α·S formed in bf16 in each stage (in shared memory, by all
  // consumers) and multiplied on wgmma with the base, instead of each row's delta term on the 1-bit
  // mma. Rounds as the fused prefill GEMM does (W_eff in bf16: its error bound, not the decode one);
  // x is not quantized (xq and xq_scratch unused).
  bool form_weights = false;
};

// Whether the current device runs the kernel (sm_90 with the tensor-map encoder) and takes these
// operands (K a multiple of 8: TMA row strides of 16 bytes; W and x 16-byte aligned).
bool stream_kernel_supports(const __nv_bfloat16* w, int K, const __nv_bfloat16* x);
// Whether DecodeKernel::kAuto picks it for this shape (by measurement: bench/cuda/NOTES.md).
bool stream_kernel_preferred(int N, int K, int rows);
void fused_linear_stream(const StreamArgs& args, cudaStream_t stream);

#ifdef BITDELTA_STREAM_TRACE
// The timeline of the last launches (a diagnostic build, CMake option BITDELTA_STREAM_TRACE): per block
// (up to kTraceBlocks) kTraceEvents words, each launch's blocks overwriting what they record; zeroed
// after the read (which synchronizes the device). Times are %globaltimer ns; kTraceSm holds the
// multiprocessor's id + 1 (0: the block did not run). Piece j < kTracePieces of a block (in its order):
// kTracePiece + 2j when its last stage is done, + 1 when its sums are written.
constexpr int kTraceBlocks = 264, kTraceEvents = 16, kTracePieces = 5;
enum TraceEvent {
  kTraceEntry = 0,   // block entry (thread 0)
  kTraceFirst = 1,   // the first stage has landed (consumer thread 0)
  kTraceIssued = 2,  // the producer has issued its last copy
  kTraceDone = 3,    // the consumers are done (thread 0)
  kTraceSm = 4,
  kTracePiece = 5,
};
std::vector<unsigned long long> stream_trace_take();
// Knockouts, for the timeline only: the launches after this call skip these parts of their work, so
// that a trace shows what each costs. Their results are wrong. 0 restores the kernel.
void stream_knockout(int bits);
#endif
// The knockouts' parts (stream_knockout; other builds never skip any).
enum StreamKnock {
  kKnockWrite = 1,     // a piece's sums not written to y (no stores, no exchange)
  kKnockXCopies = 2,   // x and its bit-planes not copied (the stages hold W and the signs only)
  kKnockDelta = 4,     // the consumers skip the delta rows' 1-bit mma
  kKnockEpilogue = 8,  // no epilogue at all: no barriers, no sums to shared memory, nothing written
};

}  // namespace bitdelta::cuda
