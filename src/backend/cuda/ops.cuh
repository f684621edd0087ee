// The other ops of the forward pass on the device, each the counterpart of one in
// backend/cpu/ops.h (tests/gpu compares them): embedding gather with per-variant tables, RMSNorm
// (with the residual add folded in), bias + RoPE + KV-cache store, attention over the KV cache,
// SwiGLU. Rows of one step belong to different sequences and variants: each kernel reads its row's
// RowDesc. Float32 arithmetic; bf16 where a linear layer reads the result and in the KV cache.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>

namespace bitdelta::cuda {

// One row of a step, as the kernels see it (device memory). The kernels read the descriptors (and
// the row map and attention tiles) before they wait for the kernel before them (launch.cuh), so these
// must be put in place by a copy or a synchronized write, never by a kernel of the same chain.
struct RowDesc {
  int32_t token;
  int32_t position;
  int32_t kv_capacity;         // positions the sequence's cache holds
  __nv_bfloat16* kv;           // the sequence's cache, laid out as kv_index says
  const __nv_bfloat16* embed;  // the row's variant's embedding table [vocab, hidden]
  const float* norms;          // its norms: [layers][2][hidden] then the final norm [hidden]
  const float* bias;           // its biases [layers][q_dim + 2·kv_dim + hidden] (q, k, v, o), or null
};

// Where layer `layer`'s key (which 0) or value (which 1) row at `position` starts in a sequence's
// cache of `capacity` positions: [layers][2][capacity][kv_dim] bf16, so that the rows one layer's
// attention reads are contiguous per sequence. (Position-major, [capacity][layers][2][kv_dim], put
// one layer's rows 512 KB apart on the 7B shape: a layer's attention at batch 32 then touched 8.5 GB
// of addresses for 265 MB read.)
__host__ __device__ inline size_t kv_index(int layer, int which, size_t position, size_t capacity, int kv_dim) {
  return ((size_t(layer) * 2 + size_t(which)) * capacity + position) * size_t(kv_dim);
}

// x[r] = float(embed_r[token_r]), [rows, hidden].
void embed_rows(const RowDesc* rows, int n_rows, int hidden, float* x, cudaStream_t stream);

// For out row i, source row s = row_map ? row_map[i] : i: if add, x[s] += add[s] (and the row's
// bias at bias_offset, if ≥ 0 and the row has biases); then
// out[i] = bf16(rmsnorm(x[s]) ⊙ rows[s].norms[norm_offset ..]). float32 sum of squares (in a
// different order than the CPU's sequential one). hidden ≤ kMaxHidden.
// terms (here and in bias_rope_store and swiglu): null, or the delta terms of the linear that wrote
// the input (device_model.cu linear(), computed apart from its base), laid out as that output is;
// the kernel adds them to what it reads first, the same floats as add_to before it would give.
constexpr int kMaxHidden = 16384;
void add_rmsnorm(float* x, const float* add, const RowDesc* rows, const int* row_map, int n_out, int hidden,
                 int norm_offset, int bias_offset, float eps, __nv_bfloat16* out, cudaStream_t stream,
                 const float* terms = nullptr);

// Adds layer `layer`'s q/k/v biases (if the row has any), rotates q and k at the row's position
// ("rotate half" pairs, angle = float(position)·inv_freq[i], cos/sin in double as the CPU does), and
// stores k and v (bf16) into the row's cache at its position. q stays float32 in place. Row r of q
// starts at q + r·q_stride, of k and v at r·kv_stride (q, k and v may be views of one [rows, q+2kv]
// output of a fused linear). terms: as add_rmsnorm's, q's at terms, k's and v's as far from them as
// k and v are from q (so with terms, q, k and v are views of one buffer).
void bias_rope_store(float* q, const float* k, const float* v, int q_stride, int kv_stride, const RowDesc* rows,
                     int n_rows, int layer, int heads, int kv_heads, int head_dim, int hidden,
                     const float* inv_freq, cudaStream_t stream, const float* terms = nullptr);

// Rows per attention tile: consecutive rows of one sequence at consecutive positions (a prefill
// chunk) share each key and value read.
constexpr int kAttnTile = 8;
// Runs of at least this many rows of one sequence (prompts) take attention_prompt instead.
constexpr int kPromptRunRows = 64;

// For every row of every tile (tiles[i] = {first row, row count ≤ kAttnTile}; the rows of a tile
// belong to one sequence, at consecutive positions): out[r][head] = softmax(q·kᵀ·scale)·v over
// positions [0, position_r] of the row's cache at `layer`, grouped-query (head → kv head
// head / (heads / kv_heads)). Online softmax in float32. Row r of q starts at q + r·q_stride; out is
// [rows, heads·head_dim]. max_tile: the largest tile's row count; with 1 (decode rows only, tile i
// being row i) the positions are also split over thread blocks. max_position: the largest row
// position. head_dim: a multiple of 8, ≤ 256. Decode rows of head_dim 64 or 128 run on the tensor
// cores, with the queries and the probabilities in two bf16 parts each. For decode rows only
// (benchmarks set them; 0: chosen): split_len, positions per block, rounded up to a multiple of 32;
// split_heads, at most this many q heads of one kv head per block.
void attention(const float* q, int q_stride, const RowDesc* rows, const int2* tiles, int n_tiles, int max_tile,
               int max_position, int layer, int heads, int kv_heads, int head_dim, float scale,
               __nv_bfloat16* out, cudaStream_t stream, int split_len = 0, int split_heads = 0);

// What attention() launches for these arguments (the chosen split_len and split_heads): {kernel (0:
// the tile kernel; 1: the split kernel; 2: the tensor-core kernel), q heads per block, positions per
// block, most blocks per row}. Equal shapes launch the same grids with the same arguments but for the
// rows' positions, which the kernels read from the row descriptors.
std::array<int, 4> attention_shape(int n_tiles, int max_tile, int max_position, int heads, int kv_heads,
                                   int head_dim);

// A prompt's run of rows on the tensor cores: rows first .. first + n − 1 (of q and out, as in
// attention) belong to the sequence of `row` (host copy), at positions row.position .. + n − 1; each
// attends over positions [0, its own]. Three cuBLAS steps per group of q heads: scores S = q·kᵀ·scale
// with q split into two bf16 parts (q ≈ hi + lo, so the product keeps about 16 bits of q), the
// causal softmax in float32 with the probabilities rounded to bf16, then P·v with float32
// accumulation. handle runs on `stream`. Scratch: heads·rows·(position + n)·6 bytes, the rows taken
// in pieces that fit piece_bytes.
void attention_prompt(cublasHandle_t handle, const float* q, int q_stride, const RowDesc& row, int first, int n,
                      int layer, int heads, int kv_heads, int head_dim, float scale, __nv_bfloat16* out,
                      cudaStream_t stream, size_t piece_bytes = size_t(256) << 20);

// y[i] += d[i] for i < n (a linear's delta terms computed apart from its base: device_model.cu).
void add_to(float* y, const float* d, size_t n, cudaStream_t stream);

// out[r][i] = bf16(silu(gate[r·stride + i]) ⊙ up[r·stride + i]) for i < n; out is [rows, n].
// terms: as add_rmsnorm's, gate's at terms, up's as far from them as up is from gate (with terms,
// gate and up are views of one buffer).
void swiglu(const float* gate, const float* up, int stride, int n_rows, int n, __nv_bfloat16* out,
            cudaStream_t stream, const float* terms = nullptr);

}  // namespace bitdelta::cuda
