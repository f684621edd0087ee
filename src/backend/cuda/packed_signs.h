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

// Bytes of (a, b) picked by the selector's nibbles (byte i of the result: byte s_i of b:a), as
// CUDA's __byte_perm (PRMT) without its sign-extension mode.
BITDELTA_HOST_DEVICE uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, s);
#else
  const uint64_t ab = uint64_t(b) << 32 | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((ab >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
#endif
}

// The bit-planes of 32 16-bit integers (x's quantized values, delta_b1.cuh): on entry r[k] holds
// q_k in its low half and q_{k+16} in its high half (k < 16); on return r[p] holds bit p of q_i at
// bit i (p < 16, i < 32): the words a lane's 1-bit mma B fragment takes. This is a 32 × 32 bit
// transpose (Hacker's Delight's, least significant bit first) of the words q_0..q_31 whose first step
// (16-bit halves of words k and k + 16 exchanged) is the packing on entry: the q have no high bits,
// so words 16..31 are zero after it and stay zero. The next step exchanges whole bytes: two byte
// permutes per pair of words; the last three, 8 exchanges of 5 instructions each.
BITDELTA_HOST_DEVICE void bit_planes32(uint32_t (&r)[16]) {
  for (int k = 0; k < 8; ++k) {
    const uint32_t a = r[k], b = r[k + 8];
    r[k] = byte_perm(a, b, 0x6240);      // bytes a0 b0 a2 b2
    r[k + 8] = byte_perm(a, b, 0x7351);  // bytes a1 b1 a3 b3
  }
  const auto step = [&](int j, uint32_t m) {
    for (int k = 0; k < 16; ++k)
      if (!(k & j)) {
        const uint32_t t = ((r[k] >> j) ^ r[k + j]) & m;
        r[k + j] ^= t;
        r[k] ^= t << j;
      }
  };
  step(4, 0x0F0F0F0Fu);
  step(2, 0x33333333u);
  step(1, 0x55555555u);
}

}  // namespace bitdelta::cuda
