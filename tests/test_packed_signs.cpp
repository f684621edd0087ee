// The packed sign layout of the CUDA kernels (src/backend/cuda/packed_signs.h), on the host: these
// functions run on the GPU, but their bit arithmetic is plain C++, so CI checks it here.
//   - every bit of a packed word is where the layout's definition (written out again below, from the
//     mma fragment order) puts it;
//   - packed_sign_byte, which the prefill kernel uses, gives back the file's bytes;
//   - bit_planes32, with which the one-row decode kernel makes x's bit-planes, puts bit p of value i
//     at bit i of word p;
// on random bits and on shapes with N and K not multiples of 16 and 256 (bits past them are zero).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "backend/cuda/packed_signs.h"

namespace {

using bitdelta::cuda::bit_planes32;
using bitdelta::cuda::packed_sign_byte;
using bitdelta::cuda::packed_sign_word;
using bitdelta::cuda::packed_sign_words;

struct Packed {
  int N, K, KB;
  std::vector<uint8_t> raw;
  std::vector<uint32_t> words;
};

Packed make(int N, int K, uint32_t seed) {
  Packed p{N, K, (K + 255) / 256, {}, {}};
  const int row_bytes = (K + 7) / 8;
  std::mt19937 rng(seed);
  p.raw.resize(size_t(N) * row_bytes);
  for (int n = 0; n < N; ++n)
    for (int b = 0; b < row_bytes; ++b) {
      uint8_t byte = uint8_t(rng());
      if (8 * b + 8 > K) byte &= uint8_t((1u << (K - 8 * b)) - 1);  // the file's padding bits are 0
      p.raw[size_t(n) * row_bytes + b] = byte;
    }
  p.words.resize(packed_sign_words(N, K));
  for (size_t i = 0; i < p.words.size(); ++i)
    p.words[i] = packed_sign_word(p.raw.data(), N, K, int(i / 128 / p.KB), int(i / 128 % p.KB), int(i / 4 % 32),
                                  int(i % 4));
  return p;
}

bool raw_bit(const Packed& p, int n, int k) {
  return n < p.N && k < p.K && (p.raw[size_t(n) * ((p.K + 7) / 8) + k / 8] >> (k % 8)) & 1;
}

TEST(PackedSigns, EveryBitWhereTheMmaFragmentWantsIt) {
  for (auto [N, K] : {std::pair{16, 64}, {37, 131}, {100, 1001}, {33, 7}, {64, 4096}, {17, 300}}) {
    const Packed p = make(N, K, uint32_t(N * 7919 + K));
    ASSERT_EQ(p.words.size(), size_t((N + 15) / 16) * size_t(p.KB) * 128);
    // The 1-bit mma.m16n8k256 A fragment of lane 4g + t: register i holds rows g (i even) or g + 8
    // (i odd) and columns 32t..32t+31 (i < 2) or 128 + 32t.. (i ≥ 2) of a 16 × 256 tile, column
    // 32t + e at bit e.
    for (int rg = 0; rg < (N + 15) / 16; ++rg)
      for (int kb = 0; kb < p.KB; ++kb)
        for (int lane = 0; lane < 32; ++lane)
          for (int i = 0; i < 4; ++i) {
            const uint32_t w = p.words[((size_t(rg) * p.KB + kb) * 32 + lane) * 4 + i];
            for (int e = 0; e < 32; ++e) {
              const int row = 16 * rg + lane / 4 + (i % 2 ? 8 : 0);
              const int col = 256 * kb + (i >= 2 ? 128 : 0) + 32 * (lane % 4) + e;
              ASSERT_EQ(bool((w >> e) & 1), raw_bit(p, row, col)) << N << "x" << K << " row " << row << " col " << col;
            }
          }
  }
}

TEST(PackedSigns, ByteReadBackEqualsTheFile) {
  for (auto [N, K] : {std::pair{16, 64}, {37, 131}, {100, 1001}, {33, 7}, {64, 4096}, {17, 300}}) {
    const Packed p = make(N, K, uint32_t(N + 31 * K));
    const int row_bytes = (K + 7) / 8;
    for (int n = 0; n < N; ++n)
      for (int b = 0; b < row_bytes; ++b)
        ASSERT_EQ(packed_sign_byte(p.words.data(), p.KB, n, b), p.raw[size_t(n) * row_bytes + b])
            << N << "x" << K << " row " << n << " byte " << b;
  }
}

TEST(PackedSigns, BitPlanesOfThirtyTwoValues) {
  std::mt19937 rng(2026);
  for (int trial = 0; trial < 2000; ++trial) {
    int16_t q[32];
    for (auto& v : q) {
      // Random values, and the extremes and small values the quantization gives most often.
      const uint32_t u = rng();
      v = trial % 4 == 0 ? int16_t(u % 2 ? 32767 : -32767) : trial % 4 == 1 ? int16_t(int(u % 7) - 3) : int16_t(u);
    }
    uint32_t r[16];
    for (int k = 0; k < 16; ++k) r[k] = uint32_t(uint16_t(q[k])) | (uint32_t(uint16_t(q[k + 16])) << 16);
    bit_planes32(r);
    for (int p = 0; p < 16; ++p)
      for (int i = 0; i < 32; ++i)
        ASSERT_EQ((r[p] >> i) & 1, (uint32_t(uint16_t(q[i])) >> p) & 1) << "trial " << trial << " plane " << p
                                                                         << " value " << i;
  }
}

}  // namespace
