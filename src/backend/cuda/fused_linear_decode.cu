#include "fused_linear_decode.cuh"

#include <algorithm>
#include <cstdint>

#include "cuda_check.cuh"

namespace bitdelta::cuda {
namespace {

constexpr int kWarps = 8;     // warps per block
constexpr int kMaxRows = 16;  // rows of x per launch
constexpr int kKBlock = 64;   // columns per warp step

// A slot is one variant's sign bits applied to one group of 8 rows of x (an mma's N dimension).
struct Slot {
  const uint8_t* signs;
  const float* alpha;
  int alpha_per_row;
  int group;
};

struct DecodeParams {
  const __nv_bfloat16* w;
  const __nv_bfloat16* x;
  float* y;
  int N, K, rows, k_split, slot_groups, nslots, aligned;
  // slot_groups · MAXS entries; those past nslots repeat a real one (and are never matched).
  Slot slots[kMaxRows];
  int8_t slot_of_row[kMaxRows];  // -1: no delta
};

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
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

// Pairs them: out[j] = (e[j], f[j]). This pairing is the mma's k order for this thread; x and W use
// the same one, so the dot is unchanged.
__device__ __forceinline__ void make_pairs(const uint4& e, const uint4& f, uint32_t (&out)[8]) {
  const uint32_t ew[4] = {e.x, e.y, e.z, e.w}, fw[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __byte_perm(ew[i], fw[i], 0x5410);
    out[2 * i + 1] = __byte_perm(ew[i], fw[i], 0x7632);
  }
}

// The 32 sign bits of columns [k0 + 32h, k0 + 32h + 32) of one row (h = t >> 1), moved so that this
// thread's bits (bytes t&1 and (t&1)+2) sit at bits 8..15 and 24..31.
__device__ __forceinline__ uint32_t load_sign_word(const uint8_t* row, int byte, int row_bytes,
                                                   bool aligned, int t) {
  uint32_t w;
  if (aligned) {
    w = __ldg(reinterpret_cast<const uint32_t*>(row + byte));
  } else {
    w = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (byte + i < row_bytes) w |= uint32_t(row[byte + i]) << (8 * i);
  }
  return (t & 1) ? w : w << 8;
}

// Pair j of the thread's 16 columns as ±1 bf16: bit 8+j → sign of the low half, bit 24+j → high
// half.
template <int j>
__device__ __forceinline__ uint32_t sign_pair(uint32_t w) {
  return 0xBF80BF80u ^ ((w << (7 - j)) & 0x80008000u);
}

// Warps of one 16-row tile split its work along K (k_split) and across slots (slot_groups of MAXS
// slots each; the first group also does the base); their partial sums meet in shared memory.
template <int RG, int MAXS>
__global__ void __launch_bounds__(kWarps * 32, 2) decode_kernel(const DecodeParams p) {
  constexpr int kUnroll = 2;
  __shared__ float partial[kWarps][RG * 4][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, t = lane & 3;
  const int warps_per_tile = p.k_split * p.slot_groups, tiles_per_block = kWarps / warps_per_tile;
  // Warps left over when warps_per_tile does not divide kWarps get no tile (n0 = N).
  const int n0 = warp < tiles_per_block * warps_per_tile
                     ? (blockIdx.x * tiles_per_block + warp / warps_per_tile) * 16
                     : p.N;
  const int in_tile = warp % warps_per_tile, kpart = in_tile % p.k_split,
            sgroup = in_tile / p.k_split;
  const Slot* slots = p.slots + sgroup * MAXS;
  const bool do_base = sgroup == 0;
  const int K = p.K, N = p.N;
  const int nA = min(n0 + gid, N - 1), nB = min(n0 + gid + 8, N - 1);
  const __nv_bfloat16* wA = p.w + size_t(nA) * K;
  const __nv_bfloat16* wB = p.w + size_t(nB) * K;
  const __nv_bfloat16* xrow[RG];
#pragma unroll
  for (int g = 0; g < RG; ++g) xrow[g] = p.x + size_t(min(g * 8 + gid, p.rows - 1)) * K;
  const int row_bytes = (K + 7) / 8;
  const int ci = (t & 1) + 4 * (t >> 1);  // this thread's 8-column chunks: ci and ci + 2 of each 64
  const bool aligned = p.aligned;

  float acc[RG][4] = {};
  float sacc[MAXS > 0 ? MAXS : 1][4] = {};
  // Each warp walks a contiguous range of 64-column blocks, kUnroll blocks per batch: all loads of
  // a batch are issued before the first is used (bytes in flight), and consecutive sign words of a
  // row share their L1 line.
  const int nkb = (K + kKBlock - 1) / kKBlock;
  const int kb_begin = nkb * kpart / p.k_split, kb_end = nkb * (kpart + 1) / p.k_split;
  if (n0 < N) {
    for (int kb = kb_begin; kb < kb_end; kb += kUnroll) {
      uint4 we[kUnroll][2], wf[kUnroll][2], xe[kUnroll][RG], xf[kUnroll][RG];
      uint32_t sw[kUnroll][MAXS > 0 ? MAXS : 1][2];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int kbu = min(kb + u, kb_end - 1);
        const int k = kbu * kKBlock + 8 * ci;
        if (do_base) {
          load_raw<true>(wA, k, K, aligned, we[u][0], wf[u][0]);
          load_raw<true>(wB, k, K, aligned, we[u][1], wf[u][1]);
        }
#pragma unroll
        for (int g = 0; g < RG; ++g) load_raw<false>(xrow[g], k, K, aligned, xe[u][g], xf[u][g]);
        const int byte = kbu * (kKBlock / 8) + 4 * (t >> 1);
#pragma unroll
        for (int s = 0; s < MAXS; ++s) {
          const uint8_t* sg = slots[s].signs;
          sw[u][s][0] = load_sign_word(sg + size_t(nA) * row_bytes, byte, row_bytes, aligned, t);
          sw[u][s][1] = load_sign_word(sg + size_t(nB) * row_bytes, byte, row_bytes, aligned, t);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (u > 0 && kb + u >= kb_end) break;
        uint32_t wa[8], wb[8], xb[RG][8];
#pragma unroll
        for (int g = 0; g < RG; ++g) make_pairs(xe[u][g], xf[u][g], xb[g]);
        if (do_base) {
          make_pairs(we[u][0], wf[u][0], wa);
          make_pairs(we[u][1], wf[u][1], wb);
#pragma unroll
          for (int st = 0; st < 4; ++st) {
#pragma unroll
            for (int g = 0; g < RG; ++g)
              mma_bf16(acc[g], wa[2 * st], wb[2 * st], wa[2 * st + 1], wb[2 * st + 1],
                       xb[g][2 * st], xb[g][2 * st + 1]);
          }
        }
#pragma unroll
        for (int s = 0; s < MAXS; ++s) {
          const uint32_t swA = sw[u][s][0], swB = sw[u][s][1];
          const uint32_t sa[8] = {sign_pair<0>(swA), sign_pair<1>(swA), sign_pair<2>(swA),
                                  sign_pair<3>(swA), sign_pair<4>(swA), sign_pair<5>(swA),
                                  sign_pair<6>(swA), sign_pair<7>(swA)};
          const uint32_t sb[8] = {sign_pair<0>(swB), sign_pair<1>(swB), sign_pair<2>(swB),
                                  sign_pair<3>(swB), sign_pair<4>(swB), sign_pair<5>(swB),
                                  sign_pair<6>(swB), sign_pair<7>(swB)};
          if (RG == 1 || slots[s].group == 0) {
#pragma unroll
            for (int st = 0; st < 4; ++st)
              mma_bf16(sacc[s], sa[2 * st], sb[2 * st], sa[2 * st + 1], sb[2 * st + 1],
                       xb[0][2 * st], xb[0][2 * st + 1]);
          } else {
#pragma unroll
            for (int st = 0; st < 4; ++st)
              mma_bf16(sacc[s], sa[2 * st], sb[2 * st], sa[2 * st + 1], sb[2 * st + 1],
                       xb[RG - 1][2 * st], xb[RG - 1][2 * st + 1]);
          }
        }
      }
    }
    // α ⊙ (S·x) into the columns (rows of x) that belong to each slot.
#pragma unroll
    for (int s = 0; s < MAXS; ++s) {
      const Slot& sl = slots[s];
      const float aA = __ldg(sl.alpha + (sl.alpha_per_row ? nA : 0));
      const float aB = __ldg(sl.alpha + (sl.alpha_per_row ? nB : 0));
#pragma unroll
      for (int g = 0; g < RG; ++g) {
        if (sl.group != g) continue;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int r = g * 8 + 2 * t + j;
          if (r < p.rows && p.slot_of_row[r] == sgroup * MAXS + s) {
            acc[g][j] += aA * sacc[s][j];
            acc[g][2 + j] += aB * sacc[s][2 + j];
          }
        }
      }
    }
  }
  // Sum the k_split partial results of each tile, then write y[r][n].
#pragma unroll
  for (int g = 0; g < RG; ++g)
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][g * 4 + i][lane] = acc[g][i];
  __syncthreads();
  if (in_tile != 0 || n0 >= N) return;
#pragma unroll
  for (int g = 0; g < RG; ++g)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float v = 0.0f;
      for (int q = 0; q < warps_per_tile; ++q) v += partial[warp + q][g * 4 + i][lane];
      const int r = g * 8 + 2 * t + (i & 1), n = n0 + gid + 8 * (i >> 1);
      if (r < p.rows && n < N) p.y[size_t(r) * N + n] = v;
    }
}

template <int RG, int MAXS>
void launch(const DecodeParams& p, cudaStream_t stream) {
  const int tiles = (p.N + 15) / 16, tiles_per_block = kWarps / (p.k_split * p.slot_groups);
  const int blocks = (tiles + tiles_per_block - 1) / tiles_per_block;
  decode_kernel<RG, MAXS><<<blocks, kWarps * 32, 0, stream>>>(p);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

// Slots per warp: 1, 2 or (one group of x rows) 4; more slots go to more warps of the tile
// (slot_groups), which keeps each warp within 128 registers: two blocks per multiprocessor, no
// spills.
template <int RG>
void launch_slots(DecodeParams& p, cudaStream_t stream) {
  const int per_warp = p.nslots == 0 ? 0 : p.nslots == 1 ? 1 : (p.nslots == 2 || RG == 2) ? 2 : 4;
  p.slot_groups = per_warp == 0 ? 1 : (p.nslots + per_warp - 1) / per_warp;
  p.k_split = std::max(1, std::min(p.k_split, kWarps / p.slot_groups));
  for (int s = p.nslots; s < p.slot_groups * per_warp; ++s) p.slots[s] = p.slots[p.nslots - 1];
  if (per_warp == 0) return launch<RG, 0>(p, stream);
  if (per_warp == 1) return launch<RG, 1>(p, stream);
  if (per_warp == 2 || RG == 2) return launch<RG, 2>(p, stream);
  if constexpr (RG == 1) launch<RG, 4>(p, stream);
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

}  // namespace

int decode_default_k_split(int) {
  // Measured (bench/cuda/NOTES.md, run 5): k_split 8 was fastest or within noise at every benchmark
  // shape, N = 4096..28672: more warps per tile keep more bytes in flight.
  return kWarps;
}

void fused_linear_decode(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows,
                         std::span<const DeltaRef> deltas, float* y, cudaStream_t stream,
                         const DecodeOptions& options) {
  int k_split = options.k_split;
  if (rows < 1 || rows > kMaxRows)
    fail("cuda::fused_linear_decode: ", rows, " rows (1..", kMaxRows, " allowed)");
  if (int(deltas.size()) != rows)
    fail("cuda::fused_linear_decode: ", deltas.size(), " deltas for ", rows, " rows");
  if (N < 1 || K < 1) fail("cuda::fused_linear_decode: empty weight [", N, ", ", K, "]");
  if (k_split == 0) k_split = decode_default_k_split(N);
  if (k_split != 1 && k_split != 2 && k_split != 4 && k_split != 8)
    fail("cuda::fused_linear_decode: k_split ", k_split, " (1, 2, 4 or 8)");
  DecodeParams p{};
  p.w = w;
  p.x = x;
  p.y = y;
  p.N = N;
  p.K = K;
  p.rows = rows;
  p.k_split = k_split;
  // The vector path needs whole 64-column blocks, 16-byte aligned rows and 4-byte aligned sign
  // words.
  bool aligned = K % kKBlock == 0 && aligned16(w) && aligned16(x);
  for (int r = 0; r < rows; ++r) {
    p.slot_of_row[r] = -1;
    const DeltaRef& d = deltas[r];
    if (!d.signs) continue;
    if (!d.alpha) fail("cuda::fused_linear_decode: row ", r, " has signs but no alpha");
    aligned = aligned && (reinterpret_cast<uintptr_t>(d.signs) & 3) == 0;
    const int group = r / 8;
    int s = 0;
    while (s < p.nslots && !(p.slots[s].signs == d.signs && p.slots[s].group == group)) ++s;
    if (s == p.nslots) {
      p.slots[p.nslots++] = Slot{d.signs, d.alpha, d.alpha_per_row ? 1 : 0, group};
    } else if (p.slots[s].alpha != d.alpha || p.slots[s].alpha_per_row != int(d.alpha_per_row)) {
      fail("cuda::fused_linear_decode: rows share signs ", static_cast<const void*>(d.signs),
           " but not alpha");
    }
    p.slot_of_row[r] = int8_t(s);
  }
  p.aligned = aligned ? 1 : 0;
  if (rows <= 8)
    launch_slots<1>(p, stream);
  else
    launch_slots<2>(p, stream);
}

}  // namespace bitdelta::cuda
