// The delta terms alone for up to 32 rows of several variants: y[r] += α_v(r) ⊙ (x[r]·S_v(r)ᵀ), W not
// read. Where the streaming kernel does not run (GPUs without the sm_90a code), a decode step's
// gathered rows of several variants, from 3 (kDeltaTermsRows, device_model.cu), take the base of all
// of them through one GEMM (cuBLAS, W read once) and then this (DecodeOptions::delta_only).
//
// Bytes decide it: each variant's sign bits are read once from memory per call. A block takes one
// slot (up to RS rows of one variant: 2 where a variant has more than one row, else 1) and 1, 2 or 4
// sets of 4 row groups (16 output rows each); the 8, 4 or 2 warps of a set split K in pairs of
// blocks of 256 columns, a pair per load batch (8 sign fragments of 16 bytes a lane in flight), the
// first before the wait for the launch before. The arithmetic is the decode kernels' 1-bit mma
// (delta_b1.cuh, the plane weights applied as the streaming kernel does) on x quantized by
// quantize_x, but with one scale per pair of blocks (the maximum over 512 columns), so that a pair's
// popcounts add in the mma's accumulator and the rest of the arithmetic runs once per pair: its
// rounding is not the other kernels' (measured: bench/cuda/NOTES.md, part 35; errors against the CPU
// as small as theirs). The warps' sums meet in shared memory in a fixed
// order: the same floats on every run. The slots of one variant are neighbouring blocks, so its bits
// come from memory once and from L2 for the others. It is bound by issue and latency at 16 warps per
// multiprocessor, not by bytes in flight: a ring of cp.async stages and a persistent form were slower
// (measured: bench/cuda/NOTES.md, parts 33 and 34). At 2 load batches per warp more than half of a
// warp's instructions are its start and end (part 39), so slots take 4 batches per warp (2 warps
// along K) where the waves of blocks allow it (delta_terms.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <vector>

#include "bitdelta/delta_ref.h"

namespace bitdelta::cuda {

// xq: the rows quantized by quantize_x in pairs (rows, K; quantize_x(..., pairs = true)); deltas[r]:
// row r's variant (signs in the packed layout, 16-byte aligned; rows without signs add nothing).
// y[rows, N] is added to, or with store its rows with a delta are written (the terms alone, y not
// read) and the others left as they are. warps_along_k: 2, 4 or 8 per set of row groups; 0 = choose
// (delta_terms.cu: tests and benchmarks set it).
void delta_terms(const uint8_t* xq, int rows, int N, int K, std::span<const DeltaRef> deltas, float* y,
                 cudaStream_t stream, bool store = false, int warps_along_k = 0);

#ifdef BITDELTA_STREAM_TRACE
// The timeline of the last launches (the diagnostic build of fused_linear_stream.cuh's trace): per block
// (up to kTermsTraceBlocks) kTermsTraceEvents words, %globaltimer ns, each launch's blocks overwriting
// what they record; zeroed after the read (which synchronizes the device).
constexpr int kTermsTraceBlocks = 4096, kTermsTraceEvents = 4;
enum TermsTraceEvent { kTermsEntry = 0, kTermsWaited = 1, kTermsDone = 2, kTermsSm = 3 };  // kTermsSm: SM id + 1
std::vector<unsigned long long> terms_trace_take();
#endif

}  // namespace bitdelta::cuda
