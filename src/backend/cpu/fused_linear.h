// The fused BitDelta linear on the CPU: y = x·W_baseᵀ + α ⊙ (x·Sᵀ), rows tagged with their variant.
// The base weight is read once per call for all rows; each distinct variant's sign bits once per
// output row; W_eff is never formed.
//
// x·Sᵀ goes through lookup tables over x: for every 3 columns, the 8 sums ±x₀ ± x₁ ± x₂ in float32;
// a delta row's 3 sign bits pick one of them. The signs are repacked once (pack_signs) so that one
// 32-bit lane holds 30 columns of one output row and a vector holds 8 output rows (16 with
// AVX-512: two row blocks): one vpermps then looks up 8 (16) rows × 3 columns. Per 8 weights and delta row that is one lookup, one shift and
// one add, a quarter of forming W_eff in registers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string_view>

#include "bitdelta/delta_ref.h"
#include "bitdelta/tensor.h"
#include "bitdelta/thread_pool.h"

namespace bitdelta::cpu {

// The packed sign layout: output rows in blocks of 8, columns in chunks of 30. Word (b·C + c)·8 + r
// (C = ceil(K/30) chunks) holds row 8b + r, columns 30c .. 30c+29 at bits 0..29 (1 = +α, as in the
// file); bits past K, rows past N and bits 30, 31 are 0.
constexpr size_t kSignChunk = 30, kSignRowBlock = 8;
inline size_t sign_chunks(size_t K) { return (K + kSignChunk - 1) / kSignChunk; }
inline size_t packed_sign_words(size_t N, size_t K) {
  return (N + kSignRowBlock - 1) / kSignRowBlock * sign_chunks(K) * kSignRowBlock;
}
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using PackedSigns = std::unique_ptr<uint32_t[], FreeDeleter>;  // 64-byte aligned
// Repacks a delta's signs from the file's layout ([N, ceil(K/8)], LSB first).
PackedSigns pack_signs(const uint8_t* file_signs, size_t N, size_t K);

// The instruction sets of the kernels, in order. avx2 also needs FMA and F16C; avx512 needs
// AVX-512 F, BW and VL (16 lanes, 32 registers) besides.
enum class Isa { scalar, avx2, avx512 };
bool cpu_has(Isa isa);  // whether this CPU runs it
const char* isa_name(Isa isa);
Isa parse_isa(std::string_view name);  // "scalar", "avx2", "avx512"; anything else fails
// The widest set this CPU has, capped by the environment variable BITDELTA_CPU_ISA when set (for
// side-by-side measurements: BITDELTA_CPU_ISA=avx2 on an AVX-512 machine).
Isa best_isa();

// x: [rows, K] floats; y: [rows, N]; w: [N, K] in BF16, F16 or F32; deltas[r] is row r's delta
// (packed == nullptr: the base alone; `signs` is not read here); bias: optional [N]. Few rows go
// through SIMD GEMV tiles of the given instruction set (plain loops for Isa::scalar), many rows
// through blocked GEMMs. An instruction set this CPU lacks fails.
void fused_linear(const TensorView& w, std::span<const float> x, size_t rows, std::span<const DeltaRef> deltas,
                  const float* bias, std::span<float> y, ThreadPool& pool, Isa isa = best_isa());

// The plain reference, for tests only: materializes W_eff in float32 per row from the file-layout
// `signs` (not `packed`), then multiplies in float64.
void fused_linear_reference(const TensorView& w, std::span<const float> x, size_t rows,
                            std::span<const DeltaRef> deltas, const float* bias, std::span<float> y);

}  // namespace bitdelta::cpu
