#include "ops.cuh"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda_check.cuh"
#include "launch.cuh"
#include "mma.cuh"
#include "stream_scratch.cuh"

namespace bitdelta::cuda {

namespace {

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct Add {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// op over the block (blockDim.x a multiple of 32, ≤ 1024); every thread gets the result.
template <typename Op>
__device__ float block_reduce(float v, Op op) {
  __shared__ float partial[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // partial may still be read from a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = partial[0];
  for (int w = 1; w < warps; ++w) total = op(total, partial[w]);
  return total;
}
__device__ float block_sum(float v) { return block_reduce(v, Add{}); }

__global__ void embed_kernel(const RowDesc* rows, int hidden, float* x) {
  pdl_launch_dependents();  // launch.cuh
  pdl_wait();
  const RowDesc row = rows[blockIdx.x];
  const __nv_bfloat16* e = row.embed + size_t(row.token) * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) x[size_t(blockIdx.x) * hidden + i] = __bfloat162float(e[i]);
}

// One block per out row; each thread keeps its PER elements (i = threadIdx.x + k·blockDim.x) and
// their norm weights in registers, all loaded before the sum of squares, so that the row costs one
// round trip to memory (reading x again and the weights after the sum took 6.9 µs per launch at
// batch 1 on the 7B shape, against 5.1 µs this way: ncu, runs 59 and 61).
template <int PER>
__global__ void __launch_bounds__(1024) add_rmsnorm_kernel(float* x, const float* add, const float* terms,
                                                           const RowDesc* rows, const int* row_map, int hidden,
                                                           int norm_offset, int bias_offset, float eps,
                                                           __nv_bfloat16* out) {
  pdl_launch_dependents();  // launch.cuh
  // Before the wait: the row's descriptor and its norm weights (launch.cuh: the step's descriptors are
  // copied in before its first kernel, the weights before any step), off the path after it.
  // (At 16 elements a thread all of it stays after the wait: 1024 threads have 64 registers, and with
  // the descriptor or the weights loaded before it ptxas spilled 60–216 bytes.)
  if constexpr (PER > 8) pdl_wait();
  const int s = row_map ? row_map[blockIdx.x] : int(blockIdx.x);
  const RowDesc& row = rows[s];
  const float* bias = bias_offset >= 0 && row.bias ? row.bias + bias_offset : nullptr;
  const float* w = row.norms + norm_offset;
  float v[PER], wv[PER], sum = 0;
  if constexpr (PER <= 8) {
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      wv[k] = i < hidden ? w[i] : 0.0f;
    }
    pdl_wait();
  }
  float* xr = x + size_t(s) * hidden;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    v[k] = i < hidden ? xr[i] : 0.0f;
    if constexpr (PER > 8) wv[k] = i < hidden ? w[i] : 0.0f;
    if (add && i < hidden) {
      float a = add[size_t(s) * hidden + i];
      if (terms) a += terms[size_t(s) * hidden + i];  // as add_to would have, before the bias
      v[k] += a + (bias ? bias[i] : 0.0f);
    }
  }
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (add && i < hidden) xr[i] = v[k];
    sum += v[k] * v[k];
  }
  sum = block_sum(sum);
  const float inv = 1.0f / sqrtf(sum / float(hidden) + eps);
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < hidden) out[size_t(blockIdx.x) * hidden + i] = __float2bfloat16(wv[k] * (v[k] * inv));
  }
}

// Block (r, y): row r's items y·256 + threadIdx.x, y·256 + threadIdx.x + gridDim.y·256, ... of its
// q pairs, k pairs and v elements. cos/sin are computed once per frequency and block (in double, as
// the CPU does): one block per row computing them per pair took 12.4 µs per launch on the 7B shape
// at batch 1 (ncu, run 59).
constexpr int kRopeThreads = 256, kMaxHalf = 128;
__global__ void __launch_bounds__(kRopeThreads) bias_rope_store_kernel(float* q, const float* k, const float* v,
                                                                       const float* tq, const float* tk, const float* tv,
                                                                       int q_stride, int kv_stride, const RowDesc* rows,
                                                                       int layer, int heads, int kv_heads,
                                                                       int head_dim, int hidden, const float* inv_freq) {
  pdl_launch_dependents();  // launch.cuh
  // Before the wait: the row's descriptor and the cosines and sines of its position (launch.cuh: the
  // descriptors and inv_freq are copied in before the step's first kernel), off the path after it.
  const int r = blockIdx.x;
  const RowDesc row = rows[r];
  const int half = head_dim / 2, q_dim = heads * head_dim, kv_dim = kv_heads * head_dim;
  __shared__ float cos_s[kMaxHalf], sin_s[kMaxHalf];
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    double sd, cd;
    sincos(double(float(row.position) * inv_freq[i]), &sd, &cd);
    cos_s[i] = float(cd), sin_s[i] = float(sd);
  }
  __syncthreads();
  pdl_wait();
  const float* bias = row.bias ? row.bias + size_t(layer) * (q_dim + 2 * kv_dim + hidden) : nullptr;
  __nv_bfloat16* kr_out = row.kv + kv_index(layer, 0, size_t(row.position), size_t(row.kv_capacity), kv_dim);
  __nv_bfloat16* vr_out = row.kv + kv_index(layer, 1, size_t(row.position), size_t(row.kv_capacity), kv_dim);
  float* qr = q + size_t(r) * q_stride;
  const float* kr = k + size_t(r) * kv_stride;
  const float* vr = v + size_t(r) * kv_stride;
  // The delta terms of q, k and v (laid out as they are), added first, as add_to would have.
  const float* tqr = tq ? tq + size_t(r) * q_stride : nullptr;
  const float* tkr = tk ? tk + size_t(r) * kv_stride : nullptr;
  const float* tvr = tv ? tv + size_t(r) * kv_stride : nullptr;
  const int q_pairs = heads * half, k_pairs = kv_heads * half, pairs = q_pairs + k_pairs;
  for (int p = blockIdx.y * blockDim.x + threadIdx.x; p < pairs + kv_dim; p += gridDim.y * blockDim.x) {
    if (p >= pairs) {
      const int i = p - pairs;
      const float val = tvr ? vr[i] + tvr[i] : vr[i];
      vr_out[i] = __float2bfloat16(val + (bias ? bias[q_dim + kv_dim + i] : 0.0f));
      continue;
    }
    const bool is_q = p < q_pairs;
    const int pp = is_q ? p : p - q_pairs, head = pp / half, i = pp % half;
    const int ia = head * head_dim + i, ib = ia + half;
    const float c = cos_s[i], sn = sin_s[i];
    if (is_q) {
      float a = qr[ia], b = qr[ib];
      if (tqr) a += tqr[ia], b += tqr[ib];
      if (bias) a += bias[ia], b += bias[ib];
      qr[ia] = a * c - b * sn;
      qr[ib] = b * c + a * sn;
    } else {
      float a = kr[ia], b = kr[ib];
      if (tkr) a += tkr[ia], b += tkr[ib];
      if (bias) a += bias[q_dim + ia], b += bias[q_dim + ib];
      kr_out[ia] = __float2bfloat16(a * c - b * sn);
      kr_out[ib] = __float2bfloat16(b * c + a * sn);
    }
  }
}


// One block per (tile, head). A tile is up to QT consecutive rows of one sequence at consecutive
// positions (a prefill chunk; a decode row is a tile of one), so the keys and values each position
// contributes are read once for all of them. Each warp takes 32-position chunks (chunk = warp,
// warp + kAttnWarps, ...): first a lane per position computes its scores against the QT queries
// (held scaled in shared memory), with causal masking; an online-softmax update per query; then a
// lane per DPL dims accumulates p·v over the chunk's positions. The warps' partial results are merged
// at the end. head_dim must be a multiple of 8 (16-byte key loads). kAttnWarps warps per block: 8 for
// single rows (a decode row's positions spread over more warps), 4 for tiles of 8 (on the 7B shape
// 8 warps and an unrolled key loop for tiles too made 512-token prefill 10% slower). Steps of decode
// rows alone go to attention_split_kernel where it applies (QT = 1 here otherwise); a decode row in a
// step with a prefill chunk comes here as a tile of one.
template <int QT, int DPL, int kAttnWarps = QT == 1 ? 8 : 4>
__global__ void __launch_bounds__(kAttnWarps * 32) attention_kernel(const float* q, int q_stride, const RowDesc* rows,
                                                                    const int2* tiles, int layer,
                                                                    int heads, int kv_heads, int head_dim,
                                                                    float scale, __nv_bfloat16* out) {
  pdl_launch_dependents();  // launch.cuh
  const int h = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // Before the wait (launch.cuh: the tiles and descriptors are copied in before the step's first kernel).
  const int2 tile = tiles[blockIdx.x];  // first row, row count
  const RowDesc first = rows[tile.x];
  pdl_wait();
  const int p0 = first.position, n = tile.y, p_last = p0 + n - 1;
  const int kv_dim = kv_heads * head_dim, kvh = h / (heads / kv_heads);
  const size_t stride = size_t(kv_dim);  // between positions
  const __nv_bfloat16* kbase = first.kv + kv_index(layer, 0, 0, size_t(first.kv_capacity), kv_dim) + size_t(kvh) * head_dim;
  const __nv_bfloat16* vbase = first.kv + kv_index(layer, 1, 0, size_t(first.kv_capacity), kv_dim) + size_t(kvh) * head_dim;

  __shared__ float q_s[QT][DPL * 32];
  __shared__ float p_s[kAttnWarps][QT][32];
  for (int i = 0; i < QT; ++i)
    for (int d = threadIdx.x; d < DPL * 32; d += blockDim.x)
      q_s[i][d] = i < n && d < head_dim ? q[size_t(tile.x + i) * q_stride + size_t(h) * head_dim + d] * scale : 0.0f;
  __syncthreads();

  float m[QT], l[QT], acc[QT][DPL];
#pragma unroll
  for (int i = 0; i < QT; ++i) {
    m[i] = -INFINITY;
    l[i] = 0;
    for (int j = 0; j < DPL; ++j) acc[i][j] = 0;
  }
  for (int c0 = warp * 32; c0 <= p_last; c0 += kAttnWarps * 32) {
    // Scores: lane = position t.
    const int t = c0 + lane;
    float s[QT];
#pragma unroll
    for (int i = 0; i < QT; ++i) s[i] = 0;
    if (t <= p_last) {
      const __nv_bfloat16* kp = kbase + size_t(t) * stride;
      // A fixed trip count: for a single row all loads can be in flight; a tile of 8 keeps the loop
      // rolled (its registers go to the 8 queries).
      constexpr int kKeyUnroll = QT == 1 ? DPL * 4 : 1;
#pragma unroll kKeyUnroll
      for (int c8 = 0; c8 < DPL * 4; ++c8) {
        const int d0 = c8 * 8;
        if (d0 >= head_dim) break;
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(kp + d0));
        const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
        float kf[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = __bfloat1622float2(k2[e]);
          kf[2 * e] = f.x;
          kf[2 * e + 1] = f.y;
        }
#pragma unroll
        for (int i = 0; i < QT; ++i)
#pragma unroll
          for (int e = 0; e < 8; ++e) s[i] += q_s[i][d0 + e] * kf[e];
      }
    }
    // Online softmax per query over this chunk.
#pragma unroll
    for (int i = 0; i < QT; ++i) {
      if (i >= n) continue;
      const bool valid = t <= p0 + i;
      float cmax = valid ? s[i] : -INFINITY;
      for (int o = 16; o > 0; o >>= 1) cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, o));
      if (cmax == -INFINITY) {  // no position of this chunk is visible to query i
        p_s[warp][i][lane] = 0;
        continue;
      }
      const float mn = fmaxf(m[i], cmax), corr = expf(m[i] - mn);
      const float pv = valid ? expf(s[i] - mn) : 0.0f;
      p_s[warp][i][lane] = pv;
      l[i] = l[i] * corr + warp_sum(pv);
#pragma unroll
      for (int j = 0; j < DPL; ++j) acc[i][j] *= corr;
      m[i] = mn;
    }
    __syncwarp();
    // p·v: lane = dims lane + 32j; the values of 8 positions are loaded before any is used, so that
    // many loads are in flight (decode at batch 1 is latency-bound otherwise).
    const int count = min(32, p_last - c0 + 1);
    for (int u0 = 0; u0 < count; u0 += 8) {
      float vv[8][DPL];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const __nv_bfloat16* vp = vbase + size_t(c0 + min(u0 + e, count - 1)) * stride;
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
          const int d = lane + 32 * j;
          vv[e][j] = d < head_dim ? __bfloat162float(vp[d]) : 0.0f;
        }
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if (u0 + e >= count) break;
#pragma unroll
        for (int i = 0; i < QT; ++i) {
          if (i >= n) continue;
          const float pu = p_s[warp][i][u0 + e];
#pragma unroll
          for (int j = 0; j < DPL; ++j) acc[i][j] += pu * vv[e][j];
        }
      }
    }
    __syncwarp();
  }

  // Merge the warps, query by query.
  __shared__ float sm_m[kAttnWarps], sm_l[kAttnWarps];
  __shared__ float sm_acc[kAttnWarps][DPL * 32];
#pragma unroll
  for (int i = 0; i < QT; ++i) {
    if (i >= n) continue;
    __syncthreads();
    if (lane == 0) sm_m[warp] = m[i], sm_l[warp] = l[i];
#pragma unroll
    for (int j = 0; j < DPL; ++j) sm_acc[warp][lane + 32 * j] = acc[i][j];
    __syncthreads();
    float mx = -INFINITY;
    for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, sm_m[w]);
    float total = 0;
    for (int w = 0; w < kAttnWarps; ++w) total += sm_m[w] == -INFINITY ? 0.0f : sm_l[w] * expf(sm_m[w] - mx);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
      float sum = 0;
      for (int w = 0; w < kAttnWarps; ++w)
        if (sm_m[w] != -INFINITY) sum += sm_acc[w][d] * expf(sm_m[w] - mx);
      out[(size_t(tile.x + i) * heads + h) * head_dim + d] = __float2bfloat16(sum / total);
    }
  }
}

// Decode rows (tiles of one row): the positions are split over blocks as well (flash decoding), so
// that one row's heads fill the device. Row r's [0, position] is cut into 32-position chunks, and
// those into splits = ⌈(position + 1) / split_len⌉ near-equal runs; block (g, r, s) takes run s for
// head group g (G heads, below), its warp w the run's chunks w, w + 4, ... Lanes hold dims, so that
// each key and value row is one coalesced load, and the scores are put back one per lane by a
// transposing warp sum. While a chunk's scores and values are computed, the next chunk's keys, then
// its values, are already in flight. Blocks past the row's last split exit. With one split the
// block writes the row's output; otherwise each writes its (max, sum, unnormalized p·v) per head to
// part[r][h][s], and the last of the row's splits to arrive (a counter per row and head group,
// reset by it) merges them in split order. On the 7B shape at 520 positions: one block of 8 warps
// per (row, head), a lane per position, took 24 µs per layer at batch 1 (ncu, run 59); one chunk
// per warp and 128 positions per block 12.5 µs at batch 1 and 132.6 µs at batch 32; this kernel,
// splits as attention() chooses, 12.8 and 82.2 µs (0.78 of the copy rate); 0.91 of it at 8 rows ×
// 2048 positions, and the copy rate at 32 × 2048 or 8 × 8192 (bench_gpu_attention, runs 68–69).
constexpr int kSplitWarps = 4, kChunk = 32;

// One step of a transposing warp sum: lanes with bit W set keep the upper W of their first 2·W
// values, the others the lower W, each adding its partner's (lane ^ W) share (a constant W per
// instance, so that d stays in registers).
template <int W>
__device__ __forceinline__ void transpose_sum(float (&d)[32], int lane) {
  const bool upper = lane & W;
#pragma unroll
  for (int k = 0; k < W; ++k) {
    const float send = upper ? d[k] : d[k + W], keep = upper ? d[k + W] : d[k];
    d[k] = keep + __shfl_xor_sync(0xffffffffu, send, W);
  }
}
// Whether a warp's first chunk c (of a split ending before chunk_end, of a row at n positions) may
// be read before the wait (launch.cuh): a decode row's positions before its last were written by
// earlier steps (the copy of the step's descriptors, before its first kernel, started after those
// had finished); its last, n − 1, is written by this step's RoPE, the kernel before this one. (Chunk
// c's positions are min(c·32 + e, n − 1), e < 32.) Those loads then overlap the kernels before.
__device__ __forceinline__ bool early_chunk(int c, int chunk_end, int n) {
  return c < chunk_end && (c + 1) * kChunk < n;
}

// G: q heads per block, all of one kv head (grouped-query attention), so that each key and value
// row is read once for the G of them; their queries are in shared memory, their scores and sums in
// registers (1, 2, 4 or 8: max_split_heads).
template <int DPL, int G>
__global__ void __launch_bounds__(kSplitWarps * 32) attention_split_kernel(const float* q, int q_stride,
                                                                           const RowDesc* rows, int layer,
                                                                           int heads, int kv_heads, int head_dim,
                                                                           float scale, int split_len, float* part,
                                                                           unsigned* arrived, int max_splits,
                                                                           __nv_bfloat16* out) {
  pdl_launch_dependents();  // launch.cuh
  const int hg = blockIdx.x, r = blockIdx.y, sp = blockIdx.z, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int h0 = hg * G;  // the block's q heads: h0 .. h0 + G − 1
  const RowDesc row = rows[r];  // before the wait (launch.cuh: copied in before the step's first kernel)
  const int n = row.position + 1, splits = (n + split_len - 1) / split_len;
  if (sp >= splits) return;  // the whole block
  // This split's chunks [chunk_begin, chunk_end): the row's chunks spread evenly over its splits, at
  // least one each (split_len ≥ 32, so splits ≤ chunks).
  const int chunks = (n + kChunk - 1) / kChunk;
  const int chunk_begin = sp * chunks / splits, chunk_end = (sp + 1) * chunks / splits;
  const int kv_dim = kv_heads * head_dim, kvh = h0 / (heads / kv_heads);
  const size_t stride = size_t(kv_dim);  // between positions
  const __nv_bfloat16* kbase = row.kv + kv_index(layer, 0, 0, size_t(row.kv_capacity), kv_dim) + size_t(kvh) * head_dim;
  const __nv_bfloat16* vbase = row.kv + kv_index(layer, 1, 0, size_t(row.kv_capacity), kv_dim) + size_t(kvh) * head_dim;

  // Lane ℓ holds dims DPL·ℓ .. DPL·ℓ + DPL − 1 of each key and value it reads (one coalesced load of
  // 2·DPL bytes per position: a key or value row in one instruction of the warp), and reads the
  // same dims of the G queries (scaled) from shared memory.
  static_assert(DPL == 2 || DPL == 4 || DPL == 8);
  static_assert(G == 1 || G == 2 || G == 4 || G == 8);
  using Raw = std::conditional_t<DPL == 2, uint32_t, std::conditional_t<DPL == 4, uint2, uint4>>;
  const bool dims_valid = DPL * lane < head_dim;
  __shared__ float q_s[G][DPL * 32];
  __shared__ float p_s[kSplitWarps][G][32];

  // Chunk c's keys (all 32) and values (VB at a time: all 32 but where registers are short); rows
  // past the last position repeat it (loaded, never used).
  constexpr int VB = DPL == 8 || G > 1 ? 16 : 32;
  Raw kraw[32], vraw[VB];
  const auto at = [&](const __nv_bfloat16* base, int c, int e) {
    return reinterpret_cast<const Raw*>(base + size_t(min(c * kChunk + e, n - 1)) * stride + DPL * lane);
  };
  const auto load_keys = [&](int c) {
#pragma unroll
    for (int e = 0; e < 32; ++e) kraw[e] = dims_valid ? __ldg(at(kbase, c, e)) : Raw{};
  };
  const auto load_values = [&](int c, int u0) {
#pragma unroll
    for (int e = 0; e < VB; ++e) vraw[e] = dims_valid ? __ldg(at(vbase, c, u0 + e)) : Raw{};
  };
  // With 8 dims per lane, or several heads, the next chunk's keys do not fit beside this chunk's
  // values: they load at the top of their own chunk (spills otherwise).
  constexpr bool kPrefetchKeys = DPL <= 4 && G == 1;
  // The warp's first chunk: before the wait where it holds only positions that earlier steps wrote
  // (early_chunk), else after it.
  int c = chunk_begin + warp;
  const bool early = early_chunk(c, chunk_end, n);
  if (early) {
    if (kPrefetchKeys) load_keys(c);
    load_values(c, 0);
  }
  pdl_wait();
  if (c < chunk_end && !early) {
    if (kPrefetchKeys) load_keys(c);
    load_values(c, 0);
  }
  // The queries after the first keys and values are in flight (they do not depend on them): the
  // block's first chunk no longer waits for a load of q and a barrier before its own loads start.
  for (int i = threadIdx.x; i < G * DPL * 32; i += blockDim.x) {
    const int g = i / (DPL * 32), d = i % (DPL * 32);
    q_s[g][d] = d < head_dim ? q[size_t(r) * q_stride + size_t(h0 + g) * head_dim + d] * scale : 0.0f;
  }
  __syncthreads();
  float m[G], l[G], acc[G][DPL];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY, l[g] = 0.0f;
#pragma unroll
    for (int j = 0; j < DPL; ++j) acc[g][j] = 0.0f;
  }
  for (; c < chunk_end; c += kSplitWarps) {
    const int count = min(kChunk, n - c * kChunk), next = c + kSplitWarps;
    if (!kPrefetchKeys) load_keys(c);
    // Per head: partial dot products over this lane's dims, then a transposing reduction: at step w,
    // the lanes with bit w set keep the upper half of their positions and the others the lower
    // half, each adding its partner's (lane ^ w) share; after 16 + 8 + 4 + 2 + 1 shuffles lane t
    // holds position t's score.
    float score[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float qv[DPL];
#pragma unroll
      for (int j = 0; j < DPL; ++j) qv[j] = q_s[g][DPL * lane + j];
      float dots[32];
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&kraw[e]);
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < DPL / 2; ++j) {
          const float2 f = __bfloat1622float2(k2[j]);
          dot += qv[2 * j] * f.x + qv[2 * j + 1] * f.y;
        }
        dots[e] = dot;
      }
      transpose_sum<16>(dots, lane);
      transpose_sum<8>(dots, lane);
      transpose_sum<4>(dots, lane);
      transpose_sum<2>(dots, lane);
      transpose_sum<1>(dots, lane);
      score[g] = dots[0];
    }
    if (kPrefetchKeys && next < chunk_end) load_keys(next);  // in flight during this chunk's softmax and values
    // Online softmax per head: the running max m (finite after the first chunk), sum l and acc
    // rescaled.
    const bool valid = lane < count;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float cmax = valid ? score[g] : -INFINITY;
      for (int o = 16; o > 0; o >>= 1) cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, o));
      const float mn = fmaxf(m[g], cmax), corr = expf(m[g] - mn);  // m = −∞ at the first chunk: corr 0
      const float pv = valid ? expf(score[g] - mn) : 0.0f;
      p_s[warp][g][lane] = pv;
      l[g] = l[g] * corr + warp_sum(pv);
      m[g] = mn;
#pragma unroll
      for (int j = 0; j < DPL; ++j) acc[g][j] *= corr;
    }
    __syncwarp();
    for (int u0 = 0; u0 < count; u0 += VB) {
      if (u0 > 0) load_values(c, u0);
#pragma unroll
      for (int e = 0; e < VB; ++e) {
        if (u0 + e >= count) break;
        const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&vraw[e]);
        float vf[DPL];
#pragma unroll
        for (int j = 0; j < DPL / 2; ++j) {
          const float2 f = __bfloat1622float2(v2[j]);
          vf[2 * j] = f.x, vf[2 * j + 1] = f.y;
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float pu = p_s[warp][g][u0 + e];
#pragma unroll
          for (int j = 0; j < DPL; ++j) acc[g][j] += pu * vf[j];
        }
      }
    }
    __syncwarp();  // p_s is rewritten by the next chunk
    if (next < chunk_end) load_values(next, 0);
  }

  // The block's warps merged per head: (M, L, Σ acc·e^(m − M)). −∞ and 0 for a warp without a chunk.
  __shared__ float sm_m[kSplitWarps][G], sm_l[kSplitWarps][G], sm_acc[kSplitWarps][G][DPL * 32];
  __shared__ float mx_s[G], total_s[G];
  __shared__ int last;
  if (lane == 0)
#pragma unroll
    for (int g = 0; g < G; ++g) sm_m[warp][g] = m[g], sm_l[warp][g] = l[g];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int j = 0; j < DPL; ++j) sm_acc[warp][g][DPL * lane + j] = acc[g][j];
  __syncthreads();
  if (threadIdx.x < G) {
    const int g = threadIdx.x;
    float mx = -INFINITY;
    for (int w = 0; w < kSplitWarps; ++w) mx = fmaxf(mx, sm_m[w][g]);  // finite: warp 0 has a chunk
    float total = 0.0f;
    for (int w = 0; w < kSplitWarps; ++w) total += sm_m[w][g] == -INFINITY ? 0.0f : sm_l[w][g] * expf(sm_m[w][g] - mx);
    mx_s[g] = mx, total_s[g] = total;
  }
  __syncthreads();
  const auto merged = [&](int g, int d) {
    float sum = 0.0f;
    for (int w = 0; w < kSplitWarps; ++w)
      if (sm_m[w][g] != -INFINITY) sum += sm_acc[w][g][d] * expf(sm_m[w][g] - mx_s[g]);
    return sum;
  };
  // Items i = g·head_dim + d of the block's G heads (contiguous in out and, per head, in part).
  __nv_bfloat16* o = out + (size_t(r) * heads + h0) * head_dim;
  if (splits == 1) {
    for (int i = threadIdx.x; i < G * head_dim; i += blockDim.x) {
      const int g = i / head_dim, d = i % head_dim;
      o[i] = __float2bfloat16(merged(g, d) / total_s[g]);
    }
    return;
  }
  const int pitch = DPL * 32 + 2;  // floats per head and split: max, sum, then the dims
  const auto part_of = [&](int g, int split) { return part + ((size_t(r) * heads + h0 + g) * max_splits + split) * pitch; };
  if (threadIdx.x < G) part_of(threadIdx.x, sp)[0] = mx_s[threadIdx.x], part_of(threadIdx.x, sp)[1] = total_s[threadIdx.x];
  for (int i = threadIdx.x; i < G * head_dim; i += blockDim.x) {
    const int g = i / head_dim, d = i % head_dim;
    part_of(g, sp)[2 + d] = merged(g, d);
  }
  if (!last_to_arrive(arrived + size_t(r) * (heads / G) + hg, unsigned(splits), last, [] { __syncthreads(); }))
    return;
  if (threadIdx.x < G) {
    const int g = threadIdx.x;
    float gm = -INFINITY;
    for (int i = 0; i < splits; ++i) gm = fmaxf(gm, __ldcg(part_of(g, i)));
    float gl = 0.0f;
    for (int i = 0; i < splits; ++i) gl += __ldcg(part_of(g, i) + 1) * expf(__ldcg(part_of(g, i)) - gm);
    mx_s[g] = gm, total_s[g] = gl;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * head_dim; i += blockDim.x) {
    const int g = i / head_dim, d = i % head_dim;
    float sum = 0.0f;
    for (int s2 = 0; s2 < splits; ++s2) sum += __ldcg(part_of(g, s2) + 2 + d) * expf(__ldcg(part_of(g, s2)) - mx_s[g]);
    o[i] = __float2bfloat16(sum / total_s[g]);
  }
}

// Decode rows of head_dim 64 or 128 on the tensor cores, G = 1, 2, 4 or 8 q heads of one kv head per
// block: per chunk of 32 positions, the scores of the G heads as one mma.m16n8k16 product (rows
// 0..7: the heads' queries rounded to bf16, rows 8..15: what that rounding left, so that the two
// rows' sum carries the float query to about 2^-16), the online softmax on the fragments, and p·v as
// a second product (rows: the probabilities' bf16 parts, the same split). The register split kernel
// above runs the dot products on the CUDA cores: at 4 heads per block, 32 rows and 520 positions it
// read the 7B-like 32/8 cache at 0.39 of the copy rate (run 220), bound by those instructions (keys
// and values staged in shared memory for the same work were slower still, 0.20); this kernel 0.54
// (run 221), and with one head per block (the 7B shape, 32/32) 0.82 against 0.77 (run 223). Warps,
// chunks, prefetch, splits and merges as in the split kernel.
//
// Fragment maps (PTX m16n8k16: lane = 4g + t). Sums over dims and positions may take them in any
// order, so each is permuted to make the loads contiguous:
// - scores, k = dims: per 32 dims (a slice), lane t loads dims 8t..8t+7 of position g of an n-tile
//   (one 16-byte load): its words 0, 1 are k-step 2·slice's (k 2t, 2t+1 and 2t+8, 2t+9), words 2, 3
//   the next k-step's; the queries go to the A fragment in the same order.
// - p·v, k = positions: k-step s's k 2t, 2t + 1 are positions 2t, 2t + 1 of the scores' n-tile 2s,
//   and its k 2t + 8, 2t + 9 the same of n-tile 2s + 1, which lane (g, t) already holds (positions
//   8i + 2t, + 1 of n-tile i); so lane t loads the values of positions 16s + 2t, + 1, + 8, + 9.
// - p·v, n = dims: n-tile j's column n is dim DG·n + j (DG = head_dim / 8): lane g loads dims
//   DG·g..DG·g + DG − 1 of each of its positions (contiguous), and the output it holds, columns 2t
//   and 2t + 1 of every n-tile, is dims 2·DG·t..2·DG·t + 2·DG − 1 of head g.
// (The mma itself: mma_bf16, mma.cuh.)

// Two floats as a bf16 pair (x low) and what their rounding left, likewise.
__device__ __forceinline__ void split_bf16x2(float x, float y, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x - hf.x, y - hf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h), lo = *reinterpret_cast<const uint32_t*>(&l);
}

template <int HD, int G>
__global__ void __launch_bounds__(kSplitWarps * 32) attention_mma_kernel(const float* q, int q_stride,
                                                                         const RowDesc* rows, int layer, int heads,
                                                                         int kv_heads, int head_dim, float scale,
                                                                         int split_len, float* part, unsigned* arrived,
                                                                         int max_splits, __nv_bfloat16* out) {
  static_assert(HD == 64 || HD == 128);
  static_assert(G == 1 || G == 2 || G == 4 || G == 8);
  constexpr int SL = HD / 32, DG = HD / 8, VW = DG / 8;  // slices; dims per lane g in p·v; uint4 per position
  pdl_launch_dependents();  // launch.cuh
  const int hg = blockIdx.x, r = blockIdx.y, sp = blockIdx.z, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane >> 2, t = lane & 3, h0 = hg * G;
  const RowDesc row = rows[r];  // before the wait (launch.cuh: copied in before the step's first kernel)
  const int n = row.position + 1, splits = (n + split_len - 1) / split_len;
  if (sp >= splits) return;
  const int chunks = (n + kChunk - 1) / kChunk;
  const int chunk_begin = sp * chunks / splits, chunk_end = (sp + 1) * chunks / splits;
  const int kv_dim = kv_heads * HD, kvh = h0 / (heads / kv_heads);
  const size_t stride = size_t(kv_dim);
  const __nv_bfloat16* kbase = row.kv + kv_index(layer, 0, 0, size_t(row.kv_capacity), kv_dim) + size_t(kvh) * HD;
  const __nv_bfloat16* vbase = row.kv + kv_index(layer, 1, 0, size_t(row.kv_capacity), kv_dim) + size_t(kvh) * HD;
  const auto at = [&](const __nv_bfloat16* base, int c, int e, int d) {
    return reinterpret_cast<const uint4*>(base + size_t(min(c * kChunk + e, n - 1)) * stride + d);
  };
  // Chunk c's keys: n-tile i's position g, slice sl's dims 8t.. (kr[i][sl]); its values: k-step s's
  // positions 16s + {2t, 2t + 1, 2t + 8, 2t + 9}, dims DG·g.. (vr[s][u][w]).
  uint4 kr[4][SL], vr[2][4][VW];
  const auto load_keys = [&](int c) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int sl = 0; sl < SL; ++sl) kr[i][sl] = __ldg(at(kbase, c, 8 * i + g, 32 * sl + 8 * t));
  };
  const auto load_values = [&](int c) {
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int w = 0; w < VW; ++w)
          vr[s][u][w] = __ldg(at(vbase, c, 16 * s + 2 * t + (u & 1) + 8 * (u >> 1), DG * g + 8 * w));
  };
  // The warp's first chunk: before the wait where it holds only positions that earlier steps wrote
  // (early_chunk), else after it.
  int c = chunk_begin + warp;
  const bool early = early_chunk(c, chunk_end, n);
  if (early) load_keys(c), load_values(c);
  pdl_wait();
  if (c < chunk_end && !early) load_keys(c), load_values(c);
  // The queries (scaled) of head g, split into bf16 parts, in the A fragments' order: per slice, lane
  // (g, t)'s dims 8t..8t + 7 as 4 words of each part. Rows past G are zero.
  __shared__ uint4 q_hi[SL][8][4], q_lo[SL][8][4];
  for (int i = threadIdx.x; i < SL * 32; i += blockDim.x) {
    const int sl = i / 32, gg = (i / 4) % 8, tt = i % 4;
    uint32_t hi[4] = {}, lo[4] = {};
    if (gg < G) {
      const float* qh = q + size_t(r) * q_stride + size_t(h0 + gg) * HD + 32 * sl + 8 * tt;
#pragma unroll
      for (int w = 0; w < 4; ++w) split_bf16x2(qh[2 * w] * scale, qh[2 * w + 1] * scale, hi[w], lo[w]);
    }
    q_hi[sl][gg][tt] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    q_lo[sl][gg][tt] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  }
  __syncthreads();

  float m = -INFINITY, l = 0.0f, acc[DG][4];
#pragma unroll
  for (int j = 0; j < DG; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  for (; c < chunk_end; c += kSplitWarps) {
    const int count = min(kChunk, n - c * kChunk), next = c + kSplitWarps;
    float sc[4][4] = {};  // n-tile i: (hi row, lo row) × positions 8i + 2t, + 1
#pragma unroll
    for (int sl = 0; sl < SL; ++sl) {
      const uint4 qh = q_hi[sl][g][t], ql = q_lo[sl][g][t];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        mma_bf16(sc[i], qh.x, ql.x, qh.y, ql.y, kr[i][sl].x, kr[i][sl].y);
        mma_bf16(sc[i], qh.z, ql.z, qh.w, ql.w, kr[i][sl].z, kr[i][sl].w);
      }
    }
    if (next < chunk_end) load_keys(next);  // in flight during this chunk's softmax and values
    // Online softmax of head g over the chunk: the quad (lanes 4g..4g + 3) holds its 32 positions.
    float s[8], cmax = -INFINITY;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool valid = 8 * i + 2 * t + e < count;
        s[2 * i + e] = valid ? sc[i][e] + sc[i][2 + e] : -INFINITY;
        cmax = fmaxf(cmax, s[2 * i + e]);
      }
    cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, 1));
    cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, 2));
    const float mn = fmaxf(m, cmax), corr = expf(m - mn);  // m = −∞ at the first chunk: corr 0
    float psum = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) s[k] = s[k] == -INFINITY ? 0.0f : expf(s[k] - mn), psum += s[k];
    psum += __shfl_xor_sync(0xffffffffu, psum, 1);
    psum += __shfl_xor_sync(0xffffffffu, psum, 2);
    l = l * corr + psum;
    m = mn;
#pragma unroll
    for (int j = 0; j < DG; ++j) acc[j][0] *= corr, acc[j][1] *= corr, acc[j][2] *= corr, acc[j][3] *= corr;
    // p·v: k-step s's A fragment is the probabilities of n-tiles 2s and 2s + 1, in two bf16 parts.
#pragma unroll
    for (int st = 0; st < 2; ++st) {
      uint32_t p0h, p0l, p1h, p1l;
      split_bf16x2(s[4 * st], s[4 * st + 1], p0h, p0l);
      split_bf16x2(s[4 * st + 2], s[4 * st + 3], p1h, p1l);
#pragma unroll
      for (int j = 0; j < DG; ++j) {
        // Dim DG·g + j of positions 2t and 2t + 1 (b0), 2t + 8 and 2t + 9 (b1): halves of the loaded words.
        const int w = j / 8, word = (j % 8) / 2;
        const uint32_t sel = j & 1 ? 0x7632 : 0x5410;
        const auto pick = [&](const uint4& v) { return word == 0 ? v.x : word == 1 ? v.y : word == 2 ? v.z : v.w; };
        const uint32_t b0 = __byte_perm(pick(vr[st][0][w]), pick(vr[st][1][w]), sel);
        const uint32_t b1 = __byte_perm(pick(vr[st][2][w]), pick(vr[st][3][w]), sel);
        mma_bf16(acc[j], p0h, p0l, p1h, p1l, b0, b1);
      }
    }
    if (next < chunk_end) load_values(next);
  }

  // The block's warps merged per head (as the split kernel): lane (g, t) holds head g's dims
  // 2·DG·t + 2·j' + e ... as acc[j][e] (hi row) + acc[j][2 + e] (lo row): column 2t + e of n-tile j is
  // dim DG·(2t + e) + j.
  __shared__ float sm_m[kSplitWarps][8], sm_l[kSplitWarps][8], sm_acc[kSplitWarps][G][HD];
  __shared__ float mx_s[G], total_s[G];
  __shared__ int last;
  if (t == 0) sm_m[warp][g] = m, sm_l[warp][g] = l;
  if (g < G)
#pragma unroll
    for (int j = 0; j < DG; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) sm_acc[warp][g][DG * (2 * t + e) + j] = acc[j][e] + acc[j][2 + e];
  __syncthreads();
  if (threadIdx.x < G) {
    const int gg = threadIdx.x;
    float mx = -INFINITY;
    for (int w = 0; w < kSplitWarps; ++w) mx = fmaxf(mx, sm_m[w][gg]);  // finite: warp 0 has a chunk
    float total = 0.0f;
    for (int w = 0; w < kSplitWarps; ++w)
      total += sm_m[w][gg] == -INFINITY ? 0.0f : sm_l[w][gg] * expf(sm_m[w][gg] - mx);
    mx_s[gg] = mx, total_s[gg] = total;
  }
  __syncthreads();
  const auto merged = [&](int gg, int d) {
    float sum = 0.0f;
    for (int w = 0; w < kSplitWarps; ++w)
      if (sm_m[w][gg] != -INFINITY) sum += sm_acc[w][gg][d] * expf(sm_m[w][gg] - mx_s[gg]);
    return sum;
  };
  __nv_bfloat16* o = out + (size_t(r) * heads + h0) * HD;
  if (splits == 1) {
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x)
      o[i] = __float2bfloat16(merged(i / HD, i % HD) / total_s[i / HD]);
    return;
  }
  const int pitch = HD + 2;  // floats per head and split: max, sum, then the dims (the split kernel's)
  const auto part_of = [&](int gg, int split) {
    return part + ((size_t(r) * heads + h0 + gg) * max_splits + split) * pitch;
  };
  if (threadIdx.x < G)
    part_of(threadIdx.x, sp)[0] = mx_s[threadIdx.x], part_of(threadIdx.x, sp)[1] = total_s[threadIdx.x];
  for (int i = threadIdx.x; i < G * HD; i += blockDim.x) part_of(i / HD, sp)[2 + i % HD] = merged(i / HD, i % HD);
  if (!last_to_arrive(arrived + size_t(r) * (heads / G) + hg, unsigned(splits), last, [] { __syncthreads(); }))
    return;
  if (threadIdx.x < G) {
    const int gg = threadIdx.x;
    float gm = -INFINITY;
    for (int i = 0; i < splits; ++i) gm = fmaxf(gm, __ldcg(part_of(gg, i)));
    float gl = 0.0f;
    for (int i = 0; i < splits; ++i) gl += __ldcg(part_of(gg, i) + 1) * expf(__ldcg(part_of(gg, i)) - gm);
    mx_s[gg] = gm, total_s[gg] = gl;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
    const int gg = i / HD, d = i % HD;
    float sum = 0.0f;
    for (int s2 = 0; s2 < splits; ++s2)
      sum += __ldcg(part_of(gg, s2) + 2 + d) * expf(__ldcg(part_of(gg, s2)) - mx_s[gg]);
    o[i] = __float2bfloat16(sum / total_s[gg]);
  }
}

// The split kernel's instance for dpl dims per lane and g heads per block.
// The most heads per block without spilling registers: 8 with 2 dims per lane, 4 with 4, 1 with 8.
constexpr int max_split_heads(int dpl) { return dpl == 2 ? 8 : dpl == 4 ? 4 : 1; }
template <int D>
const void* split_kernel_for(int g) {
  if constexpr (max_split_heads(D) >= 8)
    if (g == 8) return reinterpret_cast<const void*>(attention_split_kernel<D, 8>);
  if constexpr (max_split_heads(D) >= 4)
    if (g == 4) return reinterpret_cast<const void*>(attention_split_kernel<D, 4>);
  if constexpr (max_split_heads(D) >= 2)
    if (g == 2) return reinterpret_cast<const void*>(attention_split_kernel<D, 2>);
  return reinterpret_cast<const void*>(attention_split_kernel<D, 1>);
}
const void* split_kernel(int dpl, int g) {
  return dpl == 2 ? split_kernel_for<2>(g) : dpl == 4 ? split_kernel_for<4>(g) : split_kernel_for<8>(g);
}

// The tensor-core kernel's instance for head_dim 64 or 128 and g = 1, 2, 4 or 8 heads per block.
template <int HD>
const void* mma_kernel_for(int g) {
  return g == 8   ? reinterpret_cast<const void*>(attention_mma_kernel<HD, 8>)
         : g == 4 ? reinterpret_cast<const void*>(attention_mma_kernel<HD, 4>)
         : g == 2 ? reinterpret_cast<const void*>(attention_mma_kernel<HD, 2>)
                  : reinterpret_cast<const void*>(attention_mma_kernel<HD, 1>);
}
const void* mma_kernel(int head_dim, int g) { return head_dim == 64 ? mma_kernel_for<64>(g) : mma_kernel_for<128>(g); }

// Resident blocks of a decode attention kernel on the current device (one wave; cached per device and
// instance): the split kernel's (dpl, g), or with `tc` the tensor-core kernel's (head_dim 32·dpl).
int split_blocks_wave(int dpl, int g, bool tc = false) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices][3][4][2];
  int device = 0;
  BITDELTA_CUDA_CHECK(cudaGetDevice(&device));
  const int di = dpl == 2 ? 0 : dpl == 4 ? 1 : 2, gi = g == 1 ? 0 : g == 2 ? 1 : g == 4 ? 2 : 3;
  std::atomic<int>* slot = device < kMaxDevices ? &cache[device][di][gi][tc] : nullptr;
  if (slot && slot->load(std::memory_order_relaxed) > 0) return slot->load(std::memory_order_relaxed);
  int sms = 0, per_sm = 0;
  BITDELTA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const void* k = tc ? mma_kernel(32 * dpl, g) : split_kernel(dpl, g);
  BITDELTA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kSplitWarps * 32, 0));
  const int wave = sms * std::max(per_sm, 1);
  if (slot) slot->store(wave, std::memory_order_relaxed);
  return wave;
}

// A prompt run's queries, scaled, as two bf16 parts: hi = bf16(x), lo = bf16(x − hi); [n][q_dim].
// 4 columns per thread: q_dim and q_stride multiples of 4, q 16-byte aligned (attention_prompt checks).
__global__ void split_query_kernel(const float* q, int q_stride, int q_dim, float scale, __nv_bfloat16* hi,
                                   __nv_bfloat16* lo) {
  pdl_launch_dependents();  // launch.cuh
  pdl_wait();
  const size_t r = blockIdx.y;
  for (int i = (blockIdx.x * blockDim.x + threadIdx.x) * 4; i < q_dim; i += gridDim.x * blockDim.x * 4) {
    const float4 v = *reinterpret_cast<const float4*>(q + r * q_stride + i);
    const float x[4] = {v.x * scale, v.y * scale, v.z * scale, v.w * scale};
    __nv_bfloat16 h[4], l[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      h[t] = __float2bfloat16(x[t]);
      l[t] = __float2bfloat16(x[t] - __bfloat162float(h[t]));
    }
    *reinterpret_cast<uint2*>(hi + r * q_dim + i) = *reinterpret_cast<const uint2*>(h);
    *reinterpret_cast<uint2*>(lo + r * q_dim + i) = *reinterpret_cast<const uint2*>(l);
  }
}

// One row (head, query i) of the scores per block, pitch ld: the softmax over keys [0, p0 + i] in
// float32, written as bf16 probabilities; 0 for the keys after it (the next GEMM reads them too).
__global__ void causal_softmax_kernel(const float* scores, int n, int ld, int p0, __nv_bfloat16* probs) {
  pdl_launch_dependents();  // launch.cuh
  pdl_wait();
  const size_t row = blockIdx.x;  // head·n + i
  const int valid = p0 + int(row % size_t(n)) + 1;
  const float* sr = scores + row * ld;
  __nv_bfloat16* pr = probs + row * ld;
  float m = -INFINITY;
  for (int j = threadIdx.x; j < valid; j += blockDim.x) m = fmaxf(m, sr[j]);
  m = block_reduce(m, Max{});
  float sum = 0.0f;
  for (int j = threadIdx.x; j < valid; j += blockDim.x) sum += expf(sr[j] - m);
  const float inv = 1.0f / block_sum(sum);
  for (int j = threadIdx.x; j < ld; j += blockDim.x) pr[j] = __float2bfloat16(j < valid ? expf(sr[j] - m) * inv : 0.0f);
}

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// y[i] += d[i]; Vec: 4 floats per thread (n a multiple of 4, both arrays 16-byte aligned).
template <bool Vec>
__global__ void add_to_kernel(float* y, const float* d, size_t n) {
  pdl_launch_dependents();  // launch.cuh
  pdl_wait();
  const size_t step = size_t(gridDim.x) * blockDim.x;
  if constexpr (Vec) {
    float4* y4 = reinterpret_cast<float4*>(y);
    const float4* d4 = reinterpret_cast<const float4*>(d);
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n / 4; i += step) {
      float4 a = y4[i];
      const float4 b = d4[i];
      a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
      y4[i] = a;
    }
  } else {
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) y[i] += d[i];
  }
}

// Row blockIdx.y; Vec: 4 columns per thread (float4 loads, 8-byte stores), for n, stride a
// multiple of 4 and 16-byte aligned rows. One column per thread took 26.8 µs per launch at 512 rows
// on the 7B shape (ncu, run 79).
template <bool Vec>
__global__ void swiglu_kernel(const float* gate, const float* up, const float* tg, const float* tu, int stride, int n,
                              __nv_bfloat16* out) {
  pdl_launch_dependents();  // launch.cuh
  pdl_wait();
  const size_t r = blockIdx.y;
  if constexpr (Vec) {
    const float4* g4 = reinterpret_cast<const float4*>(gate + r * stride);
    const float4* u4 = reinterpret_cast<const float4*>(up + r * stride);
    uint2* o = reinterpret_cast<uint2*>(out + r * n);
    const float4* tg4 = tg ? reinterpret_cast<const float4*>(tg + r * stride) : nullptr;
    const float4* tu4 = tu ? reinterpret_cast<const float4*>(tu + r * stride) : nullptr;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n / 4; i += gridDim.x * blockDim.x) {
      float4 g = g4[i], u = u4[i];
      if (tg4) {  // the delta terms, added first, as add_to would have
        const float4 a = tg4[i], b = tu4[i];
        g.x += a.x, g.y += a.y, g.z += a.z, g.w += a.w;
        u.x += b.x, u.y += b.y, u.z += b.z, u.w += b.w;
      }
      const __nv_bfloat162 lo = __floats2bfloat162_rn(silu_times(g.x, u.x), silu_times(g.y, u.y)),
                           hi = __floats2bfloat162_rn(silu_times(g.z, u.z), silu_times(g.w, u.w));
      o[i] = make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
    }
  } else {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
      float g = gate[r * stride + i], u = up[r * stride + i];
      if (tg) g += tg[r * stride + i], u += tu[r * stride + i];
      out[r * n + i] = __float2bfloat16(silu_times(g, u));
    }
  }
}

}  // namespace

void embed_rows(const RowDesc* rows, int n_rows, int hidden, float* x, cudaStream_t stream) {
  if (n_rows == 0) return;
  launch_chained(embed_kernel, dim3(unsigned(n_rows)), dim3(256), 0, stream, rows, hidden, x);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

void add_rmsnorm(float* x, const float* add, const RowDesc* rows, const int* row_map, int n_out, int hidden,
                 int norm_offset, int bias_offset, float eps, __nv_bfloat16* out, cudaStream_t stream,
                 const float* terms) {
  if (terms && !add) fail("cuda::add_rmsnorm: delta terms without the addend they belong to");
  if (n_out == 0) return;
  // 8 elements per thread up to 8192 (1024 threads), then 16 (up to kMaxHidden). (The form with 32
  // per thread, up to 32768, took 88 registers, more than the 64 that a thread of 1024 may have: any
  // hidden over 8192 failed to launch. No test had one; tests/gpu now does.)
  const int threads = std::max(64, std::min(1024, (hidden + 8 * 32 - 1) / (8 * 32) * 32));
  if (hidden <= 8 * threads)
    launch_chained(add_rmsnorm_kernel<8>, dim3(unsigned(n_out)), dim3(unsigned(threads)), 0, stream, x, add, terms, rows,
                   row_map, hidden, norm_offset, bias_offset, eps, out);
  else if (hidden <= kMaxHidden)
    launch_chained(add_rmsnorm_kernel<16>, dim3(unsigned(n_out)), dim3(1024), 0, stream, x, add, terms, rows, row_map,
                   hidden, norm_offset, bias_offset, eps, out);
  else
    fail("cuda::add_rmsnorm: hidden ", hidden, " (at most ", kMaxHidden, ")");
  BITDELTA_CUDA_CHECK_LAUNCH();
}

void bias_rope_store(float* q, const float* k, const float* v, int q_stride, int kv_stride, const RowDesc* rows,
                     int n_rows, int layer, int heads, int kv_heads, int head_dim, int hidden,
                     const float* inv_freq, cudaStream_t stream, const float* terms) {
  if (n_rows == 0) return;
  if (head_dim % 2 || head_dim / 2 > kMaxHalf)
    fail("cuda::bias_rope_store: head_dim ", head_dim, " (even, at most ", 2 * kMaxHalf, ")");
  // Blocks per row: enough for about 1024 blocks in all (up to 32 a row). Each block computes its
  // row's cos/sin in double first, so many rows take fewer blocks each: at 512 rows, 32 blocks a
  // row took 26.4 µs per launch on the 7B shape (ncu, run 79), the sines and cosines of 16384 blocks.
  const int items = (heads + kv_heads) * head_dim / 2 + kv_heads * head_dim;
  const int per_row = std::max(1, std::min({(items + kRopeThreads - 1) / kRopeThreads, 32, 1024 / n_rows}));
  const dim3 grid{unsigned(n_rows), unsigned(per_row)};
  const float* tk = terms ? terms + (k - q) : nullptr;
  const float* tv = terms ? terms + (v - q) : nullptr;
  launch_chained(bias_rope_store_kernel, grid, dim3(kRopeThreads), 0, stream, q, k, v, terms, tk, tv,
                 q_stride, kv_stride, rows, layer, heads, kv_heads, head_dim, hidden, inv_freq);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

namespace {

// How attention() runs decode rows over split positions: the tensor-core or the split kernel, q heads
// per block, positions per block and the most blocks per row. split = false: the tile kernel.
struct SplitPlan {
  bool split = false, tc = false;
  int g = 1, split_len = 0, max_splits = 0;
};

SplitPlan plan_split(int n_tiles, int max_tile, int max_position, int heads, int kv_heads, int head_dim, int split_len,
                     int split_heads) {
  SplitPlan plan;
  const int dpl = (head_dim + 31) / 32;
  // Decode rows only (tile i is row i), at most 65535 (the grid's y), with 2, 4 or 8 dims per lane
  // (head_dim 40–64, 104–128 or 232–256) go to the tensor-core kernel (head_dim 64 or 128) or the
  // split kernel.
  if (max_tile <= 1 && n_tiles <= 65535 && (dpl == 2 || dpl == 4 || dpl == 8)) {
    // Head_dim 64 and 128 take the tensor-core kernel, others the split kernel. q heads per block:
    // with grouped-query attention, the largest of 8, 4, 2 that divides the heads per kv head (for
    // the split kernel at most max_split_heads), where that still makes at least 2 waves of blocks at
    // the most splits; else 1. (7B-like 32/8 heads, run 70, the split
    // kernel: 32 rows, 4 heads per block, took 40.4 µs at 520 positions against 67.5 with 1 and 403
    // against 751 at 8192; one row 16.9 against 11.5 at 520, 36.2 against 32.9 at 8192; 8 rows 23.2
    // against 20.8 at 520, 38.6 against 53.8 at 2048. Run 221, the tensor-core kernel: 32 rows
    // 27.3–29.4 µs at 520, 71.3 at 2048, 252 at 8192; one row 14.0 against 11.3 (one head per block)
    // at 520 and 18.4 against 15.3 at 2048 (fewer blocks than a wave), but 30.6–31.0 against 33.6 at
    // 8192; 8 rows at 520, 320 blocks, 19.2 against 20.8. Run 223, one head per block, 7B shape
    // (32/32): 32 rows 77.7–77.9 µs against 83.1–83.4 on the split kernel at 520, 247 against 255 at
    // 2048; one row 18.8–18.9 against 20.2–20.4 at 2048. With one head per block on the tensor cores
    // too (run 224), 32/8: 8 rows at 520 (320 blocks) 18.1 against 19.3 grouped, one row at 8192 (512)
    // 27.7 against 30.8, 8 rows at 2048 (1024) 42.0 against 29.5: 2 waves again, not 1.)
    const int n_max = max_position + 1, chunks_max = (n_max + kChunk - 1) / kChunk;
    const int most_splits = (chunks_max + kSplitWarps - 1) / kSplitWarps;
    const int group = heads / kv_heads;
    const bool tc = head_dim == 64 || head_dim == 128;
    int g = 1;
    while (g * 2 <= 8 && group % (g * 2) == 0 && (split_heads <= 0 || g * 2 <= split_heads)) g *= 2;
    if (!tc) g = std::min(g, max_split_heads(dpl));
    const auto wave_of = [&](int gg) { return split_blocks_wave(dpl, gg, tc); };
    if (split_heads == 0 && g > 1 && int64_t(n_tiles) * (heads / g) * most_splits < 2 * int64_t(wave_of(g))) g = 1;
    if (split_len <= 0) {
      // Splits per row: about one wave of resident blocks over all (row, head group) pairs (the
      // nearest count, at least 1), and at least 4 chunks (one per warp) in each. Splitting costs a
      // merge and a tail: on the 7B shape at 520 positions (run 68), 8 rows took 25.4 µs unsplit
      // against 31.7 in 2 splits, 32 rows 82.6 against 102.4; one row 12.5 µs in 5 splits against 17.7.
      const int pairs = n_tiles * (heads / g), wave = wave_of(g);
      const int want = (wave + pairs / 2) / pairs;
      const int splits = std::max(1, std::min(want, most_splits));
      split_len = (n_max + splits - 1) / splits;
    }
    split_len = (std::max(split_len, kChunk) + kChunk - 1) / kChunk * kChunk;
    plan = {true, tc, g, split_len, (n_max + split_len - 1) / split_len};
  }
  return plan;
}

}  // namespace

std::array<int, 4> attention_shape(int n_tiles, int max_tile, int max_position, int heads, int kv_heads,
                                   int head_dim) {
  const SplitPlan p = plan_split(n_tiles, max_tile, max_position, heads, kv_heads, head_dim, 0, 0);
  return {p.split ? 1 + p.tc : 0, p.g, p.split_len, p.max_splits};
}

void attention(const float* q, int q_stride, const RowDesc* rows, const int2* tiles, int n_tiles, int max_tile,
               int max_position, int layer, int heads, int kv_heads, int head_dim, float scale,
               __nv_bfloat16* out, cudaStream_t stream, int split_len_arg, int split_heads) {
  if (n_tiles == 0) return;
  if (head_dim % 8 || head_dim > 256) fail("cuda::attention: head_dim ", head_dim, " (a multiple of 8, at most 256)");
  const int dpl = (head_dim + 31) / 32;
  const SplitPlan plan =
      plan_split(n_tiles, max_tile, max_position, heads, kv_heads, head_dim, split_len_arg, split_heads);
  if (plan.split) {
    const bool tc = plan.tc;
    const int g = plan.g;
    int split_len = plan.split_len, max_splits = plan.max_splits;
    float* part = nullptr;  // the splits' parts per head, and a counter per row and head group (zero
    unsigned* arrived = nullptr;  // between launches)
    if (max_splits > 1) {
      part = static_cast<float*>(stream_scratch(
          ScratchUse::kAttentionParts, stream, size_t(n_tiles) * heads * max_splits * (dpl * 32 + 2) * sizeof(float)));
      arrived = static_cast<unsigned*>(
          stream_scratch(ScratchUse::kAttentionCounters, stream, size_t(n_tiles) * heads * sizeof(unsigned), true));
    }
    // Head groups vary fastest, so that the blocks that run together read neighbouring pieces of the
    // same positions' rows. It measured the same as rows fastest: 103.5 against 103.0 µs per layer
    // at batch 32 on the 7B shape (ncu, runs 64–65).
    const dim3 grid{unsigned(heads / g), unsigned(n_tiles), unsigned(max_splits)};
    void* args[] = {&q, &q_stride, &rows, &layer, &heads, &kv_heads, &head_dim, &scale, &split_len, &part,
                    &arrived, &max_splits, &out};
    if (tc)
      launch_chained(mma_kernel(head_dim, g), grid, dim3(kSplitWarps * 32), 0, stream, args);
    else
      launch_chained(split_kernel(dpl, g), grid, dim3(kSplitWarps * 32), 0, stream, args);
    BITDELTA_CUDA_CHECK_LAUNCH();
    return;
  }
  const dim3 grid{unsigned(n_tiles), unsigned(heads)};
  auto go = [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    switch (dpl) {
#define BITDELTA_ATTN_CASE(D)                                                                                 \
  case D:                                                                                                     \
    launch_chained(attention_kernel<QT, D>, grid, dim3((QT == 1 ? 8 : 4) * 32), 0, stream, q, q_stride, rows, tiles, \
                   layer, heads, kv_heads, head_dim, scale, out);                                             \
    break;
      BITDELTA_ATTN_CASE(1)
      BITDELTA_ATTN_CASE(2)
      BITDELTA_ATTN_CASE(3)
      BITDELTA_ATTN_CASE(4)
      BITDELTA_ATTN_CASE(5)
      BITDELTA_ATTN_CASE(6)
      BITDELTA_ATTN_CASE(7)
      BITDELTA_ATTN_CASE(8)
#undef BITDELTA_ATTN_CASE
    }
  };
  // Decode rows the split kernel does not take keep a block of 8 warps per (row, head).
  if (max_tile <= 1)
    go(std::integral_constant<int, 1>{});
  else
    go(std::integral_constant<int, kAttnTile>{});
  BITDELTA_CUDA_CHECK_LAUNCH();
}

void attention_prompt(cublasHandle_t handle, const float* q, int q_stride, const RowDesc& row, int first, int n,
                      int layer, int heads, int kv_heads, int head_dim, float scale, __nv_bfloat16* out,
                      cudaStream_t stream, size_t piece_bytes) {
  if (n <= 0) return;
  if (head_dim % 8 || kv_heads < 1 || heads % kv_heads)
    fail("cuda::attention_prompt: ", heads, " heads, ", kv_heads, " kv heads of ", head_dim, " (a multiple of 8)");
  if (q_stride % 4 || (reinterpret_cast<uintptr_t>(q) & 15))
    fail("cuda::attention_prompt: q's rows must be 16-byte aligned (stride ", q_stride, " floats)");
  const int q_dim = heads * head_dim, kv_dim = kv_heads * head_dim, g = heads / kv_heads;
  const __nv_bfloat16* keys = row.kv + kv_index(layer, 0, 0, size_t(row.kv_capacity), kv_dim);
  const __nv_bfloat16* values = row.kv + kv_index(layer, 1, 0, size_t(row.kv_capacity), kv_dim);
  // Rows in pieces whose scores and probabilities fit piece_bytes (each row's attention is
  // independent).
  const int ld_all = (row.position + n + 7) / 8 * 8;
  const size_t per_row = size_t(heads) * ld_all * (sizeof(float) + sizeof(__nv_bfloat16));
  const int piece = int(std::clamp<size_t>(piece_bytes / per_row, 1, size_t(n)));
  const float one = 1.0f, zero = 0.0f;
  for (int i0 = 0; i0 < n; i0 += piece) {
    const int m = std::min(piece, n - i0), p0 = row.position + i0, nkeys = p0 + m, ld = (nkeys + 7) / 8 * 8;
    auto* qh = static_cast<__nv_bfloat16*>(
        stream_scratch(ScratchUse::kPromptQuery, stream, size_t(2) * m * q_dim * sizeof(__nv_bfloat16)));
    __nv_bfloat16* ql = qh + size_t(m) * q_dim;
    auto* sc = static_cast<float*>(stream_scratch(ScratchUse::kPromptScores, stream, size_t(heads) * m * ld * sizeof(float)));
    auto* pr = static_cast<__nv_bfloat16*>(
        stream_scratch(ScratchUse::kPromptProbs, stream, size_t(heads) * m * ld * sizeof(__nv_bfloat16)));
    launch_chained(split_query_kernel, dim3(unsigned(std::min((q_dim / 4 + 255) / 256, 64)), unsigned(m)), dim3(256), 0,
                   stream, q + size_t(first + i0) * q_stride, q_stride, q_dim, scale, qh, ql);
    BITDELTA_CUDA_CHECK_LAUNCH();
    // Per q head h = kvh·g + o, batched over the kv heads. Column-major (cuBLAS): S_hᵀ (nkeys × m, pitch
    // ld) = K_kvh (head_dim × nkeys, pitch kv_dim)ᵀ · Q_h (head_dim × m, pitch q_dim), i.e. S_h[i][j]
    // row-major; then O_hᵀ (head_dim × m, pitch q_dim: out's rows) = V_kvh (head_dim × nkeys) · P_hᵀ.
    for (int o = 0; o < g; ++o)
      for (int part = 0; part < 2; ++part)
        BITDELTA_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
            handle, CUBLAS_OP_T, CUBLAS_OP_N, nkeys, m, head_dim, &one, keys, CUDA_R_16BF, kv_dim, head_dim,
            (part ? ql : qh) + size_t(o) * head_dim, CUDA_R_16BF, q_dim, (long long)(g) * head_dim, part ? &one : &zero,
            sc + size_t(o) * m * ld, CUDA_R_32F, ld, (long long)(g) * m * ld, kv_heads, CUBLAS_COMPUTE_32F,
            CUBLAS_GEMM_DEFAULT));
    launch_chained(causal_softmax_kernel, dim3(unsigned(size_t(heads) * m)), dim3(128), 0, stream, sc, m, ld, p0, pr);
    BITDELTA_CUDA_CHECK_LAUNCH();
    for (int o = 0; o < g; ++o)
      BITDELTA_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_N, CUBLAS_OP_N, head_dim, m, nkeys, &one, values, CUDA_R_16BF, kv_dim, head_dim,
          pr + size_t(o) * m * ld, CUDA_R_16BF, ld, (long long)(g) * m * ld, &zero,
          out + size_t(first + i0) * q_dim + size_t(o) * head_dim, CUDA_R_16BF, q_dim, (long long)(g) * head_dim,
          kv_heads, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
}

void add_to(float* y, const float* d, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  const bool vec = n % 4 == 0 && (reinterpret_cast<uintptr_t>(y) & 15) == 0 && (reinterpret_cast<uintptr_t>(d) & 15) == 0;
  const size_t items = vec ? n / 4 : n;
  const unsigned blocks = unsigned(std::min<size_t>((items + 255) / 256, 1024));
  if (vec)
    launch_chained(add_to_kernel<true>, dim3(blocks), dim3(256), 0, stream, y, d, n);
  else
    launch_chained(add_to_kernel<false>, dim3(blocks), dim3(256), 0, stream, y, d, n);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

void swiglu(const float* gate, const float* up, int stride, int n_rows, int n, __nv_bfloat16* out,
            cudaStream_t stream, const float* terms) {
  if (n == 0 || n_rows == 0) return;
  const float* tg = terms;
  const float* tu = terms ? terms + (up - gate) : nullptr;
  const auto aligned = [](const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; };
  const bool vec = n % 4 == 0 && stride % 4 == 0 && aligned(gate, 16) && aligned(up, 16) && aligned(out, 8) &&
                   (!terms || (aligned(tg, 16) && aligned(tu, 16)));
  const int per_thread = vec ? 4 : 1;
  const dim3 grid{unsigned(std::min((n / per_thread + 255) / 256, 64)), unsigned(n_rows)};
  if (vec)
    launch_chained(swiglu_kernel<true>, grid, dim3(256), 0, stream, gate, up, tg, tu, stride, n, out);
  else
    launch_chained(swiglu_kernel<false>, grid, dim3(256), 0, stream, gate, up, tg, tu, stride, n, out);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

}  // namespace bitdelta::cuda
