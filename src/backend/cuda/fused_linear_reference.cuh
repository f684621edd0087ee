// The plain CUDA reference of the fused BitDelta linear, for tests only (llm.c style: the simple
// version beside the fast one). One thread per output: W_eff[n][k] = W[n][k] + α·(±1) in float32
// per element, dotted with the row of x in float64.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <span>

#include "bitdelta/delta_ref.h"

namespace bitdelta::cuda {

// w: [N, K] bf16, x: [rows, K] bf16, y: [rows, N] f32, all device pointers; deltas[r] holds device
// pointers to row r's variant (signs in the file's layout, not packed: an independent reading of
// the bits; signs == nullptr: the base alone). At most 16 rows per call.
void fused_linear_reference(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows,
                            std::span<const DeltaRef> deltas, float* y, cudaStream_t stream);

}  // namespace bitdelta::cuda
