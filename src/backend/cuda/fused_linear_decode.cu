#include "fused_linear_decode.cuh"

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>

#include "cuda_check.cuh"

namespace bitdelta::cuda {
namespace {

constexpr int kWarps = 8;        // warps per block
constexpr int kMaxRows = 16;     // rows of x per launch
constexpr int kKBlock = 64;      // columns per warp step (one packed sign block)
constexpr int kQMax = 32512;     // |q| bound: the high byte stays within ±127
constexpr int kMaxChunks = 2048;  // K ≤ 131072

// One variant's signs applied to the rows of x in one group of 4 (G): an int8 mma's B columns.
struct Slot {
  const uint32_t* signs;  // packed layout
  int G;                  // rows 4G..4G+3 of x
  uint32_t rows;          // bit i: row 4G + i uses this variant
};

struct DecodeParams {
  const __nv_bfloat16* w;
  const __nv_bfloat16* x;
  const uint4* xq;     // [KC][NG][32 lanes]: int8 B fragments of the quantized rows (16 bytes each)
  const float* xscale;  // [rows]
  const int* xsum;      // [rows][KC + 1]: prefix sums of q over the 64-column chunks
  float* y;
  int N, K, KC, rows, NG, k_split, slot_groups, nslots, aligned;
  // Warp group g of a tile takes slots [g·MAXS, g·MAXS + MAXS) (those below nslots).
  Slot slots[kMaxRows];
  const float* alpha[kMaxRows];  // per row of x; nullptr: no delta
  int alpha_per_row[kMaxRows];
};

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Programmatic dependent launch (sm_90): the decode kernel starts streaming W while the kernel that
// quantizes x still runs, and waits for it only before its first read of the quantized rows.
__device__ __forceinline__ void wait_for_prerequisite() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Weights are read once: bypass L1. Not volatile, so the compiler may batch all loads before first
// use.
__device__ __forceinline__ uint4 ldg_stream(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ldg_stream32(const void* p) {
  uint32_t v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

// Raw elements [k, k+8) and [k+16, k+24) of one bf16 row (zero past K on the checked path).
template <bool kStream>
__device__ __forceinline__ void load_raw(const __nv_bfloat16* row, int k, int K, bool aligned,
                                         uint4& e, uint4& f) {
  if (aligned) {
    e = kStream ? ldg_stream(row + k) : __ldg(reinterpret_cast<const uint4*>(row + k));
    f = kStream ? ldg_stream(row + k + 16) : __ldg(reinterpret_cast<const uint4*>(row + k + 16));
  } else {
    const uint16_t* r16 = reinterpret_cast<const uint16_t*>(row);
    uint32_t ew[4], fw[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int a = k + 2 * i, b = k + 16 + 2 * i;
      ew[i] = (a < K ? r16[a] : 0u) | ((a + 1 < K ? uint32_t(r16[a + 1]) : 0u) << 16);
      fw[i] = (b < K ? r16[b] : 0u) | ((b + 1 < K ? uint32_t(r16[b + 1]) : 0u) << 16);
    }
    e = make_uint4(ew[0], ew[1], ew[2], ew[3]);
    f = make_uint4(fw[0], fw[1], fw[2], fw[3]);
  }
}

// Pairs them: out[j] = (e[j], f[j]). This pairing is the bf16 mma's k order for this thread; x and W
// use the same one, so the dot is unchanged.
__device__ __forceinline__ void make_pairs(const uint4& e, const uint4& f, uint32_t (&out)[8]) {
  const uint32_t ew[4] = {e.x, e.y, e.z, e.w}, fw[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __byte_perm(ew[i], fw[i], 0x5410);
    out[2 * i + 1] = __byte_perm(ew[i], fw[i], 0x7632);
  }
}

// Warps of one 16-row tile split its work along K (k_split) and across slots (slot_groups of MAXS
// slots each; each group also does its share of the base); their partial results meet in shared
// memory.
template <int RG, int MAXS>
__global__ void __launch_bounds__(kWarps * 32, 2) decode_kernel(const DecodeParams p) {
  constexpr int kUnroll = 2;
  __shared__ float ytile[kWarps][kMaxRows][16];  // per warp: [row of x][row of the tile]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, t = lane & 3;
  const int warps_per_tile = p.k_split * p.slot_groups, tiles_per_block = kWarps / warps_per_tile;
  // Warps left over when warps_per_tile does not divide kWarps get no tile (n0 = N).
  const int n0 = warp < tiles_per_block * warps_per_tile
                     ? (blockIdx.x * tiles_per_block + warp / warps_per_tile) * 16
                     : p.N;
  const int in_tile = warp % warps_per_tile, kpart = in_tile % p.k_split,
            sgroup = in_tile / p.k_split;
  const Slot* slots = p.slots + sgroup * MAXS;
  const int nmine = min(MAXS, p.nslots - sgroup * MAXS);
  const int K = p.K, N = p.N;
  const int nA = min(n0 + gid, N - 1), nB = min(n0 + gid + 8, N - 1);
  const __nv_bfloat16* wA = p.w + size_t(nA) * K;
  const __nv_bfloat16* wB = p.w + size_t(nB) * K;
  const __nv_bfloat16* xrow[RG];
#pragma unroll
  for (int g = 0; g < RG; ++g) xrow[g] = p.x + size_t(min(g * 8 + gid, p.rows - 1)) * K;
  const int ci = (t & 1) + 4 * (t >> 1);  // this thread's 8-column chunks: ci and ci + 2 of each 64
  const bool aligned = p.aligned;
  // Per slot: this lane's packed sign word of block kb is signs[kb·32] (the tile's row group), its
  // int8 B fragment xq[kb·NG·32].
  const uint32_t* sgn[MAXS > 0 ? MAXS : 1];
  const uint4* xqf[MAXS > 0 ? MAXS : 1];
#pragma unroll
  for (int s = 0; s < MAXS; ++s) {
    const Slot& sl = slots[s < nmine ? s : 0];
    sgn[s] = sl.signs + size_t(min(n0, N - 1) / 16) * p.KC * 32 + lane;
    xqf[s] = p.xq + sl.G * 32 + lane;
  }

  float acc[RG][4] = {};
  int sacc[MAXS > 0 ? MAXS : 1][4] = {};
  // Each warp walks a contiguous range of 64-column blocks for its slots, kUnroll blocks per batch:
  // all loads of a batch are issued before the first is used (bytes in flight). The base of that
  // range is split again among the tile's slot groups: each warp also does W·x over its share
  // [bb_begin, bb_end), in the same batches (with one warp doing the whole base of a 16-variant
  // tile, too few of W's bytes were in flight).
  const int nkb = p.KC;
  const int kb_begin = nkb * kpart / p.k_split, kb_end = nkb * (kpart + 1) / p.k_split;
  const int kbs = kb_end - kb_begin;
  const int bb_begin = kb_begin + kbs * sgroup / p.slot_groups, bb_end = kb_begin + kbs * (sgroup + 1) / p.slot_groups;
  if (n0 < N) {
    for (int kb = kb_begin; kb < kb_end; kb += kUnroll) {
      uint4 we[kUnroll][2], wf[kUnroll][2], xe[kUnroll][RG], xf[kUnroll][RG];
      uint32_t sw[kUnroll][MAXS > 0 ? MAXS : 1];
      uint4 qb[kUnroll][MAXS > 0 ? MAXS : 1];
      // Block kb + u has base work (warp-uniform).
      const auto base = [&](int u) { return kb + u < kb_end && kb + u >= bb_begin && kb + u < bb_end; };
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int kbu = min(kb + u, kb_end - 1);
        const int k = kbu * kKBlock + 8 * ci;
        if (base(u)) {
          load_raw<true>(wA, k, K, aligned, we[u][0], wf[u][0]);
          load_raw<true>(wB, k, K, aligned, we[u][1], wf[u][1]);
#pragma unroll
          for (int g = 0; g < RG; ++g) load_raw<false>(xrow[g], k, K, aligned, xe[u][g], xf[u][g]);
        }
#pragma unroll
        for (int s = 0; s < MAXS; ++s) {
          if (s >= nmine) break;
          sw[u][s] = ldg_stream32(sgn[s] + size_t(kbu) * 32);
          if (kb == kb_begin && u == 0 && s == 0) wait_for_prerequisite();
          qb[u][s] = __ldcg(xqf[s] + size_t(kbu) * p.NG * 32);  // not .nc: written by the prerequisite
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (u > 0 && kb + u >= kb_end) break;
        if (base(u)) {
          uint32_t wa[8], wb[8], xb[RG][8];
#pragma unroll
          for (int g = 0; g < RG; ++g) make_pairs(xe[u][g], xf[u][g], xb[g]);
          make_pairs(we[u][0], wf[u][0], wa);
          make_pairs(we[u][1], wf[u][1], wb);
#pragma unroll
          for (int st = 0; st < 4; ++st) {
#pragma unroll
            for (int g = 0; g < RG; ++g)
              mma_bf16(acc[g], wa[2 * st], wb[2 * st], wa[2 * st + 1], wb[2 * st + 1], xb[g][2 * st],
                       xb[g][2 * st + 1]);
          }
        }
        // Delta: the signs as 0/1 bytes (one shift and one AND per 4) against the quantized rows of
        // the slot's group (all 4; the epilogue keeps the columns of the slot's rows).
#pragma unroll
        for (int s = 0; s < MAXS; ++s) {
          if (s >= nmine) break;
          const uint32_t word = sw[u][s];
          uint32_t a[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) a[j] = (word >> j) & 0x01010101u;
          mma_s8(sacc[s], a[0], a[1], a[2], a[3], qb[u][s].x, qb[u][s].y);
          mma_s8(sacc[s], a[4], a[5], a[6], a[7], qb[u][s].z, qb[u][s].w);
        }
      }
    }
  }
  // This warp's partial y [row of x][row of the tile]: base, then α·scale·(2·Σb·q − Σq) over its
  // K range for its slots' rows.
  float* yw = &ytile[warp][0][0];
#pragma unroll
  for (int i = 0; i < 8; ++i) yw[lane + 32 * i] = 0.0f;
  __syncwarp();
#pragma unroll
  for (int g = 0; g < RG; ++g)
#pragma unroll
    for (int i = 0; i < 4; ++i) yw[(8 * g + 2 * t + (i & 1)) * 16 + gid + 8 * (i >> 1)] = acc[g][i];
  __syncwarp();
  if (MAXS > 0) wait_for_prerequisite();  // (again: a no-op once waited; warps without K blocks)
  if (n0 < N)
#pragma unroll
    for (int s = 0; s < MAXS; ++s) {
      if (s >= nmine) break;
      const Slot& sl = slots[s];
      if (!((sl.rows >> t) & 1)) continue;
      const int r = 4 * sl.G + t;
      const long long sum_q = __ldcg(p.xsum + r * (p.KC + 1) + kb_end) - __ldcg(p.xsum + r * (p.KC + 1) + kb_begin);
      const float scale = __ldcg(p.xscale + r);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int nl = gid + 8 * h, n = n0 + nl;
        if (n >= N) continue;
        const long long bq = 256LL * sacc[s][2 * h] + sacc[s][2 * h + 1];
        yw[r * 16 + nl] += __ldg(p.alpha[r] + (p.alpha_per_row[r] ? n : 0)) * scale * float(2 * bq - sum_q);
      }
    }
  // Sum the tile's warps, then write y[r][n].
  __syncthreads();
  if (in_tile != 0 || n0 >= N) return;
  for (int e = lane; e < p.rows * 16; e += 32) {
    const int r = e >> 4, nl = e & 15, n = n0 + nl;
    if (n >= N) continue;
    float v = 0.0f;
    for (int q = 0; q < warps_per_tile; ++q) v += ytile[warp + q][r][nl];
    p.y[size_t(r) * N + n] = v;
  }
}

template <int RG, int MAXS>
void launch(const DecodeParams& p, bool dependent_launch, cudaStream_t stream) {
  const int tiles = (p.N + 15) / 16, tiles_per_block = kWarps / (p.k_split * p.slot_groups);
  const int blocks = (tiles + tiles_per_block - 1) / tiles_per_block;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(blocks));
  cfg.blockDim = dim3(kWarps * 32);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = MAXS > 0 && dependent_launch ? 1 : 0;  // the quantizing kernel precedes it
  BITDELTA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, decode_kernel<RG, MAXS>, p));
}

// Slots per warp: 1 or 2; more slots go to more warps of the tile (slot_groups), which keeps each
// warp within 128 registers (two blocks per multiprocessor) without spills (4 slots spilled).
template <int RG>
void launch_slots(DecodeParams& p, bool dependent_launch, cudaStream_t stream) {
  const int per_warp = p.nslots == 0 ? 0 : p.nslots == 1 ? 1 : 2;
  p.slot_groups = per_warp == 0 ? 1 : (p.nslots + per_warp - 1) / per_warp;
  p.k_split = std::max(1, std::min(p.k_split, kWarps / p.slot_groups));
  if (per_warp == 0) return launch<RG, 0>(p, dependent_launch, stream);
  if (per_warp == 1) return launch<RG, 1>(p, dependent_launch, stream);
  launch<RG, 2>(p, dependent_launch, stream);
}

// One block per padded row of x (4·NG rows): scale, the int8 fragments and prefix sums of q per
// 64-column chunk. A thread quantizes 4 consecutive columns: one byte of 4 in each of two fragment
// words (high and low parts), stored whole.
constexpr int kPrepThreads = 1024;
__global__ void __launch_bounds__(kPrepThreads) prepare_x_kernel(const __nv_bfloat16* x, int rows, int K, int KC,
                                                                 int NG, uint32_t* xq, float* xscale, int* xsum) {
  __shared__ float red[kPrepThreads / 32];
  __shared__ int chunk_sum[kMaxChunks];
  allow_dependent_launch();
  const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool real = r < rows;
  const __nv_bfloat16* xr = x + size_t(min(r, rows - 1)) * K;
  float m = 0.0f;
  if (real)
    for (int k = tid; k < K; k += kPrepThreads) m = fmaxf(m, fabsf(__bfloat162float(xr[k])));
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = 0.0f;
  for (int i = 0; i < kPrepThreads / 32; ++i) m = fmaxf(m, red[i]);
  const float inv = m > 0.0f ? float(kQMax) / m : 0.0f;
  if (real && tid == 0) xscale[r] = m / float(kQMax);
  const int G = r >> 2, rr = r & 3;
  const int quads = KC * 16;
  for (int quad = tid; quad < (quads + 31) / 32 * 32; quad += kPrepThreads) {  // whole warps iterate
    const int k = 4 * quad;
    const bool valid = quad < quads;
    uint32_t hw = 0, lw = 0;
    int sum = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float v = real && k + e < K ? __bfloat162float(xr[k + e]) : 0.0f;
      const int q = __float2int_rn(v * inv);
      const int hi = (q + 128) >> 8, lo = q - 256 * hi;
      hw |= uint32_t(hi & 0xFF) << (8 * e);
      lw |= uint32_t(lo & 0xFF) << (8 * e);
      sum += q;
    }
    // Fragment word of (row, columns k..k+3): lane 4·(2·rr + part) + tt, word 2·mm + bi.
    const int kc = k / kKBlock, kk = k % kKBlock, mm = kk >> 5, bi = (kk >> 4) & 1, tt = (kk & 15) >> 2;
    const size_t base = (size_t(kc) * NG + G) * 32;
    if (valid) {
      xq[(base + 4 * (2 * rr) + tt) * 4 + 2 * mm + bi] = hw;
      xq[(base + 4 * (2 * rr + 1) + tt) * 4 + 2 * mm + bi] = lw;
    }
    // The 16 quads of a chunk are 16 consecutive lanes.
    for (int o = 8; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (valid && (lane & 15) == 0) chunk_sum[kc] = sum;
  }
  __syncthreads();
  if (!real || warp != 0) return;
  int carry = 0;  // prefix sums, 32 chunks at a time
  if (lane == 0) xsum[r * (KC + 1)] = 0;
  for (int c0 = 0; c0 < KC; c0 += 32) {
    int v = c0 + lane < KC ? chunk_sum[c0 + lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += n;
    }
    if (c0 + lane < KC) xsum[r * (KC + 1) + c0 + lane + 1] = carry + v;
    carry += __shfl_sync(0xffffffffu, v, 31);
  }
}

__global__ void pack_signs_kernel(const uint8_t* raw, int N, int K, int KC, size_t words, uint32_t* out) {
  const size_t idx = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= words) return;
  const size_t blk = idx >> 5;
  out[idx] = packed_sign_word(raw, N, K, int(blk / KC), int(blk % KC), int(idx & 31));
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// What a launch keeps per device: whether it may start early (programmatic dependent launch needs
// sm_90; the portable build runs elsewhere without it) and, per stream, the scratch for the quantized
// rows of x, grown on demand and kept: calls on one stream reuse it in stream order.
struct DeviceState {
  bool dependent_launch = false;
  struct Buffer {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  std::map<cudaStream_t, Buffer> scratch;
};

// The current device's state and, when bytes > 0, a scratch buffer of at least that size on stream.
std::pair<bool, void*> device_state(cudaStream_t stream, size_t bytes) {
  static std::mutex mutex;
  static std::map<int, DeviceState> states;
  int dev = 0;
  BITDELTA_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard lock(mutex);
  auto [it, fresh] = states.try_emplace(dev);
  DeviceState& d = it->second;
  if (fresh) {
    int major = 0;
    BITDELTA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    d.dependent_launch = major >= 9;
  }
  if (bytes == 0) return {d.dependent_launch, nullptr};
  DeviceState::Buffer& b = d.scratch[stream];
  if (b.bytes < bytes) {
    if (b.ptr) {
      BITDELTA_CUDA_CHECK(cudaStreamSynchronize(stream));
      BITDELTA_CUDA_CHECK(cudaFree(b.ptr));
    }
    b.bytes = std::max(bytes, size_t(1) << 20);
    BITDELTA_CUDA_CHECK(cudaMalloc(&b.ptr, b.bytes));
  }
  return {d.dependent_launch, b.ptr};
}

}  // namespace

size_t packed_signs_bytes(int N, int K) { return packed_sign_words(N, K) * 4; }

void pack_signs(const uint8_t* raw, int N, int K, uint8_t* packed, cudaStream_t stream) {
  if (N < 1 || K < 1) fail("cuda::pack_signs: empty shape [", N, ", ", K, "]");
  if (!aligned16(packed)) fail("cuda::pack_signs: output not 16-byte aligned");
  const size_t words = packed_sign_words(N, K);
  pack_signs_kernel<<<unsigned((words + 255) / 256), 256, 0, stream>>>(raw, N, K, (K + kKBlock - 1) / kKBlock, words,
                                                                       reinterpret_cast<uint32_t*>(packed));
  BITDELTA_CUDA_CHECK_LAUNCH();
}

void fused_linear_decode(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows,
                         std::span<const DeltaRef> deltas, float* y, cudaStream_t stream,
                         const DecodeOptions& options) {
  if (rows < 1 || rows > kMaxRows)
    fail("cuda::fused_linear_decode: ", rows, " rows (1..", kMaxRows, " allowed)");
  if (int(deltas.size()) != rows)
    fail("cuda::fused_linear_decode: ", deltas.size(), " deltas for ", rows, " rows");
  if (N < 1 || K < 1) fail("cuda::fused_linear_decode: empty weight [", N, ", ", K, "]");
  const int KC = (K + kKBlock - 1) / kKBlock;
  if (KC > kMaxChunks) fail("cuda::fused_linear_decode: K = ", K, " (at most ", kMaxChunks * kKBlock, ")");
  int k_split = options.k_split;
  if (k_split == 0) k_split = decode_default_k_split(N);
  if (k_split != 1 && k_split != 2 && k_split != 4 && k_split != 8)
    fail("cuda::fused_linear_decode: k_split ", k_split, " (1, 2, 4 or 8)");
  DecodeParams p{};
  p.w = w;
  p.x = x;
  p.y = y;
  p.N = N;
  p.K = K;
  p.KC = KC;
  p.rows = rows;
  p.k_split = k_split;
  // The vector path needs whole 64-column blocks and 16-byte aligned rows.
  p.aligned = K % kKBlock == 0 && aligned16(w) && aligned16(x);
  // Slots: one per distinct variant and group of 4 rows of x (rows that share signs share alpha).
  const void* signs_of_row[kMaxRows] = {};
  for (int r = 0; r < rows; ++r) {
    const DeltaRef& d = deltas[r];
    if (!d.signs) continue;
    if (!d.alpha) fail("cuda::fused_linear_decode: row ", r, " has signs but no alpha");
    if (!aligned16(d.signs)) fail("cuda::fused_linear_decode: row ", r, "'s packed signs are not 16-byte aligned");
    for (int q = 0; q < r; ++q)
      if (signs_of_row[q] == d.signs && (p.alpha[q] != d.alpha || p.alpha_per_row[q] != int(d.alpha_per_row)))
        fail("cuda::fused_linear_decode: rows share signs ", d.signs, " but not alpha");
    signs_of_row[r] = d.signs;
    p.alpha[r] = d.alpha;
    p.alpha_per_row[r] = d.alpha_per_row ? 1 : 0;
    const auto* sg = reinterpret_cast<const uint32_t*>(d.signs);
    int s = 0;
    while (s < p.nslots && !(p.slots[s].signs == sg && p.slots[s].G == r / 4)) ++s;
    if (s == p.nslots) p.slots[p.nslots++] = Slot{sg, r / 4, 0};
    p.slots[s].rows |= 1u << (r % 4);
  }
  // The rows of x quantized for the delta term go to a scratch buffer of this stream.
  p.NG = p.nslots ? (rows + 3) / 4 : 0;
  const size_t xq_bytes = size_t(KC) * p.NG * 512, scale_off = xq_bytes, sum_off = scale_off + 64;
  const auto [dependent_launch, scratch] =
      device_state(stream, p.nslots ? sum_off + size_t(rows) * (KC + 1) * 4 : 0);
  if (p.nslots) {
    auto* base = static_cast<char*>(scratch);
    p.xq = reinterpret_cast<const uint4*>(base);
    p.xscale = reinterpret_cast<const float*>(base + scale_off);
    p.xsum = reinterpret_cast<const int*>(base + sum_off);
    prepare_x_kernel<<<unsigned(4 * p.NG), kPrepThreads, 0, stream>>>(x, rows, K, KC, p.NG, reinterpret_cast<uint32_t*>(base),
                                                          reinterpret_cast<float*>(base + scale_off),
                                                          reinterpret_cast<int*>(base + sum_off));
    BITDELTA_CUDA_CHECK_LAUNCH();
  }
  if (rows <= 8)
    launch_slots<1>(p, dependent_launch, stream);
  else
    launch_slots<2>(p, dependent_launch, stream);
}

int decode_default_k_split(int) {
  // Measured (bench/cuda/NOTES.md, run 5 with v6, run 18 with v8): k_split 8 was fastest or within
  // 2% at every benchmark shape, N = 4096..28672: more warps per tile keep more bytes in flight.
  return kWarps;
}

}  // namespace bitdelta::cuda
