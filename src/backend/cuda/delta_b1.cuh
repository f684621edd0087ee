// The delta term on the 1-bit tensor cores, shared by the decode kernels (fused_linear_decode.cuh
// describes the arithmetic): per 16 output rows, 256 columns and one row of x, two
// mma.m16n8k256.and.popc of the sign bits (A) against x's 16 bit-planes (B), weighted per plane.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

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

// The quantized rows of x that prepare_x writes, per 256-column block: (scale, Σq) of each row as two
// floats (room for 32 rows: 256 bytes), then each row's 32 lanes' B fragments (512 bytes per row).
// A block is contiguous and 16-byte aligned: the streaming kernel copies it with one bulk copy.
constexpr int kQuantizedPlanes = 256;  // offset of the bit-planes in a block
__host__ __device__ __forceinline__ int quantized_x_block(int rows) { return kQuantizedPlanes + rows * 512; }

// Row r of x in 256-column block kb, quantized into blk (that block of quantized_x_block bytes):
// scale = max |x| / 32767, q = round(x / scale), and the bit-planes of q as the lanes' B fragments.
// Lane ℓ holds columns 32·j + ℓ, so one ballot of bit p of q_j is word j of plane p; lane (g, t)'s
// fragment is 4 words: planes g, g + 8 × words t, t + 4. The calling warp makes word w (0..3) of
// every lane's fragment (planes 8·(w / 2) + 0..7 × words 4·(w % 2) + 0..3: 32 ballots), so four
// warps make a fragment, each loading and scaling the same 256 values; with w = 0 it also stores the
// block's (scale, Σq).
__device__ __forceinline__ void quantize_row_block(const __nv_bfloat16* x, int K, int r, int kb, uint8_t* blk, int w) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const __nv_bfloat16* xr = x + size_t(r) * K + size_t(kb) * 256;
  const int valid = min(256, K - kb * 256);
  float v[8], m = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    v[j] = 32 * j + lane < valid ? __bfloat162float(xr[32 * j + lane]) : 0.0f;
    m = fmaxf(m, fabsf(v[j]));
  }
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float inv = m > 0.0f ? float(kQMax) / m : 0.0f;
  int q[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) q[j] = max(-kQMax, min(kQMax, __float2int_rn(v[j] * inv)));
  // Words 4·(w % 2) + jj of q, shifted so that plane 8·(w / 2) + pl is bit pl.
  int qs[4];
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) qs[jj] = (w & 1 ? q[4 + jj] : q[jj]) >> (w & 2 ? 8 : 0);
  uint32_t f = 0;
#pragma unroll
  for (int pl = 0; pl < 8; ++pl)
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const uint32_t word = __ballot_sync(0xffffffffu, (qs[jj] >> pl) & 1);
      if (pl == g && jj == t) f = word;
    }
  reinterpret_cast<uint32_t*>(blk + kQuantizedPlanes)[(r * 32 + lane) * 4 + w] = f;
  if (w == 0) {
    int sum = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += q[j];
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) reinterpret_cast<float2*>(blk)[r] = make_float2(m / float(kQMax), float(sum));
  }
}

}  // namespace bitdelta::cuda
