// The fused BitDelta linear on the CPU: y = x·W_baseᵀ + α ⊙ (x·Sᵀ), rows tagged with their variant.
// The base weight is read once per call for all rows; each distinct variant's sign bits once per
// output row; W_eff is never formed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "bitdelta/delta_ref.h"
#include "bitdelta/tensor.h"
#include "bitdelta/thread_pool.h"

namespace bitdelta::cpu {

// x: [rows, K] floats; y: [rows, N]; w: [N, K] in BF16, F16 or F32; deltas[r] is row r's delta
// (signs == nullptr: the base alone); bias: optional [N]. Few rows go through SIMD GEMV tiles
// (AVX2 when the CPU has it, else plain loops; simd = false forces the plain loops, for tests),
// many rows through blocked GEMMs.
void fused_linear(const TensorView& w, std::span<const float> x, size_t rows, std::span<const DeltaRef> deltas,
                  const float* bias, std::span<float> y, ThreadPool& pool, bool simd = true);

// The plain reference, for tests only: materializes W_eff in float32 per row, then multiplies
// in float64.
void fused_linear_reference(const TensorView& w, std::span<const float> x, size_t rows,
                            std::span<const DeltaRef> deltas, const float* bias, std::span<float> y);

}  // namespace bitdelta::cpu
