// The portable fused prefill GEMM: y[rows, N] f32 = x[rows, K] · W_effᵀ with W_eff = W + α⊙S formed
// in registers, stage by stage, on its way to the tensor cores (mma.sync, bf16 in, f32
// accumulation). It runs on every GPU this build runs on (compute capability 8.0 and later): where
// the sm_90a fused GEMM (wgmma, fused_linear_prefill.cu) does not, PrefillLinear's kFused runs this
// one instead of materializing W_eff. W_eff rounds as everywhere else: bf16(W + bf16(α)·s) (weff.cuh).
//
// Tiles of 128 output rows × BN rows of x (64 or 128), 64 columns per stage, 8 warps of 32 × BN/2.
// Each stage's W, x and sign words come in by cp.async into a ring of `stages` slots; each warp
// loads its A fragments of W with ldmatrix and adds ±α from the stage's sign words in registers
// (as the sm_90a GEMM does) before the mma. Few rows of x make few tiles: then K is split over
// blocks, whose sums meet in scratch in a fixed order. Needs K a multiple of 64 and 16-byte aligned
// W, x and signs (mma_gemm_supported).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "bitdelta/delta_ref.h"

namespace bitdelta::cuda {

// bn: rows of x per tile, 64 or 128; stages: slots in the ring, 3 or 4; k_split: blocks per tile
// along K (1 to K/64).
struct MmaGemmConfig {
  int bn = 128, stages = 3, k_split = 1;
};
// Shared memory a configuration takes per block (the device's opt-in limit must hold it: 128 × 3
// takes 102 KiB, more than 8.6 and 8.9 GPUs allow a block).
int mma_gemm_smem(MmaGemmConfig config);
// The tile of x's rows (64 or 128, where the device's shared memory per block allows) and the K split
// with the least modelled time over `sms` multiprocessors (waves of blocks × stages per block); 3
// stages.
MmaGemmConfig mma_gemm_choose(int N, int K, int rows, int smem_optin, int sms);

bool mma_gemm_supported(const __nv_bfloat16* w, int K, const __nv_bfloat16* x, const DeltaRef& delta);

// Without a delta (delta.signs null) the same kernel on W alone: the benchmark's measure of what the
// expansion costs.
void mma_gemm(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows, const DeltaRef& delta,
              float* y, cudaStream_t stream, MmaGemmConfig config);

// Lets the kernels take their shared memory on the current device (once per device, before the first
// launch), those that fit; returns the device's opt-in shared memory per block.
int mma_gemm_prepare();

}  // namespace bitdelta::cuda
