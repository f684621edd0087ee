// The BitDelta linear for prefill: many rows of one variant. Compute-bound (2·rows·N·K flops).
// Methods, chosen by measurement (bench/RESULTS.md, bench/cuda/NOTES.md):
//   kBaseOnly     cuBLAS on the base alone (the baseline, no delta)
//   kTwoGemms     Y = X·Wᵀ, then Y += X·(α⊙S)ᵀ with α⊙S expanded to bf16 chunk by chunk (twice the
//                 flops)
//   kMaterialize  per chunk of output rows: W_eff = bf16(W + α⊙S) into scratch, then one cuBLAS
//                 GEMM on it
//   kPipelined    kMaterialize with the expansion of chunk i+1 on a second stream, overlapping the
//                 (compute-bound) GEMM of chunk i; two scratch buffers
//   kFused        one kernel (sm_90a, wgmma): W_eff = W + α⊙S formed in registers per tile on its
//                 way to the tensor cores, never in memory; W_eff rounded to bf16 as bf16(w ± bf16(α)).
//                 The engine's method. Needs K a multiple of 64 (at least 128) and 16-byte
//                 aligned W, x and signs. On other GPUs it runs kFusedMma up to
//                 kPortableFusedRows rows of x, kMaterialize past them (and where neither fused
//                 kernel takes the operands).
//                 Without a delta it runs the same kernel on W alone (the benchmark's measure of the expansion's
//                 cost).
//   kFusedMma     the portable fused GEMM (fused_gemm_mma.cuh: mma.sync, W_eff formed in shared memory;
//                 any GPU of compute capability 8.0 or later), on any GPU; K a multiple of 64 and
//                 16-byte aligned W, x and signs, else kMaterialize.
// Signs are in the packed device layout (packed_signs.h). W_eff is rounded to bf16 (≤ 2⁻⁹ relative
// per weight).
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "bitdelta/delta_ref.h"

namespace bitdelta::cuda {

enum class PrefillMethod { kBaseOnly, kTwoGemms, kMaterialize, kPipelined, kFused, kFusedMma };

// Where the sm_90a GEMM does not run, kFused takes the portable one up to this many rows of x and
// materializes W_eff past them. Chosen by the 7B shape's TTFT per variant on the compute_80 build
// (run 294, the H200; the portable GEMM with its split-K merge batched and its tile and split from
// mma_gemm_choose's model): 200-token prompts 15.9 ms with it against 20.3 materializing, 256-token
// 16.0 against 20.8 (run 294), 384-token 23.2 against 24.9 (run 295). Per linear (run 293, the engine's q|k|v, gate|up, o and down), against
// materialize: 0.46–0.61× its time at 33–64 rows, 0.64–0.78× at 96–128, 0.92–1.06× at 192 and
// 1.00–1.20× at 256 (the engine materializes in chunks of 16 Mi elements, more launches than the
// benchmark). At 512 rows it took 1.43–1.71× materialize's time (cuBLAS's wgmma on W_eff; on 8.x GPUs,
// whose tensor cores mma.sync drives at their full rate, the balance may differ; not measured).
constexpr int kPortableFusedRows = 384;

// How the fused GEMM spreads its tiles over thread blocks:
//   kTilePerBlock  one block per tile (a last, partial wave leaves multiprocessors idle)
//   kPersistent    whole tiles, one block per multiprocessor taking one tile after another: the
//                  next tile's first stages load while the last one's sums are written
//   kStreamK       one block per multiprocessor; the tiles of the last one or two waves spread over
//                  all of them by stages (stream-K), split tiles' sums meeting in memory (per-stream
//                  scratch of two tiles of float32 per block: 34.6 MB for 128 × 256 tiles on 132 SMs)
enum class FusedSplit { kTilePerBlock, kPersistent, kStreamK };

// W_eff chunk: out[n][k] = bf16(W[n][k] + α[n]·s[n][k]) for n in [n0, n0 + rows), or
// bf16(α[n]·s[n][k]) alone when with_base is false. out is [rows, K] row-major; device pointers.
// max_blocks > 0 caps the grid (256 threads per block) so that the expansion leaves multiprocessors
// to a concurrent GEMM.
void expand_delta(const __nv_bfloat16* w, int K, const DeltaRef& delta, int n0, int rows,
                  bool with_base, __nv_bfloat16* out, cudaStream_t stream, int max_blocks = 0);

// Owns the cuBLAS handle, the scratch chunks and the helper stream; one per device stream.
class PrefillLinear {
 public:
  // scratch_rows_per_chunk × max K bf16 per scratch buffer (two buffers).
  PrefillLinear(cudaStream_t stream, size_t scratch_elems);
  ~PrefillLinear();
  PrefillLinear(const PrefillLinear&) = delete;
  PrefillLinear& operator=(const PrefillLinear&) = delete;

  // y[rows, N] f32 = x[rows, K] · W_effᵀ (device pointers); chunk_rows output rows per scratch
  // chunk (0: as many as the scratch holds); expand_blocks caps the pipelined expansion's grid (0:
  // none).
  void run(PrefillMethod method, const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x,
           int rows, const DeltaRef& delta, float* y, int chunk_rows = 0, int expand_blocks = 0);

  cublasHandle_t handle() const { return handle_; }
  // The fused kernel's tile, bm output rows × bn rows of x: 64 × 64, 128 × 128, 64 × 256,
  // 128 × 176 or 128 × 256, and how tiles are spread over blocks (FusedSplit). bm = 0 (the default)
  // chooses both: 64 × 64 up to 64 rows, 128 × 128 up to 128, beyond that 128 × 256 where those
  // tiles fill at least 90% of the multiprocessors (128 × 176 where 128 × 256 makes less than two
  // waves, and 176's whole tiles waste less than 10% and less than 256's), else 64 × 256; whole
  // tiles on persistent blocks where the tiles make whole waves (the last at least 90% full), else
  // stream-K.
  // mma_bn, mma_stages, mma_k_split: the portable kernel's (MmaGemmConfig); 0: chosen by the shape.
  struct FusedConfig {
    int bm = 0, bn = 0;
    FusedSplit split = FusedSplit::kStreamK;
    int mma_bn = 0, mma_stages = 0, mma_k_split = 0;
  };
  void set_fused_config(FusedConfig c) { fused_config_ = c; }
  // Whether this device runs the sm_90a fused kernel, and whether it does for these operands (else
  // kFused runs the portable one, or kMaterialize where that does not take them either).
  bool fused_available() const { return fused_arch_; }
  bool fused_gemm_supported(const __nv_bfloat16* w, int K, const __nv_bfloat16* x) const;

 private:
  void gemm(const __nv_bfloat16* w_rows, int n_rows, int K, const __nv_bfloat16* x, int rows,
            float* y, int ldy, float beta);
  void fused_gemm(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows,
                  const DeltaRef& delta, float* y);
  void fused_gemm_mma(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows,
                      const DeltaRef& delta, float* y);

  cudaStream_t stream_;
  cudaStream_t helper_ = nullptr;
  bool fused_arch_ = false;  // the device runs the sm_90a fused GEMM
  FusedConfig fused_config_;
  int sms_ = 0;
  int smem_optin_ = 0;  // shared memory a block may take on this device (the portable kernel's tiles)
  cublasHandle_t handle_ = nullptr;
  size_t scratch_elems_;
  __nv_bfloat16* scratch_[2] = {nullptr, nullptr};
  cudaEvent_t expanded_[2] = {nullptr, nullptr}, consumed_[2] = {nullptr, nullptr};
};

}  // namespace bitdelta::cuda
