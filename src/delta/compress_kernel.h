// Row kernels of the compressor: one pass over a row computes the sign bits of Δ = ft − base and
// the float64 sums Σ|Δ| and ΣΔ² (the latter gives the approximation error in closed form).
#pragma once

#include <cstddef>
#include <cstdint>

namespace bitdelta {

struct RowSums {
  double abs = 0;  // Σ|Δ|
  double sq = 0;   // ΣΔ²
};

// signs receives ceil(n/8) bytes, LSB first, bit = (Δ >= 0), padding bits 0.
// Dispatches at run time to the widest SIMD the CPU has.
RowSums compress_row(const float* base, const float* ft, size_t n, uint8_t* signs);
// The plain version, for tests and CPUs without AVX-512.
RowSums compress_row_scalar(const float* base, const float* ft, size_t n, uint8_t* signs);

}  // namespace bitdelta
