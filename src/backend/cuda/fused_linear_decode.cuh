// The fused multi-variant BitDelta linear for decode (1..16 rows), on the tensor cores:
//   y[r] = x[r]·W_baseᵀ + α_v(r) ⊙ (x[r]·S_v(r)ᵀ),   S = ±1 from the sign bits (DESIGN.md §3).
// The warps of a block share 16-row tiles of W: split along K (k_split) and, with many variants,
// across them (2–4 variants per warp; the first warp of a tile also does the base). Per 64 columns
// a tile's 16 rows of the base are read once (16-byte loads) for all rows of x, and each distinct
// variant's sign words once. The signs become ±1 bf16 pairs with one shift and one LOP3 per pair
// (bit k and bit k+16 of a sign word land on the two sign bits of one register) and feed
// mma.m16n8k16 with the same x fragments as the base. W_eff is never formed; bf16 products are
// exact and summed by the tensor cores in f32 (not IEEE-rounded: ~1e-5 relative over K = 11008 in
// one accumulator). Measured on the H200 against cuBLAS and the byte roofline: bench/cuda/NOTES.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <span>

#include "bitdelta/delta_ref.h"

namespace bitdelta::cuda {

struct DecodeOptions {
  int k_split = 0;  // warps that share one 16-row tile along K (1, 2, 4 or 8; 0 = choose)
};

// w: [N, K] bf16 row-major; x: [rows, K] bf16; y: [rows, N] f32; all device pointers. deltas[r]
// (host array of device pointers) is row r's variant; rows with the same signs pointer share one
// read of its bits.
void fused_linear_decode(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows,
                         std::span<const DeltaRef> deltas, float* y, cudaStream_t stream,
                         const DecodeOptions& options = {});

// The k_split that fused_linear_decode chooses for N output rows (before slot groups take warps).
int decode_default_k_split(int N);

}  // namespace bitdelta::cuda
