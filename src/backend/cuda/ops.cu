#include "ops.cuh"

#include <cmath>
#include <type_traits>

#include "cuda_check.cuh"

namespace bitdelta::cuda {

namespace {

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, ≤ 1024); every thread gets the result.
__device__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // partial may still be read from a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = 0;
  for (int w = 0; w < warps; ++w) total += partial[w];
  return total;
}

__global__ void embed_kernel(const RowDesc* rows, int hidden, float* x) {
  const RowDesc row = rows[blockIdx.x];
  const __nv_bfloat16* e = row.embed + size_t(row.token) * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) x[size_t(blockIdx.x) * hidden + i] = __bfloat162float(e[i]);
}

__global__ void add_rmsnorm_kernel(float* x, const float* add, const RowDesc* rows, const int* row_map,
                                   int hidden, int norm_offset, int bias_offset, float eps, __nv_bfloat16* out) {
  const int s = row_map ? row_map[blockIdx.x] : int(blockIdx.x);
  float* xr = x + size_t(s) * hidden;
  const float* bias = bias_offset >= 0 && rows[s].bias ? rows[s].bias + bias_offset : nullptr;
  float sum = 0;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = xr[i];
    if (add) {
      v += add[size_t(s) * hidden + i] + (bias ? bias[i] : 0.0f);
      xr[i] = v;
    }
    sum += v * v;
  }
  sum = block_sum(sum);
  const float inv = 1.0f / sqrtf(sum / float(hidden) + eps);
  const float* w = rows[s].norms + norm_offset;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    out[size_t(blockIdx.x) * hidden + i] = __float2bfloat16(w[i] * (xr[i] * inv));
}

__global__ void bias_rope_store_kernel(float* q, const float* k, const float* v, int q_stride, int kv_stride,
                                       const RowDesc* rows, int layer,
                                       int layers, int heads, int kv_heads, int head_dim, int hidden,
                                       const float* inv_freq) {
  const int r = blockIdx.x;
  const RowDesc row = rows[r];
  const int half = head_dim / 2, q_dim = heads * head_dim, kv_dim = kv_heads * head_dim;
  const float* bias = row.bias ? row.bias + size_t(layer) * (q_dim + 2 * kv_dim + hidden) : nullptr;
  __nv_bfloat16* kv = row.kv + (size_t(row.position) * layers + layer) * 2 * kv_dim;
  float* qr = q + size_t(r) * q_stride;
  const float* kr = k + size_t(r) * kv_stride;
  const float* vr = v + size_t(r) * kv_stride;
  const int q_pairs = heads * half, k_pairs = kv_heads * half;
  for (int p = threadIdx.x; p < q_pairs + k_pairs; p += blockDim.x) {
    const bool is_q = p < q_pairs;
    const int pp = is_q ? p : p - q_pairs, head = pp / half, i = pp % half;
    const int ia = head * head_dim + i, ib = ia + half;
    double sd, cd;
    sincos(double(float(row.position) * inv_freq[i]), &sd, &cd);
    const float c = float(cd), sn = float(sd);
    if (is_q) {
      float a = qr[ia], b = qr[ib];
      if (bias) a += bias[ia], b += bias[ib];
      qr[ia] = a * c - b * sn;
      qr[ib] = b * c + a * sn;
    } else {
      float a = kr[ia], b = kr[ib];
      if (bias) a += bias[q_dim + ia], b += bias[q_dim + ib];
      kv[ia] = __float2bfloat16(a * c - b * sn);
      kv[ib] = __float2bfloat16(b * c + a * sn);
    }
  }
  for (int i = threadIdx.x; i < kv_dim; i += blockDim.x)
    kv[kv_dim + i] = __float2bfloat16(vr[i] + (bias ? bias[q_dim + kv_dim + i] : 0.0f));
}


// One block per (tile, head). A tile is up to QT consecutive rows of one sequence at consecutive
// positions (a prefill chunk; a decode row is a tile of one), so the keys and values each position
// contributes are read once for all of them. Each warp takes 32-position chunks (chunk = warp,
// warp + kAttnWarps, ...): first a lane per position computes its scores against the QT queries
// (held scaled in shared memory), with causal masking; an online-softmax update per query; then a
// lane per DPL dims accumulates p·v over the chunk's positions. The warps' partial results are merged
// at the end. head_dim must be a multiple of 8 (16-byte key loads). kAttnWarps warps per block: 8 for
// single rows (a decode row's positions spread over more warps), 4 for tiles of 8 (on the 7B shape
// 8 warps and an unrolled key loop for tiles too made 512-token prefill 10% slower).
template <int QT, int DPL, int kAttnWarps = QT == 1 ? 8 : 4>
__global__ void __launch_bounds__(kAttnWarps * 32) attention_kernel(const float* q, int q_stride, const RowDesc* rows,
                                                                    const int2* tiles, int layer, int layers,
                                                                    int heads, int kv_heads, int head_dim,
                                                                    float scale, __nv_bfloat16* out) {
  const int h = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int2 tile = tiles[blockIdx.x];  // first row, row count
  const RowDesc first = rows[tile.x];
  const int p0 = first.position, n = tile.y, p_last = p0 + n - 1;
  const int kv_dim = kv_heads * head_dim, kvh = h / (heads / kv_heads);
  const size_t stride = size_t(layers) * 2 * kv_dim;  // between positions
  const __nv_bfloat16* kbase = first.kv + size_t(layer) * 2 * kv_dim + size_t(kvh) * head_dim;
  const __nv_bfloat16* vbase = kbase + kv_dim;

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

__global__ void swiglu_kernel(const float* gate, const float* up, int stride, int n, __nv_bfloat16* out) {
  const size_t r = blockIdx.y;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float g = gate[r * stride + i];
    out[r * n + i] = __float2bfloat16(g / (1.0f + expf(-g)) * up[r * stride + i]);
  }
}

}  // namespace

void embed_rows(const RowDesc* rows, int n_rows, int hidden, float* x, cudaStream_t stream) {
  if (n_rows == 0) return;
  embed_kernel<<<n_rows, 256, 0, stream>>>(rows, hidden, x);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

void add_rmsnorm(float* x, const float* add, const RowDesc* rows, const int* row_map, int n_out, int hidden,
                 int norm_offset, int bias_offset, float eps, __nv_bfloat16* out, cudaStream_t stream) {
  if (n_out == 0) return;
  add_rmsnorm_kernel<<<n_out, hidden >= 2048 ? 512 : 256, 0, stream>>>(x, add, rows, row_map, hidden, norm_offset,
                                                                        bias_offset, eps, out);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

void bias_rope_store(float* q, const float* k, const float* v, int q_stride, int kv_stride, const RowDesc* rows,
                     int n_rows, int layer, int layers, int heads, int kv_heads, int head_dim, int hidden,
                     const float* inv_freq, cudaStream_t stream) {
  if (n_rows == 0) return;
  bias_rope_store_kernel<<<n_rows, 256, 0, stream>>>(q, k, v, q_stride, kv_stride, rows, layer, layers, heads, kv_heads, head_dim,
                                                     hidden, inv_freq);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

void attention(const float* q, int q_stride, const RowDesc* rows, const int2* tiles, int n_tiles, int max_tile,
               int layer, int layers, int heads, int kv_heads, int head_dim, float scale, __nv_bfloat16* out,
               cudaStream_t stream) {
  if (n_tiles == 0) return;
  if (head_dim % 8 || head_dim > 256) fail("cuda::attention: head_dim ", head_dim, " (a multiple of 8, at most 256)");
  const dim3 grid{unsigned(n_tiles), unsigned(heads)};
  const int dpl = (head_dim + 31) / 32;
  auto go = [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    switch (dpl) {
#define BITDELTA_ATTN_CASE(D)                                                                                 \
  case D:                                                                                                     \
    attention_kernel<QT, D><<<grid, (QT == 1 ? 8 : 4) * 32, 0, stream>>>(q, q_stride, rows, tiles, layer, layers, heads, \
                                                                  kv_heads, head_dim, scale, out);            \
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
  if (max_tile <= 1)
    go(std::integral_constant<int, 1>{});
  else
    go(std::integral_constant<int, kAttnTile>{});
  BITDELTA_CUDA_CHECK_LAUNCH();
}

void swiglu(const float* gate, const float* up, int stride, int n_rows, int n, __nv_bfloat16* out,
            cudaStream_t stream) {
  if (n == 0 || n_rows == 0) return;
  const dim3 grid{unsigned(std::min((n + 255) / 256, 64)), unsigned(n_rows)};
  swiglu_kernel<<<grid, 256, 0, stream>>>(gate, up, stride, n, out);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

}  // namespace bitdelta::cuda
