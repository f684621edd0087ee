// W_eff = W + α·S in bf16 pairs, formed from W's loads by the fused prefill GEMM (in registers), the
// streaming kernel's form_weights (in shared memory) and the register kernel's W_eff form (in
// registers; any GPU). All round as bf16(W + bf16(α)·s).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace bitdelta::cuda {

// −α in both halves of a pair:
__device__ __forceinline__ uint32_t neg_alpha_pair(float alpha) {
  const __nv_bfloat16 a = __float2bfloat16_rn(alpha);
  const uint16_t bits = *reinterpret_cast<const uint16_t*>(&a);
  return (uint32_t(bits) | (uint32_t(bits) << 16)) ^ 0x80008000u;
}
// ±α for the two columns at bits 15 − sh and 31 − sh of z (1 = +α), as a bf16 pair, from neg_alpha2:
// a shift and a LOP3. (z: sign bits with each column's right neighbour 16 bits above it, e.g.
// __byte_perm(b, b >> 1, 0x5410) of a byte b of 8 columns: columns 2e and 2e + 1 at shift 15 − 2e.)
__device__ __forceinline__ uint32_t delta_pair(uint32_t z, int sh, uint32_t neg_alpha2) {
  return ((z << sh) & 0x80008000u) ^ neg_alpha2;
}
__device__ __forceinline__ uint32_t bf16x2_add(uint32_t a, uint32_t b) {
  __nv_bfloat162 x = *reinterpret_cast<__nv_bfloat162*>(&a), y = *reinterpret_cast<__nv_bfloat162*>(&b);
  __nv_bfloat162 s = __hadd2(x, y);
  return *reinterpret_cast<uint32_t*>(&s);
}

}  // namespace bitdelta::cuda
