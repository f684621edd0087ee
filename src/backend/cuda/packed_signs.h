// The packed sign layout that the CUDA kernels read (fused_linear_decode.cuh), as plain functions that
// compile for the host and the device: the GPU packs a delta's bits with packed_sign_word after the
// upload, the materialize kernel of prefill reads them back with packed_sign_byte, and a host test
// (tests/test_packed_signs.cpp, run in CI) checks both against the layout's definition.
//
// The layout is the A operand of the 1-bit mma.m16n8k256 in fragment order. Per 16 rows × 256
// columns (row group rg, column block kb; KB = ceil(K/256) blocks per row group) there are 128
// words, 4 per lane ℓ = 4·g + t of a warp: word ((rg·KB + kb)·32 + ℓ)·4 + i holds, at bit e, the
// sign of row 16·rg + g + 8·(i & 1), column 256·kb + 128·(i >> 1) + 32·t + e — lane ℓ's A register
// i. A warp reads a whole block with one 16-byte load per lane. Bits past N or K are zero.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define BITDELTA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define BITDELTA_HOST_DEVICE inline
#endif

namespace bitdelta::cuda {

constexpr int kSignBlockCols = 256;  // columns per packed block (the b1 mma's k)

BITDELTA_HOST_DEVICE int sign_blocks(int K) { return (K + kSignBlockCols - 1) / kSignBlockCols; }

BITDELTA_HOST_DEVICE size_t packed_sign_words(int N, int K) {
  return size_t((N + 15) / 16) * size_t(sign_blocks(K)) * 128;
}

// Word i of lane `lane` in block (rg, kb), from the file's layout (raw: [N, ceil(K/8)] bytes, LSB
// first): 32 columns of one row, 4 whole bytes of the file where K allows.
BITDELTA_HOST_DEVICE uint32_t packed_sign_word(const uint8_t* raw, int N, int K, int rg, int kb, int lane, int i) {
  const int g = lane >> 2, t = lane & 3, row = 16 * rg + g + 8 * (i & 1), row_bytes = (K + 7) / 8;
  const int k = kSignBlockCols * kb + 128 * (i >> 1) + 32 * t;
  if (row >= N || k >= K) return 0;
  uint32_t w = 0;
  for (int b = 0; b < 4 && k / 8 + b < row_bytes; ++b) w |= uint32_t(raw[size_t(row) * row_bytes + k / 8 + b]) << (8 * b);
  if (K - k < 32) w &= (1u << (K - k)) - 1u;
  return w;
}

// The 8 sign bits of columns [8·k8, 8·k8 + 8) of row n (bit i: column 8·k8 + i).
BITDELTA_HOST_DEVICE uint32_t packed_sign_byte(const uint32_t* packed, int KB, int n, int k8) {
  const int kb = k8 >> 5, c = (k8 & 31) * 8, t = (c & 127) >> 5, r = n & 15;
  const int i = (r >> 3) | ((c >> 7) << 1);
  const uint32_t w = packed[((size_t(n >> 4) * KB + kb) * 32 + 4 * (r & 7) + t) * 4 + i];
  return (w >> (c & 31)) & 0xFFu;
}

}  // namespace bitdelta::cuda
