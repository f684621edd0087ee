// The fused multi-variant BitDelta linear for decode (1..32 rows; the register kernel takes 16 at a
// time, the streaming kernel all 32 in one read of W; with every row of one variant both can form
// W_eff instead, in one launch: DecodeOptions::form_weights):
//   y[r] = x[r]·W_baseᵀ + α_v(r) ⊙ (x[r]·S_v(r)ᵀ),   S = ±1 from the sign bits (DESIGN.md §3).
//
// Bytes decide it (decode is memory-bound): per launch the base is read once for all rows and each
// distinct variant's bits once. The warps of a block share 16-row tiles of W, split along K
// (k_split, in 256-column blocks) and, with many variants, across them (1–2 slots per warp, the base
// of the warp's K range split among the warps that share it). Each warp streams its loads straight
// into registers, a batch of them in flight before the first is used; partial sums meet in shared
// memory. W_eff is not formed, except in the one-variant form (DecodeOptions::form_weights). (A
// shared-memory pipeline, with per-thread cp.async or with bulk copies, was measured slower:
// bench/cuda/NOTES.md.)
//
// Arithmetic, on the tensor cores:
//   base   bf16 mma.m16n8k16, W rows × x rows, f32 accumulation;
//   delta  1-bit mma.m16n8k256 with AND + popcount: A = the sign bits as stored (16 rows × 256
//          columns per warp and block, no expansion), B = 8 bit-planes of one row of x, quantized
//          per 256-column block to 16-bit integers q = round(x/scale) (scale = max|x|/32767 over
//          the block). With plane weights w_p = 2^p (w_15 = −2^15), Σ s·q = 2·Σ_p w_p·popc(s ∧ plane_p)
//          − Σq, exact in integers; per block it is scaled to float and summed. The only rounding
//          beyond the base's is x's quantization: |x − scale·q| ≤ max|x|/65534 over the block.
//          A slot is one variant and one row of x, or, when rows of a variant share a group of 4
//          rows, that group (its sign loads shared).
//
// Sign bits on the device are in a packed layout (packed_signs.h), not the file's: the 1-bit mma's A
// fragments in order, 512 bytes per 16 rows × 256 columns, one 16-byte load per lane.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "bitdelta/delta_ref.h"
#include "packed_signs.h"

namespace bitdelta::cuda {

// Two kernels compute it, one of them on two grids (bench/cuda/NOTES.md has their measurements):
//   kRegisters  any GPU: each warp streams W and the signs straight into registers, on a grid of
//               whole 16-row tiles per block (k_split warps per tile);
//   kBalanced   one row of x (the default there; other row counts as kAuto): the same arithmetic on
//               a grid that gives every multiprocessor the same bytes: 2 blocks per multiprocessor
//               taking equal ranges of (16-row tile, 256-column block) units, whole tiles where that
//               is within 5% of even, else a tile cut between two blocks and summed through memory;
//               with a delta each block quantizes x itself (no quantizing launch before it);
//   kStream     sm_90a (fused_linear_stream.cuh): a TMA producer streams 64-row tiles of W, the
//               variants' sign tiles and x into a shared-memory ring; the base on wgmma, the delta on
//               the 1-bit mma, persistent blocks. Needs K a multiple of 8 and
//               16-byte aligned W and x; otherwise the register kernel runs (for one row, kBalanced).
enum class DecodeKernel { kAuto, kRegisters, kStream, kBalanced };

constexpr int kMaxDecodeRows = 32;      // rows of x per call
constexpr int kRegisterKernelRows = 16;  // rows of x per launch of the register kernel (more: several)

struct DecodeOptions {
  // kRegisters: warps that share one 16-row tile along K (1, 2, 4 or 8); with delta_only, the delta
  // terms kernel's warps along K per set of row groups (2, 4 or 8); 0 = choose (tests and benchmarks
  // set it). (Not used by the other kernels.)
  int k_split = 0;
  // kRegisters' slots: 0 = choose; 1 = one per row of x; 4 = one per variant and group of 4 rows
  // (when at most 8).
  int rows_per_slot = 0;
  DecodeKernel kernel = DecodeKernel::kAuto;
  int stages = 0;  // kStream: ring stages (0 = as many as fit one block per multiprocessor)
  // x already quantized by quantize_x (these rows, this K; device memory; with delta_only, in pairs),
  // or null: kStream and kBalanced quantize it in their blocks, the register kernel and delta_only
  // after a launch that does. (Ignored where the register kernel takes more than 16 rows in two
  // launches.)
  const uint8_t* xq = nullptr;
  // kStream: its grid's blocks on equal ranges of (64-row tile, 256-column block) units, at most the
  // tiles or twice them (a tile is cut between at most two blocks); 0 = choose (tests and benchmarks
  // set it).
  int blocks = 0;
  // Every row of one variant: W_eff = W + α·S formed from W's loads, rounded to bf16 as the fused
  // prefill GEMM does (its bound applies), all rows in one launch. kAuto: in the streaming kernel's
  // stages where it runs (StreamArgs::form_weights), else in the register kernel's registers (any
  // GPU); kStream or kRegisters: that one. Refused where rows differ or row 0 has no delta.
  bool form_weights = false;
  // y += the rows' delta terms alone, α ⊙ (x·Sᵀ): W is not read and rows without a delta add nothing
  // (delta_terms.cuh: all the rows in one launch, each variant's bits read once, after x's
  // quantization unless xq passes it). For a base computed apart, in one launch that reads W once
  // for all the rows (the route of 3 to 32 rows of several variants: device_model.cu). Takes no
  // kernel and no form_weights.
  bool delta_only = false;
  // With delta_only (refused without it): y's rows with a delta get the terms alone (y not read), the
  // others are left as they are (DeltaTermsBeside: its buffer needs no zeroing before).
  bool delta_store = false;
};

// w: [N, K] bf16 row-major; x: [rows, K] bf16; y: [rows, N] f32; all device pointers. deltas[r]
// (host array of device pointers, signs in the packed layout) is row r's variant; rows with the
// same signs pointer share one read of its bits.
void fused_linear_decode(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows,
                         std::span<const DeltaRef> deltas, float* y, cudaStream_t stream,
                         const DecodeOptions& options = {});

// The rows of x quantized for the delta term, as the kernels read them: quantized_x_bytes(rows, K)
// bytes at xq (device memory, 16-byte aligned). fused_linear_decode does this itself unless
// DecodeOptions::xq passes its result.
size_t quantized_x_bytes(int rows, int K);
// pairs: the scale of each pair of neighbouring 256-column blocks shared (the maximum over 512
// columns): the form DecodeOptions::delta_only takes (delta_terms.cuh), and only it.
void quantize_x(const __nv_bfloat16* x, int rows, int K, uint8_t* xq, cudaStream_t stream, bool pairs = false);
// One row quantized the way kBalanced does it, in one block's shared memory, copied out in
// quantize_x's layout: the same bytes (tests compare them).
void quantize_x_in_block(const __nv_bfloat16* x, int K, uint8_t* xq, cudaStream_t stream);

// The k_split that the register kernel chooses for N output rows and `rows` rows of x (before slot
// groups take warps).
int decode_default_k_split(int N, int rows);
// The k_split of the register kernel's W_eff form (DecodeOptions::form_weights) for N output rows.
int weff_default_k_split(int N);

// The packed sign layout (packed_signs.h) of an [N, K] delta: bytes, and the conversion from the
// file's layout ([N, ceil(K/8)] bytes, LSB first), on the GPU. Both pointers on the device; packed is
// 16-byte aligned.
size_t packed_signs_bytes(int N, int K);
void pack_signs(const uint8_t* raw, int N, int K, uint8_t* packed, cudaStream_t stream);

}  // namespace bitdelta::cuda
