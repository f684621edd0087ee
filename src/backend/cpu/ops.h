// The other CPU ops of the forward pass, in float32: RMSNorm, rotary embeddings, attention over a
// KV cache, SwiGLU.
#pragma once

#include <cstddef>
#include <span>

namespace bitdelta::cpu {

// y = x · rsqrt(mean(x²) + eps) ⊙ weight, for one row of n.
void rmsnorm(const float* x, const float* weight, size_t n, double eps, float* y);

// Rotates `heads` heads of head_dim in place at `position` (the "rotate half" layout: element i
// pairs with i + head_dim/2). inv_freq has head_dim/2 entries.
void rope(float* x, size_t heads, size_t head_dim, size_t position, std::span<const float> inv_freq);

// One query head against positions [0, length) of one KV head: softmax(q·kᵀ·scale)·v.
// keys/values: [position][stride] with this head's vector at `offset`.
void attend(const float* q, const float* keys, const float* values, size_t length, size_t stride, size_t offset,
            size_t head_dim, float scale, float* out);

// gate ← silu(gate) ⊙ up, n elements.
void swiglu(float* gate, const float* up, size_t n);

}  // namespace bitdelta::cpu
