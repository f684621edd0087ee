#include "ops.cuh"

#include <cmath>

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

constexpr int kAttnWarps = 8;

// One block per (row, head); its warps take every kAttnWarps-th position, each lane DPL dims of
// the head, with an online softmax per warp; the warps' partial results are merged at the end.
template <int DPL>
__global__ void __launch_bounds__(kAttnWarps * 32) attention_kernel(const float* q, int q_stride, const RowDesc* rows, int layer,
                                                                    int layers, int heads, int kv_heads,
                                                                    int head_dim, float scale,
                                                                    __nv_bfloat16* out) {
  const int r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const RowDesc row = rows[r];
  const int kv_dim = kv_heads * head_dim, kvh = h / (heads / kv_heads);
  const size_t stride = size_t(layers) * 2 * kv_dim;  // between positions
  const __nv_bfloat16* kbase = row.kv + size_t(layer) * 2 * kv_dim + size_t(kvh) * head_dim;
  const __nv_bfloat16* vbase = kbase + kv_dim;
  float qr[DPL], acc[DPL];
  for (int j = 0; j < DPL; ++j) {
    const int d = lane + 32 * j;
    qr[j] = d < head_dim ? q[size_t(r) * q_stride + size_t(h) * head_dim + d] * scale : 0.0f;
    acc[j] = 0;
  }
  float m = -INFINITY, l = 0;
  // kInFlight positions per trip: their keys and values are loaded before any reduction waits, so
  // a warp keeps that many loads outstanding (decode at batch 1 is latency-bound otherwise).
  constexpr int kInFlight = 4;
  for (int t0 = warp; t0 <= row.position; t0 += kInFlight * kAttnWarps) {
    float s[kInFlight], kv[kInFlight][DPL], vv[kInFlight][DPL];
    for (int u = 0; u < kInFlight; ++u) {
      const int t = min(t0 + u * kAttnWarps, row.position);  // past the end: a repeat, masked below
      const __nv_bfloat16* kp = kbase + size_t(t) * stride;
      const __nv_bfloat16* vp = vbase + size_t(t) * stride;
      for (int j = 0; j < DPL; ++j) {
        const int d = lane + 32 * j;
        kv[u][j] = d < head_dim ? __bfloat162float(kp[d]) : 0.0f;
        vv[u][j] = d < head_dim ? __bfloat162float(vp[d]) : 0.0f;
      }
    }
    for (int u = 0; u < kInFlight; ++u) {
      s[u] = 0;
      for (int j = 0; j < DPL; ++j) s[u] += qr[j] * kv[u][j];
    }
    for (int o = 16; o > 0; o >>= 1)
      for (int u = 0; u < kInFlight; ++u) s[u] += __shfl_xor_sync(0xffffffffu, s[u], o);
    float mn = m;
    for (int u = 0; u < kInFlight; ++u)
      if (t0 + u * kAttnWarps <= row.position) mn = fmaxf(mn, s[u]);
    const float c = expf(m - mn);
    l *= c;
    for (int j = 0; j < DPL; ++j) acc[j] *= c;
    for (int u = 0; u < kInFlight; ++u) {
      const float p = t0 + u * kAttnWarps <= row.position ? expf(s[u] - mn) : 0.0f;
      l += p;
      for (int j = 0; j < DPL; ++j) acc[j] += p * vv[u][j];
    }
    m = mn;
  }

  __shared__ float sm_m[kAttnWarps], sm_l[kAttnWarps];
  __shared__ float sm_acc[kAttnWarps][DPL * 32];
  if (lane == 0) sm_m[warp] = m, sm_l[warp] = l;
  for (int j = 0; j < DPL; ++j) sm_acc[warp][lane + 32 * j] = acc[j];
  __syncthreads();
  float mx = -INFINITY;
  for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, sm_m[w]);
  float total = 0;
  for (int w = 0; w < kAttnWarps; ++w) total += sm_m[w] == -INFINITY ? 0.0f : sm_l[w] * expf(sm_m[w] - mx);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float sum = 0;
    for (int w = 0; w < kAttnWarps; ++w)
      if (sm_m[w] != -INFINITY) sum += sm_acc[w][d] * expf(sm_m[w] - mx);
    out[(size_t(r) * heads + h) * head_dim + d] = __float2bfloat16(sum / total);
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

void attention(const float* q, int q_stride, const RowDesc* rows, int n_rows, int layer, int layers, int heads,
               int kv_heads, int head_dim, float scale, __nv_bfloat16* out, cudaStream_t stream) {
  if (n_rows == 0) return;
  const dim3 grid{unsigned(n_rows), unsigned(heads)};
  const int dpl = (head_dim + 31) / 32;
  switch (dpl) {
#define BITDELTA_ATTN_CASE(D)                                                                                   \
  case D:                                                                                                       \
    attention_kernel<D><<<grid, kAttnWarps * 32, 0, stream>>>(q, q_stride, rows, layer, layers, heads, kv_heads, head_dim, \
                                                              scale, out);                                      \
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
    default:
      fail("cuda::attention: head_dim ", head_dim, " (at most 256 supported)");
  }
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
