// The packed sign layout that the CUDA kernels read (fused_linear_decode.cuh), as plain functions that
// compile for the host and the device: the GPU packs a delta's bits with packed_sign_word after the
// upload, the materialize kernel of prefill reads them back with packed_sign_byte, and a host test
// (tests/test_packed_signs.cpp, run in CI) checks both against the layout's definition.
//
// Per 16 rows × 64 columns (row group rg, column block kc; KC = ceil(K/64) blocks per row group) there
// are 32 words, one per lane ℓ = 4·g + t of a warp. Bit 8·e + j of word ((rg·KC + kc)·32 + ℓ), with
// j = 4·m + i, holds the sign bit of row 16·rg + g + 8·(i & 1), column 64·kc + 32·m + 16·(i >> 1) +
// 4·t + e: the bytes of (word >> j) & 0x01010101 are then lane ℓ's A fragment register i of the int8
// mma.m16n8k32 for columns 32·m.. of the block. Bits past N or K are zero.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define BITDELTA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define BITDELTA_HOST_DEVICE inline
#endif

namespace bitdelta::cuda {

BITDELTA_HOST_DEVICE size_t packed_sign_words(int N, int K) {
  return size_t((N + 15) / 16) * size_t((K + 63) / 64) * 32;
}

// Word `lane` of block (rg, kc), from the file's layout (raw: [N, ceil(K/8)] bytes, LSB first).
BITDELTA_HOST_DEVICE uint32_t packed_sign_word(const uint8_t* raw, int N, int K, int rg, int kc, int lane) {
  const int g = lane >> 2, t = lane & 3, row_bytes = (K + 7) / 8;
  uint32_t w = 0;
  for (int j = 0; j < 8; ++j) {
    const int m = j >> 2, i = j & 3, row = 16 * rg + g + 8 * (i & 1);
    const int k = 64 * kc + 32 * m + 16 * (i >> 1) + 4 * t;  // 4 columns in one byte
    if (row >= N || k >= K) continue;
    uint32_t nib = (uint32_t(raw[size_t(row) * row_bytes + k / 8]) >> (k % 8)) & 0xFu;
    if (K - k < 4) nib &= (1u << (K - k)) - 1u;
    // Bit e of the nibble → bit 8e + j.
    w |= ((nib & 1u) | (nib & 2u) << 7 | (nib & 4u) << 14 | (nib & 8u) << 21) << j;
  }
  return w;
}

// The 8 sign bits of columns [8·k8, 8·k8 + 8) of row n (bit i: column 8·k8 + i).
BITDELTA_HOST_DEVICE uint32_t packed_sign_byte(const uint32_t* packed, int KC, int n, int k8) {
  const int kc = k8 >> 3, c = k8 & 7, m = c >> 2, ih = (c >> 1) & 1, t0 = (c & 1) * 2;
  const int r = n & 15, g = r & 7, j = 4 * m + ((r >> 3) | (ih << 1));
  const uint32_t* w = packed + (size_t(n >> 4) * KC + kc) * 32 + 4 * g + t0;
  // Bytes of ((w >> j) & 0x01010101) are the bits of 4 columns; the multiply gathers them.
  const uint32_t lo = ((((w[0] >> j) & 0x01010101u) * 0x01020408u) >> 24) & 0xFu;
  const uint32_t hi = ((((w[1] >> j) & 0x01010101u) * 0x01020408u) >> 24) & 0xFu;
  return lo | (hi << 4);
}

}  // namespace bitdelta::cuda
