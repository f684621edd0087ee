// The delta term on the 1-bit tensor cores, shared by the decode kernels (fused_linear_decode.cuh
// describes the arithmetic): per 16 output rows, 256 columns and one row of x, two
// mma.m16n8k256.and.popc of the sign bits (A) against x's 16 bit-planes (B), weighted per plane.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "packed_signs.h"

namespace bitdelta::cuda {

constexpr int kQMax = 32767;  // x quantized to 16-bit integers per row and 256-column block

// D = A·B over 256 one-bit products per output: popc(a ∧ b), A 16 × 256 (the signs), B 256 × 8 (the
// bit-planes of x), D fresh (C = 0).
__device__ __forceinline__ void mma_b1(int (&d)[4], const uint4& a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%10,%10,%10};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1), "r"(0));
}

// D += A·B: the same with C = D (popcounts of two blocks of 256 columns summed in the accumulator).
__device__ __forceinline__ void mma_b1_add(int (&d)[4], const uint4& a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

// The weights of lane t's bit-planes: 2t, 2t+1 (the first mma's D columns) and 2t+8, 2t+9 (the
// second's); q = Σ w_p·bit_p with w_15 = −2^15 (two's complement).
__device__ __forceinline__ void plane_weights(int t, int (&pw)[4]) {
  const int w0 = 1 << (2 * t), w8 = w0 << 8;
  pw[0] = w0, pw[1] = 2 * w0, pw[2] = w8, pw[3] = t == 3 ? -(1 << 15) : w8 << 1;
}

// One slot row and block of 256 columns: planes 0–7 and 8–15 of the row (b) against the tile's
// 16 × 256 sign bits (a); this lane's popcounts weighted by its planes' weights, times the block's
// scale, added to its parts of tile rows gid and gid + 8 (Σq is subtracted after the loop).
__device__ __forceinline__ void delta_block(const uint4& a, const uint4& b, float scale, const int (&pw)[4],
                                            float (&acc)[2]) {
  int lo[4], hi[4];
  mma_b1(lo, a, b.x, b.y);
  mma_b1(hi, a, b.z, b.w);
  acc[0] += scale * float(pw[0] * lo[0] + pw[1] * lo[1] + pw[2] * hi[0] + pw[3] * hi[1]);
  acc[1] += scale * float(pw[0] * lo[2] + pw[1] * lo[3] + pw[2] * hi[2] + pw[3] * hi[3]);
}

// delta_block with lane t's common plane weight 2^(2t) left out, for a caller that multiplies its
// sums by it once at the end (plane_shift): the weights relative to it are 1, 2, 2^8 and ±2^9 (the
// sign for t = 3, plane 15), so the weighted sum is (lo₀ + 2·lo₁) + 2^8·(hi₀ + s·hi₁), s = ±2 (sign2),
// three integer operations per output where the full weights took four. The factor being a power of
// two, the sums are the same floats (unless subnormal). The streaming kernel uses it (runs 209-210),
// and the delta-terms kernel in its pair form below (run 309, single blocks: 4.5-7% less time for 32
// rows of 14 variants); the register kernel still takes delta_block, being bound by its reads of W
// at one row: moving it is unmeasured.
__device__ __forceinline__ int sign2(int t) { return t == 3 ? -2 : 2; }
__device__ __forceinline__ float plane_shift(int t) { return float(1 << (2 * t)); }
__device__ __forceinline__ void delta_block_unshifted(const uint4& a, const uint4& b, float scale, int s2,
                                                      float (&acc)[2]) {
  int lo[4], hi[4];
  mma_b1(lo, a, b.x, b.y);
  mma_b1(hi, a, b.z, b.w);
  acc[0] += scale * float((lo[0] + 2 * lo[1]) + ((hi[0] + s2 * hi[1]) << 8));
  acc[1] += scale * float((lo[2] + 2 * lo[3]) + ((hi[2] + s2 * hi[3]) << 8));
}

// delta_block_unshifted over two neighbouring blocks of 256 columns that share x's scale (x quantized
// in pairs of blocks: quantize_item's pair_group): their popcounts add in the mma's accumulator, so the
// weighting, the conversion and the multiply-add happen once for both. a1 and b1 are the second
// block's (b1 zero where the pair has one block: it adds nothing). |sum| < 2^19: exact in the float.
__device__ __forceinline__ void delta_pair_unshifted(const uint4& a0, const uint4& b0, const uint4& a1, const uint4& b1,
                                                     float scale, int s2, float (&acc)[2]) {
  int lo[4], hi[4];
  mma_b1(lo, a0, b0.x, b0.y);
  mma_b1(hi, a0, b0.z, b0.w);
  mma_b1_add(lo, a1, b1.x, b1.y);
  mma_b1_add(hi, a1, b1.z, b1.w);
  acc[0] += scale * float((lo[0] + 2 * lo[1]) + ((hi[0] + s2 * hi[1]) << 8));
  acc[1] += scale * float((lo[2] + 2 * lo[3]) + ((hi[2] + s2 * hi[3]) << 8));
}

// The quantized rows of x that prepare_x writes, per 256-column block: (scale, Σq) of each row as two
// floats (room for 32 rows: 256 bytes), then each row's 32 lanes' B fragments (512 bytes per row).
// A block is contiguous and 16-byte aligned: the streaming kernel copies it with one bulk copy.
constexpr int kQuantizedPlanes = 256;  // offset of the bit-planes in a block
__host__ __device__ __forceinline__ int quantized_x_block(int rows) { return kQuantizedPlanes + rows * 512; }

// x is quantized per row and 256-column block: scale = max |x| / 32767, q = round(x / scale), and the
// 16 bit-planes of q as the lanes' B fragments. Plane p's word j is the bits of q at columns 32j..32j +
// 31; lane (g, t)'s fragment is 4 words: planes g, g + 8 × words t, t + 4.
//
// Every kernel quantizes with quantize_item: a thread takes 32 columns (an item: one word of every
// plane), their maximum is reduced over the 8 threads of the block, and the bit-planes come from an
// in-register transpose (bit_planes32), not from 128 ballots per block.
//
// One row of x quantized by a whole thread block into shared memory (quantize_row_shared): block kb
// at xs + kb·kRowPlaneBytes, the 32 lanes' B fragments (512 bytes, as in quantized_x_block) then
// (scale, Σq). A thread issues the loads of two items before it works on either (K past 8192 gives some
// threads two), so that their latencies overlap. Every thread of the block calls it; the caller
// synchronizes before reading xs.
constexpr int kRowPlaneBytes = 528;  // 512 bytes of fragments, (scale, Σq), padded to 16 bytes

// The 32 columns from c0 as bf16 pairs (zero past K).
__device__ __forceinline__ void load_item(const __nv_bfloat16* x, int K, bool aligned, int c0, uint32_t (&raw)[16]) {
  if (aligned && c0 + 32 <= K) {
    const uint4* src = reinterpret_cast<const uint4*>(x + c0);
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const uint4 u = __ldg(src + v);
      raw[4 * v] = u.x, raw[4 * v + 1] = u.y, raw[4 * v + 2] = u.z, raw[4 * v + 3] = u.w;
    }
  } else {
    const uint16_t* x16 = reinterpret_cast<const uint16_t*>(x);
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      const int a = c0 + 2 * m;
      raw[m] = (a < K ? x16[a] : 0u) | ((a + 1 < K ? uint32_t(x16[a + 1]) : 0u) << 16);
    }
  }
}

// Item j of a 256-column block: its columns 32j.. (raw: load_item's), quantized by the 8 lanes of
// `group` (one per item of the block, lanes 8i..8i + 7 of a warp, all taking part); the words of its
// planes to frag (the block's 32 lanes' fragments: 128 words), and the block's (scale, Σq) to *scale
// by item 0. With pair_group (the 16 lanes of this block and its neighbour, lanes 16i..16i + 15, all
// taking part), the maximum, so the scale, is the two blocks' together (delta_pair_unshifted); Σq stays
// the block's own. A null frag stores nothing (the missing half of a last pair, raw all zero).
__device__ __forceinline__ void quantize_item(const uint32_t (&raw)[16], int j, unsigned group, uint32_t* frag,
                                              float2* scale, unsigned pair_group = 0u) {
  const auto value = [&](int i) {
    return __uint_as_float(i & 1 ? raw[i >> 1] & 0xFFFF0000u : raw[i >> 1] << 16);
  };
  float a[16];  // max |x| as a tree (the same value in any order)
#pragma unroll
  for (int i = 0; i < 16; ++i) a[i] = fmaxf(fabsf(value(2 * i)), fabsf(value(2 * i + 1)));
  const float m4[4] = {fmaxf(fmaxf(a[0], a[8]), fmaxf(a[4], a[12])), fmaxf(fmaxf(a[1], a[9]), fmaxf(a[5], a[13])),
                       fmaxf(fmaxf(a[2], a[10]), fmaxf(a[6], a[14])), fmaxf(fmaxf(a[3], a[11]), fmaxf(a[7], a[15]))};
  float m = fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3]));
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) m = fmaxf(m, __shfl_xor_sync(group, m, o));
  if (pair_group) m = fmaxf(m, __shfl_xor_sync(pair_group, m, 8));
  const float inv = m > 0.0f ? float(kQMax) / m : 0.0f;
  // q = round(v · inv), to nearest even as __float2int_rn, but on the full-rate float adder (the
  // conversion runs at a quarter of its rate): the product plus 1.5·2²³ is rounded to an integer
  // (its exponent leaves no fraction bits), which then sits in the low bits of the sum's
  // representation, two's complement. |v · inv| ≤ kQMax (to within rounding), so no clamp is
  // needed. Σq, from those representations, wraps correctly in 32 bits.
  constexpr float kMagic = 12582912.0f;  // 1.5·2²³: bits 0x4B400000
  uint32_t r[16], s[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const uint32_t lo = __float_as_uint(__fadd_rn(__fmul_rn(value(k), inv), kMagic));
    const uint32_t hi = __float_as_uint(__fadd_rn(__fmul_rn(value(k + 16), inv), kMagic));
    s[k] = lo + hi;
    r[k] = __byte_perm(lo, hi, 0x5410);
  }
  const uint32_t s4[4] = {(s[0] + s[8]) + (s[4] + s[12]), (s[1] + s[9]) + (s[5] + s[13]),
                          (s[2] + s[10]) + (s[6] + s[14]), (s[3] + s[11]) + (s[7] + s[15])};
  uint32_t sum = (s4[0] + s4[1]) + (s4[2] + s4[3]) - 32u * 0x4B400000u;
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(group, sum, o);
  if (!frag) return;
  bit_planes32(r);
  // Plane p of word j (columns 32j..) is register 2·(p / 8) + j / 4 of lane 4·(p % 8) + j % 4.
#pragma unroll
  for (int p = 0; p < 16; ++p) frag[((p & 7) * 4 + (j & 3)) * 4 + (p >> 3) * 2 + (j >> 2)] = r[p];
  if (j == 0) *scale = make_float2(m / float(kQMax), float(int(sum)));
}

// Item (kb, j) of a row into xs (quantize_row_shared's layout).
__device__ __forceinline__ void quantize_item_shared(const uint32_t (&raw)[16], int kb, int j, unsigned group,
                                                     uint8_t* xs) {
  quantize_item(raw, j, group, reinterpret_cast<uint32_t*>(xs + kb * kRowPlaneBytes),
                reinterpret_cast<float2*>(xs + kb * kRowPlaneBytes + 512));
}

// Item j of row r and 256-column block kb of x ([rows, K]) into xq, quantize_x's layout (blocks of
// xq_block bytes): load_item, then quantize_item. The 8 lanes of the block's group take part (with
// pair_group, the 16 of its pair; a block past the last, `present` false, takes part with zeros and
// stores nothing).
__device__ __forceinline__ void quantize_x_item(const __nv_bfloat16* x, int K, bool aligned, int r, int kb, int j,
                                                uint8_t* xq, int xq_block, unsigned pair_group = 0u,
                                                bool present = true) {
  uint32_t raw[16] = {};
  if (present) load_item(x + size_t(r) * K, K, aligned, kb * 256 + 32 * j, raw);
  uint8_t* blk = xq + size_t(kb) * xq_block;
  quantize_item(raw, j, 0xFFu << (threadIdx.x & 24),
                present ? reinterpret_cast<uint32_t*>(blk + kQuantizedPlanes) + r * 128 : nullptr,
                reinterpret_cast<float2*>(blk) + r, pair_group);
}

// after_loads(): called once by every thread, after its first loads of x are issued.
template <typename F>
__device__ __forceinline__ void quantize_row_shared(const __nv_bfloat16* x, int K, bool aligned, uint8_t* xs,
                                                    F&& after_loads) {
  const int items = (K + 255) / 256 * 8, n = blockDim.x;
  const unsigned group = 0xFFu << (threadIdx.x & 24);  // the 8 lanes that share a 256-column block
  bool called = false;
  for (int a = threadIdx.x; a < items; a += 2 * n) {  // whole groups of 8 take part in each item
    const int b = a + n;
    uint32_t ra[16], rb[16];
    load_item(x, K, aligned, (a >> 3) * 256 + (a & 7) * 32, ra);
    if (b < items) load_item(x, K, aligned, (b >> 3) * 256 + (b & 7) * 32, rb);
    if (!called) after_loads(), called = true;
    quantize_item_shared(ra, a >> 3, a & 7, group, xs);
    if (b < items) quantize_item_shared(rb, b >> 3, b & 7, group, xs);
  }
  if (!called) after_loads();
}
__device__ __forceinline__ void quantize_row_shared(const __nv_bfloat16* x, int K, bool aligned, uint8_t* xs) {
  quantize_row_shared(x, K, aligned, xs, [] {});
}

}  // namespace bitdelta::cuda
