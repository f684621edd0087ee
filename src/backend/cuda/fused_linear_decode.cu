#include "fused_linear_decode.cuh"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "cuda_check.cuh"
#include "delta_b1.cuh"
#include "delta_terms.cuh"
#include "fused_linear_stream.cuh"
#include "launch.cuh"
#include "mma.cuh"
#include "stream_scratch.cuh"
#include "tma.cuh"

namespace bitdelta::cuda {
namespace {

constexpr int kWarps = 8;        // warps per block
constexpr int kMaxRows = kRegisterKernelRows;  // rows of x per launch
constexpr int kKBlock = 64;      // base: columns per mma step
constexpr int kDBlock = kSignBlockCols;  // delta: columns per 1-bit mma step (4 base steps)

// One variant's signs applied to rows of x: row0 + i for the bits i (< RS) of mask.
struct Slot {
  const uint4* signs;  // packed layout: 32 lanes × 16 bytes per (16-row tile, 256-column block)
  int row0;
  uint32_t mask;
};

struct DecodeParams {
  const __nv_bfloat16* w;
  const __nv_bfloat16* x;
  const uint8_t* xq;  // the quantized rows, xq_block bytes per 256-column block (quantized_x_block)
  int xq_block;
  float* y;
  int N, K, KB, rows, k_split, slot_groups, nslots, aligned;
  int base_warps;  // per tile: warps that do the base alone (SPEC kernels), else 0
  // Warp group g of a tile takes slots [g·MAXS, g·MAXS + MAXS) (those below nslots).
  Slot slots[kMaxRows];
  const float* alpha[kMaxRows];  // per row of x; nullptr: no delta
  int alpha_per_row[kMaxRows];
};

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

// Step u of kU 64-column steps from column k0 on (steps past K are skipped by the callers): W's
// (rows wA, wB: this lane's rows of the tile) and x's.
template <int kU>
__device__ __forceinline__ void load_w_step(const __nv_bfloat16* wA, const __nv_bfloat16* wB, int u, int k, int K,
                                            bool aligned, uint4 (&we)[kU][2], uint4 (&wf)[kU][2]) {
  load_raw<true>(wA, k, K, aligned, we[u][0], wf[u][0]);
  load_raw<true>(wB, k, K, aligned, we[u][1], wf[u][1]);
}
template <int RG, int kU>
__device__ __forceinline__ void load_x_step(const __nv_bfloat16* const (&xrow)[RG], int u, int k, int K, bool aligned,
                                            uint4 (&xe)[kU][RG], uint4 (&xf)[kU][RG]) {
#pragma unroll
  for (int g = 0; g < RG; ++g) load_raw<false>(xrow[g], k, K, aligned, xe[u][g], xf[u][g]);
}
// A batch of kU steps: W's and x's step by step (load_base: the loads of a batch, then its mma), or
// W's alone (load_w) and x's alone (load_x), for the one-row kernel, which loads W before its wait.
template <int RG, int kU>
__device__ __forceinline__ void load_base(const __nv_bfloat16* wA, const __nv_bfloat16* wB,
                                          const __nv_bfloat16* const (&xrow)[RG], int k0, int K, int ci,
                                          bool aligned, uint4 (&we)[kU][2], uint4 (&wf)[kU][2],
                                          uint4 (&xe)[kU][RG], uint4 (&xf)[kU][RG]) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    if (k0 + u * kKBlock >= K) break;
    const int k = k0 + u * kKBlock + 8 * ci;
    load_w_step<kU>(wA, wB, u, k, K, aligned, we, wf);
    load_x_step<RG, kU>(xrow, u, k, K, aligned, xe, xf);
  }
}
template <int kU>
__device__ __forceinline__ void load_w(const __nv_bfloat16* wA, const __nv_bfloat16* wB, int k0, int K, int ci,
                                       bool aligned, uint4 (&we)[kU][2], uint4 (&wf)[kU][2]) {
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (k0 + u * kKBlock < K) load_w_step<kU>(wA, wB, u, k0 + u * kKBlock + 8 * ci, K, aligned, we, wf);
}
template <int RG, int kU>
__device__ __forceinline__ void load_x(const __nv_bfloat16* const (&xrow)[RG], int k0, int K, int ci, bool aligned,
                                       uint4 (&xe)[kU][RG], uint4 (&xf)[kU][RG]) {
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (k0 + u * kKBlock < K) load_x_step<RG, kU>(xrow, u, k0 + u * kKBlock + 8 * ci, K, aligned, xe, xf);
}
template <int RG, int kU>
__device__ __forceinline__ void mma_base(int k0, int K, const uint4 (&we)[kU][2], const uint4 (&wf)[kU][2],
                                         const uint4 (&xe)[kU][RG], const uint4 (&xf)[kU][RG],
                                         float (&acc)[RG][4]) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    if (k0 + u * kKBlock >= K) break;
    uint32_t wa[8], wb[8], xb[RG][8];
#pragma unroll
    for (int g = 0; g < RG; ++g) make_pairs(xe[u][g], xf[u][g], xb[g]);
    make_pairs(we[u][0], wf[u][0], wa);
    make_pairs(we[u][1], wf[u][1], wb);
#pragma unroll
    for (int st = 0; st < 4; ++st) {
#pragma unroll
      for (int g = 0; g < RG; ++g)
        mma_bf16(acc[g], wa[2 * st], wb[2 * st], wa[2 * st + 1], wb[2 * st + 1], xb[g][2 * st], xb[g][2 * st + 1]);
    }
  }
}

// A warp's operands in a 16-row tile at n0 (both forms of the register kernel): W's rows gid and gid + 8
// (clamped to N − 1: rows past N are read, their sums not written) and, per group of 8 rows of x, its
// row g·8 + gid (clamped to the last row).
template <int RG>
__device__ __forceinline__ void tile_operands(const __nv_bfloat16* w, const __nv_bfloat16* x, int N, int K, int rows,
                                              int n0, int gid, const __nv_bfloat16*& wA, const __nv_bfloat16*& wB,
                                              const __nv_bfloat16* (&xrow)[RG]) {
  wA = w + size_t(min(n0 + gid, N - 1)) * K;
  wB = w + size_t(min(n0 + gid + 8, N - 1)) * K;
#pragma unroll
  for (int g = 0; g < RG; ++g) xrow[g] = x + size_t(min(g * 8 + gid, rows - 1)) * K;
}

// A warp's base sums (mma fragments) into yw[row of x][row of the tile].
template <int RG>
__device__ __forceinline__ void store_tile_sums(const float (&acc)[RG][4], float* yw, int t, int gid) {
#pragma unroll
  for (int g = 0; g < RG; ++g)
#pragma unroll
    for (int i = 0; i < 4; ++i) yw[(8 * g + 2 * t + (i & 1)) * 16 + gid + 8 * (i >> 1)] = acc[g][i];
}

// The tile's rows of y, by the first of its warps: y[r][n0 + nl] = the sum over `warps`
// consecutive warps of ysum[warp][r][nl] (warp_stride floats from one warp's sums to the next).
__device__ __forceinline__ void write_tile(const float* ysum, int warp_stride, int warps, int rows, int n0, int N,
                                           float* y, int lane) {
  for (int e = lane; e < rows * 16; e += 32) {
    const int r = e >> 4, nl = e & 15, n = n0 + nl;
    if (n >= N) continue;
    float v = 0.0f;
    for (int q = 0; q < warps; ++q) v += ysum[q * warp_stride + r * 16 + nl];
    y[size_t(r) * N + n] = v;
  }
}

// f(s, i, r) for each row r of x that a warp's slots take: slot s < nmine, its i-th row (bit i of the
// slot's mask). Warp-uniform.
template <int MAXS, int RS, typename F>
__device__ __forceinline__ void for_slot_rows(const Slot* slots, int nmine, F&& f) {
#pragma unroll
  for (int s = 0; s < MAXS; ++s) {
    if (s >= nmine) break;
#pragma unroll
    for (int i = 0; i < RS; ++i)
      if ((slots[s].mask >> i) & 1) f(s, i, slots[s].row0 + i);
  }
}

// The sign fragments of a block for a warp's slots (this lane's 16 bytes each).
template <int MAXS, int MS>
__device__ __forceinline__ void load_slot_signs(const uint4* const (&sgn)[MS], int nmine, int kb, uint4 (&sa)[MS]) {
#pragma unroll
  for (int s = 0; s < MAXS; ++s) {
    if (s >= nmine) break;
    sa[s] = ldg_stream(sgn[s] + size_t(kb) * 32);
  }
}

// The bit-plane fragments and (scale, Σq) of a block for the rows of a warp's slots. Not .nc: written
// by the prerequisite launch.
template <int MAXS, int MS, int RS>
__device__ __forceinline__ void load_slot_x(const DecodeParams& p, const Slot* slots, int nmine, int kb, int lane,
                                            uint4 (&xbf)[MS][RS], float2 (&sc)[MS][RS]) {
  // Block kb (quantized_x_block): (scale, Σq) per row, then the rows' bit-plane fragments.
  const uint4* planes = reinterpret_cast<const uint4*>(p.xq + kQuantizedPlanes);
  const float2* scales = reinterpret_cast<const float2*>(p.xq);
  for_slot_rows<MAXS, RS>(slots, nmine, [&](int s, int i, int r) {
    xbf[s][i] = __ldcg(planes + (size_t(kb) * (p.xq_block >> 4) + r * 32 + lane));
    sc[s][i] = __ldcg(&scales[size_t(kb) * (p.xq_block >> 3) + r]);
  });
}

// Warps of one 16-row tile split its work along K (k_split, in 256-column blocks) and across slots
// (slot_groups of MAXS slots each); their partial results meet in shared memory. RS: rows of x per
// slot (1, or 4 when rows of one variant share a slot and its sign loads). Two forms:
//   combined (SPEC = false, 1–8 rows of x): every warp takes its slots over its K range and also its
//     share of the base there, in the same load batches;
//   specialized (SPEC = true, 9–16 rows): base_warps warps of the tile stream W alone, the others do
//     the delta alone (two row groups of x plus the slots did not fit 128 registers at full batches).
template <int RG, int MAXS, int RS, bool SPEC>
__global__ void __launch_bounds__(kWarps * 32, 2) decode_kernel(const DecodeParams p) {
  pdl_launch_dependents();  // launch.cuh: the next kernel may start; this one waits below
  constexpr int MS = MAXS > 0 ? MAXS : 1;
  // 64-column steps of W per load batch.
  constexpr int kU = 2;
  __shared__ float ytile[kWarps][kMaxRows][16];  // per warp: [row of x][row of the tile]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, t = lane & 3;
  // SPEC: the first base_warps warps of a tile do the base alone, the others the delta alone (each
  // with its own registers: nothing of one is live in the other).
  const int warps_per_tile = p.base_warps + p.k_split * p.slot_groups, tiles_per_block = kWarps / warps_per_tile;
  // Warps left over when warps_per_tile does not divide kWarps get no tile (n0 = N).
  const int n0 = warp < tiles_per_block * warps_per_tile
                     ? (blockIdx.x * tiles_per_block + warp / warps_per_tile) * 16
                     : p.N;
  const int in_tile = warp % warps_per_tile, base_role = in_tile < p.base_warps;
  const int dw = base_role ? 0 : in_tile - p.base_warps, kpart = dw % p.k_split, sgroup = dw / p.k_split;
  const Slot* slots = p.slots + sgroup * MAXS;
  const int nmine = base_role ? 0 : min(MAXS, p.nslots - sgroup * MAXS);
  const int K = p.K, N = p.N;
  const __nv_bfloat16 *wA, *wB, *xrow[RG];
  tile_operands<RG>(p.w, p.x, N, K, p.rows, n0, gid, wA, wB, xrow);
  const int ci = (t & 1) + 4 * (t >> 1);  // this thread's 8-column chunks: ci and ci + 2 of each 64
  const bool aligned = p.aligned;
  // Per slot: this lane's sign fragment of block kb is sgn[s][kb·32].
  const uint4* sgn[MS];
#pragma unroll
  for (int s = 0; s < MS; ++s) sgn[s] = slots[s < nmine ? s : 0].signs + size_t(min(n0, N - 1) / 16) * p.KB * 32 + lane;
  int pw[4];
  plane_weights(t, pw);

  float acc[RG][4] = {};
  float dacc[MS][RS][2] = {};  // per slot row: this lane's part of rows gid and gid + 8 of the tile
  // With one slot row per warp (more would spill), what the end needs besides the sums is ready
  // there, not a round trip to memory after the warp's last block: α of this lane's tile rows (gid,
  // gid + 8), loaded now, and Σ over the warp's blocks of scale·Σq, summed as the blocks come.
  constexpr bool kEarly = MS * RS == 1;
  float sq[MS][RS] = {};  // per slot row (every lane)
  float al[MS][RS][2] = {};
  const auto load_alpha = [&](int s, int i, int r) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      al[s][i][h] = __ldg(p.alpha[r] + (p.alpha_per_row[r] ? min(n0 + gid + 8 * h, N - 1) : 0));
  };
  if (kEarly) for_slot_rows<MAXS, RS>(slots, nmine, load_alpha);
  // Each warp walks a contiguous range of 256-column blocks. Combined form, per block: W's first
  // batch of two 64-column steps, the loads of its slots (the sign fragment, and per row its
  // bit-plane fragment and scale), the rest of the base over the warp's share [bb_begin, bb_end)
  // batch by batch (all loads of a batch before the first is used), then the delta's 1-bit mma.
  const int nkb = p.KB;
  const int kb_begin = nkb * kpart / p.k_split, kb_end = nkb * (kpart + 1) / p.k_split;
  const int kbs = kb_end - kb_begin;
  // Combined warps (not SPEC): the base of their K range is split among the tile's slot groups.
  const int bb_begin = SPEC ? 0 : kb_begin + kbs * sgroup / p.slot_groups;
  const int bb_end = SPEC ? 0 : kb_begin + kbs * (sgroup + 1) / p.slot_groups;
  {  // Before the wait for the kernel before (launch.cuh): this warp's first block of W on its way to
     // L2 (16 rows × 256 columns: 128 bytes of rows gid and gid + 8 per lane). x and its quantized
     // rows come from the kernels before; W, the signs and α do not.
    const int first = SPEC ? (base_role ? nkb * in_tile / p.base_warps : -1) : (bb_begin < bb_end ? bb_begin : -1);
    const int k = first * kDBlock + t * (kDBlock / 4);
    if (n0 < N && first >= 0 && k < K) prefetch_l2(wA + k), prefetch_l2(wB + k);
  }
  pdl_wait();
  if constexpr (SPEC) {
    if (n0 < N && base_role) {
      // The base over this warp's 1/base_warps of K, batch by batch.
      constexpr int kBatches = kDBlock / kKBlock / kU;  // per block
      const int b0 = nkb * in_tile / p.base_warps, b1 = nkb * (in_tile + 1) / p.base_warps;
#pragma unroll 1
      for (int h = b0 * kBatches; h < b1 * kBatches; ++h) {
        uint4 we[kU][2], wf[kU][2], xe[kU][RG], xf[kU][RG];
        load_base<RG, kU>(wA, wB, xrow, h * kU * kKBlock, K, ci, aligned, we, wf, xe, xf);
        mma_base<RG, kU>(h * kU * kKBlock, K, we, wf, xe, xf, acc);
      }
    } else if (n0 < N) {
      // The delta over this warp's K range for its slots: kDU blocks at a time, all their loads, then
      // the 1-bit mma (one block in flight per warp left the delta warps waiting on latency).
      constexpr int kDU = MS * RS > 4 ? 1 : 2;  // (2 spilled with 2 slots of 4 rows)
      for (int kb0 = kb_begin; kb0 < kb_end; kb0 += kDU) {
        uint4 sa[kDU][MS], xbf[kDU][MS][RS];
        float2 sc[kDU][MS][RS];
#pragma unroll
        for (int d = 0; d < kDU; ++d) {
          const int kb = min(kb0 + d, kb_end - 1);
          load_slot_signs<MAXS>(sgn, nmine, kb, sa[d]);
          load_slot_x<MAXS>(p, slots, nmine, kb, lane, xbf[d], sc[d]);
        }
#pragma unroll
        for (int d = 0; d < kDU; ++d) {
          if (kb0 + d >= kb_end) break;
          for_slot_rows<MAXS, RS>(slots, nmine, [&](int s, int i, int) {
            delta_block(sa[d][s], xbf[d][s][i], sc[d][s][i].x, pw, dacc[s][i]);
            if (kEarly) sq[s][i] += sc[d][s][i].x * sc[d][s][i].y;
          });
        }
      }
    }
  } else {
  if (n0 < N) {
    for (int kb = kb_begin; kb < kb_end; ++kb) {
      const bool has_base = kb >= bb_begin && kb < bb_end;
      uint4 we[kU][2], wf[kU][2], xe[kU][RG], xf[kU][RG];
      const auto load_batch = [&](int h) {
        load_base<RG, kU>(wA, wB, xrow, kb * kDBlock + kU * h * kKBlock, K, ci, aligned, we, wf, xe, xf);
      };
      const auto mma_batch = [&](int h) { mma_base<RG, kU>(kb * kDBlock + kU * h * kKBlock, K, we, wf, xe, xf, acc); };
      // W's first batch goes out before the slots' loads.
      if (has_base) load_batch(0);
      uint4 sa[MS], xbf[MS][RS];
      float2 sc[MS][RS];
      // The slots' x fragments: with one row per slot, loaded with the signs (in flight during the
      // base); with 4 rows per slot, after the base (fewer registers live across it).
      const auto load_slots_x = [&]() { load_slot_x<MAXS>(p, slots, nmine, kb, lane, xbf, sc); };
      load_slot_signs<MAXS>(sgn, nmine, kb, sa);
      if (RS == 1) load_slots_x();
      if (has_base) {
        mma_batch(0);
#pragma unroll 1
        for (int h = 1; h < kDBlock / kKBlock / kU; ++h) {
          load_batch(h);
          mma_batch(h);
        }
      }
      if (RS > 1) load_slots_x();
      for_slot_rows<MAXS, RS>(slots, nmine, [&](int s, int i, int) {
        delta_block(sa[s], xbf[s][i], sc[s][i].x, pw, dacc[s][i]);
        if (kEarly) sq[s][i] += sc[s][i].x * sc[s][i].y;
      });
    }
  }
  }
  // This warp's partial y [row of x][row of the tile]: base, then α·Σ_blocks scale·(2·Σ w_p·popc − Σq)
  // over its K range for its slots' rows. (Warps with slots have waited for the prerequisite in the
  // loop; one with an empty K range reads nothing.)
  float* yw = &ytile[warp][0][0];
#pragma unroll
  for (int i = 0; i < 8; ++i) yw[lane + 32 * i] = 0.0f;
  __syncwarp();
  store_tile_sums<RG>(acc, yw, t, gid);
  __syncwarp();
  if (n0 < N)
    for_slot_rows<MAXS, RS>(slots, nmine, [&](int s, int i, int r) {
      if (!kEarly) {
        load_alpha(s, i, r);
        // Σ over the warp's blocks of scale·Σq, the lanes taking blocks in turn.
        for (int kb = kb_begin + lane; kb < kb_end; kb += 32) {
          const float2 v = __ldcg(reinterpret_cast<const float2*>(p.xq + size_t(kb) * p.xq_block) + r);
          sq[s][i] += v.x * v.y;
        }
        for (int o = 16; o; o >>= 1) sq[s][i] += __shfl_xor_sync(0xffffffffu, sq[s][i], o);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v = dacc[s][i][h];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        v = 2.0f * v - sq[s][i];
        const int nl = gid + 8 * h, n = n0 + nl;
        if (t == 0 && n < N) yw[r * 16 + nl] += al[s][i][h] * v;
      }
    });
  // Sum the tile's warps, then write y[r][n].
  __syncthreads();
  if (in_tile != 0 || n0 >= N) return;
  write_tile(&ytile[warp][0][0], kMaxRows * 16, warps_per_tile, p.rows, n0, N, p.y, lane);
}

template <int RG, int MAXS, int RS, bool SPEC = false>
void launch(const DecodeParams& p, cudaStream_t stream) {
  const int tiles = (p.N + 15) / 16, tiles_per_block = kWarps / (p.base_warps + p.k_split * p.slot_groups);
  const int blocks = (tiles + tiles_per_block - 1) / tiles_per_block;
  launch_chained(decode_kernel<RG, MAXS, RS, SPEC>, dim3(unsigned(blocks)), dim3(kWarps * 32), 0, stream, p);
}

// Slots per warp (1–8 rows of x): one row per slot, 1 or 2 slots per warp; or, when rows of a variant
// share a group of 4, one slot per variant and group with up to 4 rows, 1 per warp. More slots go to
// more warps of the tile (slot_groups). All keep a warp within 128 registers (two blocks per
// multiprocessor).
template <int RG>
void launch_slots(DecodeParams& p, bool grouped, cudaStream_t stream) {
  p.base_warps = 0;
  if (p.nslots == 0) {
    p.slot_groups = 1;
    return launch<RG, 0, 1>(p, stream);
  }
  if constexpr (RG == 2) {
    // 9–16 rows: both the base and the delta at once did not fit 128 registers without a smaller
    // load batch (slower); so 4 warps of the tile stream W and 4 take the slots (1, 2 or 4 each).
    // (6 and 2 for up to 4 slots was slower: run 34.)
    constexpr int delta_warps = kWarps / 2;
    p.base_warps = kWarps - delta_warps;
    const int per = p.nslots <= delta_warps ? 1 : p.nslots <= 2 * delta_warps ? 2 : 4;
    p.slot_groups = (p.nslots + per - 1) / per;
    p.k_split = delta_warps / p.slot_groups;
    if (grouped) return per == 1 ? launch<RG, 1, 4, true>(p, stream)
                                 : launch<RG, 2, 4, true>(p, stream);
    if (per == 1) return launch<RG, 1, 1, true>(p, stream);
    if (per == 2) return launch<RG, 2, 1, true>(p, stream);
    return launch<RG, 4, 1, true>(p, stream);
  } else {
    const int per_warp = p.nslots == 1 || grouped ? 1 : 2;
    p.slot_groups = (p.nslots + per_warp - 1) / per_warp;
    p.k_split = std::max(1, std::min(p.k_split, kWarps / p.slot_groups));
    if (grouped) return launch<RG, 1, 4>(p, stream);
    if (per_warp == 1) return launch<RG, 1, 1>(p, stream);
    launch<RG, 2, 1>(p, stream);
  }
}

// Every row of one variant where the streaming kernel does not run (DecodeOptions::form_weights):
// W_eff = W + α·S formed in registers from W's loads and the variant's sign fragments, then the bf16
// mma as for the base. One launch for up to 32 rows (W and the signs read once), no 1-bit path and
// no quantizing launch before it. Rounds as the fused prefill GEMM and the streaming kernel's
// form_weights do: bf16(W + bf16(α)·s) (tma.cuh). The grid is the register kernel's: whole 16-row
// tiles per block, k_split warps per tile along K, their sums met in shared memory.
struct WeffParams {
  const __nv_bfloat16* w;
  const __nv_bfloat16* x;
  float* y;
  const uint4* signs;  // packed layout
  const float* alpha;
  int alpha_per_row;
  int N, K, KB, rows, k_split, aligned;
};

// The sign byte of columns [c, c + 8) for column c's pair layout: z with each column's right
// neighbour 16 bits above it (delta_pair's form), from byte b of the word v.
__device__ __forceinline__ uint32_t sign_pairs(uint32_t v, int b) {
  const uint32_t B = __byte_perm(v, 0u, 0x4440u | uint32_t(b));
  return __byte_perm(B, B >> 1, 0x5410);
}
// W_eff in place for 8 columns of one row (words of 2 columns each, column 2i at bits 15 − 2i of z).
__device__ __forceinline__ void form_weff8(uint4& e, uint32_t z, uint32_t na) {
  e.x = bf16x2_add(e.x, delta_pair(z, 15, na));
  e.y = bf16x2_add(e.y, delta_pair(z, 13, na));
  e.z = bf16x2_add(e.z, delta_pair(z, 11, na));
  e.w = bf16x2_add(e.w, delta_pair(z, 9, na));
}

template <int RG, int kU>
__global__ void __launch_bounds__(kWarps * 32, 2) decode_weff_kernel(const WeffParams p) {
  pdl_launch_dependents();  // launch.cuh: the next kernel may start; this one waits below
  __shared__ float ytile[kWarps][kMaxDecodeRows][16];  // per warp: [row of x][row of the tile]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, t = lane & 3;
  const int tiles_per_block = kWarps / p.k_split, kpart = warp % p.k_split;
  const int n0 = (blockIdx.x * tiles_per_block + warp / p.k_split) * 16;
  const int K = p.K, N = p.N;
  const __nv_bfloat16 *wA, *wB, *xrow[RG];
  tile_operands<RG>(p.w, p.x, N, K, p.rows, n0, gid, wA, wB, xrow);
  const int ci = (t & 1) + 4 * (t >> 1);  // this thread's 8-column chunks: ci and ci + 2 of each 64
  const bool aligned = p.aligned;
  const int kb_begin = p.KB * kpart / p.k_split, kb_end = p.KB * (kpart + 1) / p.k_split;
  // The lane's sign fragment of block kb is sg[kb·32]. Lane t's W elements of 64-column step s of a
  // block (columns 64s + 8·ci + [0, 8) and + 16) have their bits in the fragment of lane
  // 4·gid + 2(s & 1) + (t >> 1), register 2(s >> 1) + (row gid + 8), bytes (t & 1) and (t & 1) + 2.
  const uint4* sg = p.signs + size_t(min(n0, N - 1) / 16) * p.KB * 32 + lane;
  const int src0 = (lane & ~3) | (t >> 1);
  const int eb = t & 1;
  // W, the signs and α are not written by the kernels before (launch.cuh): loaded before the wait.
  const uint32_t naA = neg_alpha_pair(__ldg(p.alpha + (p.alpha_per_row ? min(n0 + gid, N - 1) : 0)));
  const uint32_t naB = neg_alpha_pair(__ldg(p.alpha + (p.alpha_per_row ? min(n0 + gid + 8, N - 1) : 0)));
  {
    const int k = kb_begin * kDBlock + t * (kDBlock / 4);
    if (n0 < N && kb_begin < kb_end && k < K) prefetch_l2(wA + k), prefetch_l2(wB + k);
  }
  pdl_wait();
  float acc[RG][4] = {};
  if (n0 < N) {
#pragma unroll 1
    for (int kb = kb_begin; kb < kb_end; ++kb) {
      // The block's sign fragment, loaded with its first batch of W; each step takes its two words
      // (rows gid and gid + 8) from their source lane.
      const uint4 sa = ldg_stream(sg + size_t(kb) * 32);
#pragma unroll
      for (int h = 0; h < kDBlock / kKBlock / kU; ++h) {
        const int k0 = kb * kDBlock + h * kU * kKBlock;
        uint4 we[kU][2], wf[kU][2], xe[kU][RG], xf[kU][RG];
        load_base<RG, kU>(wA, wB, xrow, k0, K, ci, aligned, we, wf, xe, xf);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int s = h * kU + u, src = src0 + 2 * (s & 1);
          const uint32_t vA = __shfl_sync(0xffffffffu, s < 2 ? sa.x : sa.z, src);
          const uint32_t vB = __shfl_sync(0xffffffffu, s < 2 ? sa.y : sa.w, src);
          if (k0 + u * kKBlock >= K) break;
          form_weff8(we[u][0], sign_pairs(vA, eb), naA);
          form_weff8(wf[u][0], sign_pairs(vA, eb + 2), naA);
          form_weff8(we[u][1], sign_pairs(vB, eb), naB);
          form_weff8(wf[u][1], sign_pairs(vB, eb + 2), naB);
        }
        mma_base<RG, kU>(k0, K, we, wf, xe, xf, acc);
      }
    }
  }
  // The warp's partial y, then the tile's warps summed by its first.
  store_tile_sums<RG>(acc, &ytile[warp][0][0], t, gid);
  __syncthreads();
  if (kpart != 0 || n0 >= N) return;
  write_tile(&ytile[warp][0][0], kMaxDecodeRows * 16, p.k_split, p.rows, n0, N, p.y, lane);
}

template <int RG, int kU>
void launch_weff(const WeffParams& p, cudaStream_t stream) {
  const int tiles = (p.N + 15) / 16, tiles_per_block = kWarps / p.k_split;
  launch_chained(decode_weff_kernel<RG, kU>, dim3(unsigned((tiles + tiles_per_block - 1) / tiles_per_block)),
                 dim3(kWarps * 32), 0, stream, p);
}

// One row of x (decode at batch 1): the base and at most one variant, on a grid that gives every
// block the same bytes. A unit is one 16-row tile × one 256-column block of W (and of the signs).
// Two blocks per multiprocessor take contiguous ranges of the tiles·KB units in tile order: whole
// tiles per block where that loads the busiest multiprocessor at most 5% above the average, else
// equal ranges of units (a tile cut between two blocks). The 8 warps of a block take the range's
// units in turn, two at a time, the cut tiles' units first. Each warp sums its units per tile; the
// warps' sums meet in shared memory. A range holds at least KB units, so a tile is cut between at
// most two blocks. Each of the two sums its warps' parts of the tile's rows once they are past that
// tile, and the two sums meet in memory: one atomic exchange per row and block, while the whole
// tiles stream, the second block to arrive adding the two (the same float whichever block that is).
// No block waits for another. (Until part 16 the first block counted its warps' parts with a
// release and the second waited for the count: about 1.3 µs at 11008 × 4096. In part 16 the
// exchange was at the blocks' ends.)
// With a delta, each block first quantizes x into its shared memory (quantize_row_shared), after the
// wait for the kernel that wrote x: no quantizing launch before it. In a chain of launches that
// launch cost 1.4–3.3 µs per linear layer, against 0.4–1.6 µs timed alone (NOTES.md, part 15).
// The register kernel's own grid (whole tiles per block, k_split warps per tile) leaves some
// multiprocessors with one block where others have two, or a partial second wave: at 11008 × 4096,
// 172 blocks for 132 multiprocessors; at 28672 × 8192, 448 (NOTES.md, part 14).
struct RowParams {
  const __nv_bfloat16* w;
  const __nv_bfloat16* x;
  float* y;
  const uint4* signs;  // packed (packed_signs.h); null: the base alone
  const float* alpha;
  int alpha_per_row;
  // x quantized before the launch (DecodeOptions::xq; quantized_x_block bytes per 256-column block),
  // read per unit from memory instead of quantized in each block: the decode_row_kernel<true, true>.
  const uint8_t* xq;
  int xq_block;
  int N, K, KB, aligned;
  int units, blocks;
  int whole;  // ranges of whole tiles (no tile cut)
  // Per row of W: where the two blocks of a cut tile meet (zero between launches; see the kernel).
  unsigned long long* meet;
};

// The one-row kernel's stage: per lane, 16 bytes of W for each of rows gid and gid + 8, columns
// 8·ci.. and 8·ci + 16.., of each of the second load batch's kU = 2 steps (see the kernel).
constexpr int kStageSlots = 8;
constexpr int kStageBytes = kWarps * kStageSlots * 32 * 16;
// kXq (with kDelta): x quantized before the launch (RowParams::xq), not in the block.
template <bool kDelta, bool kXq>
__global__ void __launch_bounds__(kWarps * 32, 2) decode_row_kernel(const RowParams p) {
  static_assert(kDelta || !kXq);
  pdl_launch_dependents();  // launch.cuh: the next kernel may start; this one waits below
  constexpr int kU = 2;     // 64-column steps of W per load batch, as the register kernel
  constexpr bool kQuantize = kDelta && !kXq;  // x quantized by the block itself
  // Shared memory: the warps' stage (kStageBytes, below); x quantized (KB blocks of
  // kRowPlaneBytes), where the block does it; then the warps' sums, [tile of the range][warp][16 rows].
  extern __shared__ uint4 smem_row[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, t = lane & 3;
  const int KB = p.KB, K = p.K, N = p.N;
  uint8_t* const xs = reinterpret_cast<uint8_t*>(smem_row) + kStageBytes;
  float* const ysum = reinterpret_cast<float*>(xs + (kQuantize ? KB * kRowPlaneBytes : 0));
  const int per = p.whole ? KB : 1, items = p.units / per;  // ranges of whole tiles, or of units
  const int u0 = int(int64_t(items) * blockIdx.x / p.blocks) * per;
  const int u1 = int(int64_t(items) * (blockIdx.x + 1) / p.blocks) * per;
  const int T0 = u0 / KB, T1 = (u1 - 1) / KB, ntiles = T1 - T0 + 1;
  const bool head_cut = u0 % KB != 0, tail_cut = u1 % KB != 0;
  // The order of the range: the tail tile's units (cut, when the next block has the rest of that
  // tile), the head tile's units (cut, when the block before has the rest), then the whole tiles, so
  // that the cut tiles' sums meet the other blocks' while the whole tiles stream (see meet_cut).
  const int tail_len = tail_cut ? u1 - T1 * KB : 0, head_len = head_cut ? (T0 + 1) * KB - u0 : 0;
  const int cut_len = tail_len + head_len, mid0 = u0 + head_len;
  const auto unit_at = [&](int q) {
    return q < tail_len ? u1 - tail_len + q : q < cut_len ? u0 + q - tail_len : mid0 + q - cut_len;
  };
  const int L = u1 - u0;
  // Each warp zeroes its own sums (a tile with fewer than 8 units in the range leaves some unset).
  for (int s = 0; s < ntiles; ++s)
    if (lane < 16) ysum[(s * kWarps + warp) * 16 + lane] = 0.0f;
  __syncwarp();
  const int ci = (t & 1) + 4 * (t >> 1);  // this thread's 8-column chunks: ci and ci + 2 of each 64
  const bool aligned = p.aligned;
  int pw[4];
  plane_weights(t, pw);
  const __nv_bfloat16* const xrow[1] = {p.x};
  // Warp j's positions q in that order: in each round of 8·c, the c from j·c on. c = 2 (run 134:
  // 1, 4 and 8 were slower).
  constexpr int c = 2;
  int q = warp * c, i = 0;
  float acc[1][4] = {}, dacc[2] = {}, sq = 0.0f, al[2] = {};
  const __nv_bfloat16 *wA = p.w, *wB = p.w;
  const uint4* sg = p.signs;
  const auto start_tile = [&](int tile) {
    wA = p.w + size_t(min(tile * 16 + gid, N - 1)) * K;
    wB = p.w + size_t(min(tile * 16 + gid + 8, N - 1)) * K;
    if (kDelta) {
      sg = p.signs + size_t(tile) * KB * 32 + lane;
#pragma unroll
      for (int h = 0; h < 2; ++h) al[h] = __ldg(p.alpha + (p.alpha_per_row ? min(tile * 16 + gid + 8 * h, N - 1) : 0));
    }
  };
  // A warp with one round of units (L <= kWarps·c: at 4096² of the five shapes) sends its first
  // unit's second batch to L2 rather than staging it, and does not prefetch its next unit (below).
  const bool one_round = L <= kWarps * c;
  // Before the wait (weights and deltas only: launch.cuh): the first tile's rows, sign blocks and α,
  // the warp's first load batch of W into registers (we, wf) and its second by cp.async into the
  // lane's 8 slots of the warp's stage in shared memory (no registers held while they fly; to L2
  // where the unit is a partial block, the rows unaligned or the warp has one round). Measured
  // (bench/cuda/NOTES.md): loads before the wait, run 351 (chains of 20 at 4096²: 10.9 µs against 11.9
  // with only the first unit to L2; part 15 for why not before the loads of x); the stage, run 359
  // (H100: the 7B batch-1 step 5.71-5.77 ms against 5.81-5.83 with the second batch to L2); the stage
  // dropped at one round, run 368 (H200, graphs of (norm, linear) pairs at 4096²: 3.41 TB/s against
  // 3.25; the 7B step level, base 4.03-4.04 ms against 4.02-4.05, one variant 4.44-4.45 against
  // 4.42-4.44).
  int cur = -1, T = 0, kb = 0;
  uint4 we[kU][2], wf[kU][2];
  bool have_w = false, staged = false;
  static_assert(kStageSlots == 4 * kU);
  const uint32_t stage = smem_addr(smem_row) + uint32_t(warp * kStageSlots * 32 + lane) * 16;
  if (q < L) {
    const int u = unit_at(q);
    T = u / KB, kb = u - T * KB;
    start_tile(cur = T);
    load_w<kU>(wA, wB, kb * kDBlock, K, ci, aligned, we, wf);
    have_w = true;
    static_assert(kDBlock == 2 * kU * kKBlock);
    if (aligned && !one_round && (kb + 1) * kDBlock <= K) {
#pragma unroll
      for (int u2 = 0; u2 < kU; ++u2) {
        const int k = kb * kDBlock + (kU + u2) * kKBlock + 8 * ci;
        cp_async16(stage + (4 * u2 + 0) * 512, wA + k, true), cp_async16(stage + (4 * u2 + 1) * 512, wA + k + 16, true);
        cp_async16(stage + (4 * u2 + 2) * 512, wB + k, true), cp_async16(stage + (4 * u2 + 3) * 512, wB + k + 16, true);
      }
      cp_async_commit();
      staged = true;
    } else {
      constexpr int kRest = (kDBlock - kU * kKBlock) / 64;  // 128-byte lines of a row left in the unit
      const int k = kb * kDBlock + kU * kKBlock + 64 * t;
      if (t < kRest && k < K) prefetch_l2(wA + k), prefetch_l2(wB + k);
    }
  }
  // Once x's loads are issued after the wait: the warp's second unit (position q + 1) sent to L2, its
  // rows of W and its sign block, where the block's range has more than one round of units. Runs
  // 356-358 (H100, chains of 20): 0.8-2.5 µs less at 11008×4096, 4096×11008 and 8192² (3-5%), 1.4-1.9
  // at 28672×8192 (1%); at 4096², one round, it cost 1.4 µs with a delta and 1.9 without: not there.
  const auto prefetch_next = [&]() {
    if (one_round || q + 1 >= L) return;
    const int u = unit_at(q + 1), T2 = u / KB, kb2 = u - T2 * KB, k = kb2 * kDBlock + 64 * t;
    if (k < K) {
      prefetch_l2(p.w + size_t(min(T2 * 16 + gid, N - 1)) * K + k);
      prefetch_l2(p.w + size_t(min(T2 * 16 + gid + 8, N - 1)) * K + k);
    }
    if (kDelta && lane < 4) prefetch_l2(p.signs + (size_t(T2) * KB + kb2) * 32 + 8 * lane);
  };
  pdl_wait();
  if (kQuantize) {  // x quantized into shared memory by the whole block
    quantize_row_shared(p.x, K, p.aligned, xs, prefetch_next);
    __syncthreads();
  } else {
    prefetch_next();
  }
  // kXq: row 0's bit-plane fragments and (scale, Σq) of each 256-column block (quantized_x_block).
  const uint4* const xplanes = kXq ? reinterpret_cast<const uint4*>(p.xq + kQuantizedPlanes) : nullptr;
  const float2* const xscales = kXq ? reinterpret_cast<const float2*>(p.xq) : nullptr;
  // The warp's sums for `tile`: rows gid and gid + 8 of it in the lanes with t = 0.
  const auto finish = [&](int tile) {
    float v[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      v[h] = acc[0][2 * h];
      if (kDelta) {
        float d = dacc[h];
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        d += __shfl_xor_sync(0xffffffffu, d, 2);
        v[h] += al[h] * (2.0f * d - sq);
      }
    }
    if (t == 0) {
      float* s = ysum + ((tile - T0) * kWarps + warp) * 16;
      s[gid] = v[0], s[gid + 8] = v[1];
    }
#pragma unroll
    for (int h = 0; h < 4; ++h) acc[0][h] = 0.0f;
    dacc[0] = dacc[1] = sq = 0.0f;
  };
  // The cut tiles' rows: each block sums its warps' parts of them once every warp is past its units
  // of them (a named barrier: the others arrive, the warp with the last cut unit waits), and swaps the
  // sum into p.meet[n] (meet_swap, stream_scratch.cuh); the block that finds the other's there writes
  // y = own + other at its end (meet_sum). No fence and no wait; the swap's round trip overlaps the
  // whole tiles' stream. Lane l of warp `dw`: row l % 16 of the tail tile (l < 16) or of the head
  // tile.
  const int dw = cut_len > 0 ? (cut_len - 1) / c % kWarps : -1;
  bool cut_done = cut_len == 0;
  unsigned long long other = 0;
  const auto cut_row = [&](int& s, int& n) {
    s = lane < 16 ? ntiles - 1 : 0, n = (T0 + s) * 16 + (lane & 15);
    return (lane < 16 ? tail_cut : head_cut) && n < N;
  };
  const auto own_sum = [&](int s) {
    float v = 0.0f;
    for (int w = 0; w < kWarps; ++w) v += ysum[(s * kWarps + w) * 16 + (lane & 15)];
    return v;
  };
  const auto meet_cut = [&]() {
    cut_done = true;
    if (warp != dw) {
      asm volatile("bar.arrive 1, %0;\n" ::"n"(kWarps * 32) : "memory");
      return;
    }
    asm volatile("bar.sync 1, %0;\n" ::"n"(kWarps * 32) : "memory");
    int s, n;
    if (cut_row(s, n)) other = meet_swap(p.meet + n, own_sum(s));
  };
  while (q < L) {
    const int adv = i + 1 == c ? kWarps * c - c + 1 : 1;
    if (T != cur) {
      finish(cur);
      start_tile(cur = T);
    }
    if (!cut_done && q >= cut_len) meet_cut();  // this warp's sums of the cut tiles are written
    // As the register kernel's combined form: W's first batch, the unit's sign fragment, bit-planes
    // and (scale, Σq), then the rest of W batch by batch, then the 1-bit mma.
    const int k0 = kb * kDBlock;
    uint4 xe[kU][1], xf[kU][1];
    uint4 sa{}, xbf{};
    float2 sc{};
    if (have_w) {  // W's batch loaded before the wait
      load_x<1, kU>(xrow, k0, K, ci, aligned, xe, xf);
      have_w = false;
    } else {
      load_base<1, kU>(wA, wB, xrow, k0, K, ci, aligned, we, wf, xe, xf);
    }
    if (kDelta) {
      sa = ldg_stream(sg + size_t(kb) * 32);
      if (kXq) {  // not .nc: written by an earlier launch
        xbf = __ldcg(xplanes + (size_t(kb) * (p.xq_block >> 4) + lane));
        sc = __ldcg(xscales + size_t(kb) * (p.xq_block >> 3));
      } else {
        const uint8_t* blk = xs + kb * kRowPlaneBytes;
        xbf = *reinterpret_cast<const uint4*>(blk + 16 * lane);
        sc = *reinterpret_cast<const float2*>(blk + 512);
      }
    }
    mma_base<1, kU>(k0, K, we, wf, xe, xf, acc);
#pragma unroll 1
    for (int h = 1; h < kDBlock / kKBlock / kU; ++h) {
      if (staged) {  // the batch from this lane's slots of the stage
        staged = false;
        cp_async_wait<0>();
        const uint4* sl = smem_row + warp * kStageSlots * 32 + lane;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          we[u][0] = sl[(4 * u + 0) * 32], wf[u][0] = sl[(4 * u + 1) * 32];
          we[u][1] = sl[(4 * u + 2) * 32], wf[u][1] = sl[(4 * u + 3) * 32];
        }
        load_x<1, kU>(xrow, k0 + kU * h * kKBlock, K, ci, aligned, xe, xf);
      } else {
        load_base<1, kU>(wA, wB, xrow, k0 + kU * h * kKBlock, K, ci, aligned, we, wf, xe, xf);
      }
      mma_base<1, kU>(k0 + kU * h * kKBlock, K, we, wf, xe, xf, acc);
    }
    if (kDelta) {
      delta_block(sa, xbf, sc.x, pw, dacc);
      sq += sc.x * sc.y;
    }
    i = i + 1 == c ? 0 : i + 1;
    q += adv;
    if (q < L) {
      const int u = unit_at(q);
      T = u / KB, kb = u - T * KB;
    }
  }
  if (cur >= 0) finish(cur);
  if (!cut_done) meet_cut();
  if (warp == dw && other != 0) {  // the cut tiles' rows where this block came second
    int s, n;
    cut_row(s, n);
    p.y[n] = meet_sum(p.meet + n, own_sum(s), other);
  }
  __syncthreads();
  // The whole tiles' rows: the warps' sums.
  for (int e = threadIdx.x; e < ntiles * 16; e += blockDim.x) {
    const int s = e >> 4, n = (T0 + s) * 16 + (e & 15);
    if (n >= N || (s == ntiles - 1 && tail_cut) || (s == 0 && head_cut)) continue;
    float v = 0.0f;
    for (int w = 0; w < kWarps; ++w) v += ysum[(s * kWarps + w) * 16 + (e & 15)];
    p.y[n] = v;
  }
}

// The balanced one-row kernel's grid and shared memory for [N, K] (x quantized in the block, for a
// delta with no DecodeOptions::xq, or not); valid is false where it does not apply: its shared
// memory would pass kRowSmemMax (x quantized, about 4 KB per 1000 columns, and the warps' sums, 512
// bytes per tile of the longest range).
constexpr size_t kRowSmemMax = 100u << 10;  // two blocks per multiprocessor (228 KB)
struct RowPlan {
  bool valid;
  bool whole;
  int blocks;
  int64_t units;
  size_t smem;
};
RowPlan plan_row(int N, int K, bool quantize_x) {
  const int sms = multiprocessors();
  const int tiles = (N + 15) / 16, KB = sign_blocks(K);
  RowPlan r{};
  r.units = int64_t(tiles) * KB;
  // Two blocks per multiprocessor. Whole tiles per block where that leaves the busiest
  // multiprocessor at most 5% more than the average; else equal ranges of units, tiles cut between
  // blocks (their merge costs 1–3 µs: NOTES.md, part 14).
  const int slots = 2 * sms, tpb = (tiles + slots - 1) / slots;
  r.whole = int64_t(tpb) * slots * 100 <= int64_t(tiles) * 105;
  r.blocks = r.whole ? (tiles + tpb - 1) / tpb : std::min(slots, tiles);
  const int64_t longest = r.whole ? int64_t(tpb) * KB : (r.units + r.blocks - 1) / r.blocks;
  r.smem = kStageBytes + size_t((longest + 2 * KB - 2) / KB) * kWarps * 16 * sizeof(float) +
           (quantize_x ? size_t(KB) * kRowPlaneBytes : 0);
  r.valid = r.units <= INT32_MAX / 2 && r.smem <= kRowSmemMax;
  return r;
}

// A kernel of this file needing more than the default 48 KB of dynamic shared memory: allowed
// kRowSmemMax on the current device the first time (a host call, not one per launch).
template <auto kKernel>
void allow_row_smem() {
  constexpr int kDevices = 64;
  static std::atomic<bool> allowed[kDevices];
  int dev = 0;
  BITDELTA_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < kDevices && allowed[dev].load(std::memory_order_relaxed)) return;
  BITDELTA_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kRowSmemMax)));
  if (dev < kDevices) allowed[dev].store(true, std::memory_order_relaxed);
}

// The balanced one-row kernel's launch (plan_row(N, K, d && !xq).valid); xq: x quantized before
// (with a delta), or null.
void launch_row(const RowPlan& plan, const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, const DeltaRef* d,
                const uint8_t* xq, float* y, bool aligned, cudaStream_t stream) {
  const int tiles = (N + 15) / 16, KB = sign_blocks(K);
  RowParams r{};
  r.w = w, r.x = x, r.y = y, r.N = N, r.K = K, r.KB = KB, r.aligned = aligned;
  r.units = int(plan.units), r.blocks = plan.blocks, r.whole = plan.whole;
  if (d) {
    r.signs = reinterpret_cast<const uint4*>(d->signs);
    r.alpha = d->alpha;
    r.alpha_per_row = d->alpha_per_row ? 1 : 0;
    r.xq = xq, r.xq_block = quantized_x_block(1);
  }
  if (!plan.whole && plan.blocks < tiles)  // some tiles are cut between blocks
    r.meet = static_cast<unsigned long long*>(
        stream_scratch(ScratchUse::kDecodeMeet, stream, size_t(tiles) * 16 * sizeof(unsigned long long), true));
  const auto kernel = !d ? decode_row_kernel<false, false> : xq ? decode_row_kernel<true, true>
                                                                 : decode_row_kernel<true, false>;
  if (plan.smem > (48u << 10)) {  // large K only
    if (!d)
      allow_row_smem<decode_row_kernel<false, false>>();
    else if (xq)
      allow_row_smem<decode_row_kernel<true, true>>();
    else
      allow_row_smem<decode_row_kernel<true, false>>();
  }
  const dim3 grid{unsigned(plan.blocks)}, block{kWarps * 32};
  // Shared memory for two blocks per multiprocessor (each with 1 KB the system reserves), at least
  // what every chained kernel prefers (launch.cuh).
  launch_chained_shared(std::max(kPreferredSharedBytes, unsigned(2 * (plan.smem + (1u << 10)))), kernel, grid, block,
                        plan.smem, stream, r);
}

// quantize_x's kernel: a thread per item (32 columns of a row and 256-column block: quantize_item),
// items in row order. (Until part 19: four warps per (row, block), each making a word of each lane's
// fragment by 32 ballots. Alone, either takes 4.1–8.3 µs, mostly the launch: medians 5.6 and 5.6 µs
// for 16 rows, runs 192–193.)
// With pairs, the items of pairs of blocks (blocks 2m and 2m + 1 of a row; the second missing where
// KB is odd) in groups of 16 lanes, the scale the pair's (delta_pair_unshifted).
constexpr int kPrepThreads = 128;
__global__ void __launch_bounds__(kPrepThreads) prepare_x_kernel(const __nv_bfloat16* x, int rows, int K, int KB,
                                                                 bool aligned, uint8_t* xq, int xq_block, bool pairs) {
  pdl_launch_dependents();  // launch.cuh
  pdl_wait();
  const int a = blockIdx.x * kPrepThreads + threadIdx.x;
  const int span = pairs ? 2 : 1, KS = (KB + span - 1) / span;  // blocks per scale, spans per row
  if (a >= rows * KS * span * 8) return;  // whole groups of 8·span lanes (8 items per block of K)
  const int rs = a / (8 * span), r = rs / KS, kb = span * (rs - r * KS) + (a >> 3) % span;
  quantize_x_item(x, K, aligned, r, kb, a & 7, xq, xq_block, pairs ? 0xFFFFu << (threadIdx.x & 16) : 0u, kb < KB);
}

// quantize_x_in_block: one block quantizes x[K] in shared memory as the one-row kernel does, then
// copies it out in quantize_x's layout.
__global__ void __launch_bounds__(kWarps * 32) quantize_in_block_kernel(const __nv_bfloat16* x, int K, bool aligned,
                                                                          uint8_t* xq) {
  extern __shared__ uint4 smem_q[];
  uint8_t* xs = reinterpret_cast<uint8_t*>(smem_q);
  quantize_row_shared(x, K, aligned, xs);
  __syncthreads();
  const int KB = sign_blocks(K), blk = quantized_x_block(1);
  for (int i = threadIdx.x; i < KB * 128; i += blockDim.x) {  // the fragments, a word at a time
    const int kb = i >> 7, w = i & 127;
    reinterpret_cast<uint32_t*>(xq + size_t(kb) * blk + kQuantizedPlanes)[w] =
        reinterpret_cast<const uint32_t*>(xs + kb * kRowPlaneBytes)[w];
  }
  for (int kb = threadIdx.x; kb < KB; kb += blockDim.x)
    *reinterpret_cast<float2*>(xq + size_t(kb) * blk) =
        *reinterpret_cast<const float2*>(xs + kb * kRowPlaneBytes + 512);
}

__global__ void pack_signs_kernel(const uint8_t* raw, int N, int K, int KB, size_t words, uint32_t* out) {
  const size_t idx = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= words) return;
  const size_t blk = idx >> 7;
  out[idx] = packed_sign_word(raw, N, K, int(blk / KB), int(blk % KB), int((idx >> 2) & 31), int(idx & 3));
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// loaded_code: what this kernel's code was compiled with shows in the size of its static shared memory,
// which the host reads from its attributes without launching it.
constexpr int kProbeBytes = 16, kProbeSm90a = 1024, kProbeGriddep = 2048;
__global__ void code_probe_kernel(int* out) {
#ifdef BITDELTA_FUSED_WGMMA
  constexpr int kSm90a = kProbeSm90a;
#else
  constexpr int kSm90a = 0;
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // (launch.cuh's condition for griddepcontrol)
  constexpr int kGriddep = kProbeGriddep;
#else
  constexpr int kGriddep = 0;
#endif
  __shared__ unsigned char s[kProbeBytes + kSm90a + kGriddep];
  s[threadIdx.x] = 1;
  __syncthreads();
  if (out) *out = s[blockDim.x - 1];
}

// The device and its loaded code, asked at every launch (hundreds per decode step): kept per device
// without a lock.
struct CodeFacts {
  int major = 0, minor = 0;
  LoadedCode code;
};
CodeFacts code_facts() {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices];  // 1 + (major << 20 | minor << 16 | ptx << 4 | sm90a << 1 | griddep), or 0
  int dev = 0;
  BITDELTA_CUDA_CHECK(cudaGetDevice(&dev));
  int v = dev < kDevices ? known[dev].load(std::memory_order_relaxed) : 0;
  if (v == 0) {
    int major = 0, minor = 0;
    BITDELTA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    BITDELTA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    cudaFuncAttributes attr{};
    BITDELTA_CUDA_CHECK(cudaFuncGetAttributes(&attr, code_probe_kernel));
    const int extra = int(attr.sharedSizeBytes) - kProbeBytes;
    if (extra < 0 || (extra & ~(kProbeSm90a | kProbeGriddep)) != 0)
      fail("cuda: the code probe's shared memory is ", attr.sharedSizeBytes, " bytes, not a known form");
    v = 1 + (std::min(major, 127) << 20 | (minor & 15) << 16 | (std::min(attr.ptxVersion, 4095) << 4) |
             ((extra & kProbeSm90a) ? 2 : 0) | ((extra & kProbeGriddep) ? 1 : 0));
    if (dev < kDevices) known[dev].store(v, std::memory_order_relaxed);
  }
  --v;
  CodeFacts f;
  f.major = v >> 20, f.minor = (v >> 16) & 15;
  f.code.ptx_version = (v >> 4) & 4095, f.code.sm90a = (v >> 1) & 1, f.code.griddepcontrol = v & 1;
  return f;
}

}  // namespace

// code_arch.h
LoadedCode loaded_code() { return code_facts().code; }

bool sm90a_kernels_run() {
  const CodeFacts f = code_facts();
  return f.major == 9 && f.minor == 0 && f.code.sm90a;
}

bool dependent_launch_supported() {
  const CodeFacts f = code_facts();
  return f.major >= 9 && f.code.griddepcontrol;
}

void prefer_shared_config(const void* kernel, unsigned bytes) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, unsigned> last_set;  // the bytes last asked for
  int dev = 0;
  BITDELTA_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  unsigned& last = last_set.try_emplace({dev, kernel}, 0u).first->second;
  if (last == bytes) return;  // every launch but a kernel's first (or the one-row kernel's at a new size)
  int per_sm = 0;
  BITDELTA_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  if (per_sm <= 0) return;
  // The configuration: the least of sm_80/sm_90's (KB) that holds `bytes`; as a percentage of the most
  // a multiprocessor has, rounded down, which the driver rounds up to that configuration again (64 KB
  // of the H200's 228: 28%, 63.8 KB).
  unsigned config = unsigned(per_sm);
  for (unsigned kb : {8u, 16u, 32u, 64u, 100u, 132u, 164u, 196u, 228u})
    if ((kb << 10) >= bytes) {
      config = std::min(config, kb << 10);
      break;
    }
  const int pct = int(uint64_t(config) * 100 / unsigned(per_sm));
  BITDELTA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, pct));
  last = bytes;
}

size_t packed_signs_bytes(int N, int K) { return packed_sign_words(N, K) * 4; }

void pack_signs(const uint8_t* raw, int N, int K, uint8_t* packed, cudaStream_t stream) {
  if (N < 1 || K < 1) fail("cuda::pack_signs: empty shape [", N, ", ", K, "]");
  if (!aligned16(packed)) fail("cuda::pack_signs: output not 16-byte aligned");
  const size_t words = packed_sign_words(N, K);
  pack_signs_kernel<<<unsigned((words + 255) / 256), 256, 0, stream>>>(raw, N, K, sign_blocks(K), words,
                                                                       reinterpret_cast<uint32_t*>(packed));
  BITDELTA_CUDA_CHECK_LAUNCH();
}

void fused_linear_decode(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows,
                         std::span<const DeltaRef> deltas, float* y, cudaStream_t stream,
                         const DecodeOptions& options) {
  if (rows < 1 || rows > kMaxDecodeRows)
    fail("cuda::fused_linear_decode: ", rows, " rows (1..", kMaxDecodeRows, " allowed)");
  if (int(deltas.size()) != rows)
    fail("cuda::fused_linear_decode: ", deltas.size(), " deltas for ", rows, " rows");
  if (N < 1 || K < 1) fail("cuda::fused_linear_decode: empty weight [", N, ", ", K, "]");
  // Rows that share signs must share alpha.
  int variants = 0;
  for (int r = 0; r < rows; ++r) {
    const DeltaRef& d = deltas[r];
    if (!d.signs) continue;
    if (!d.alpha) fail("cuda::fused_linear_decode: row ", r, " has signs but no alpha");
    if (!aligned16(d.signs)) fail("cuda::fused_linear_decode: row ", r, "'s packed signs are not 16-byte aligned");
    int q = 0;
    while (q < r && deltas[q].signs != d.signs) ++q;
    if (q == r)
      ++variants;
    else if (deltas[q].alpha != d.alpha || deltas[q].alpha_per_row != d.alpha_per_row)
      fail("cuda::fused_linear_decode: rows share signs ", d.signs, " but not alpha");
  }
  if (options.delta_store && !options.delta_only)
    fail("cuda::fused_linear_decode: delta_store takes delta_only (it writes the delta terms alone)");
  if (options.delta_only) {  // delta_terms.cuh: every row in one launch after x's quantization
    if (options.form_weights || options.kernel != DecodeKernel::kAuto)
      fail("cuda::fused_linear_decode: delta_only takes no kernel and no form_weights");
    if (variants == 0) return;  // nothing to add
    const uint8_t* xq = options.xq;
    if (xq && !aligned16(xq)) fail("cuda::fused_linear_decode: quantized x not 16-byte aligned");
    if (!xq) {
      auto* scratch = static_cast<uint8_t*>(stream_scratch(ScratchUse::kQuantizedX, stream, quantized_x_bytes(rows, K)));
      quantize_x(x, rows, K, scratch, stream, true);
      xq = scratch;
    }
    return delta_terms(xq, rows, N, K, deltas, y, stream, options.delta_store, options.k_split);
  }
  if (options.form_weights) {
    if (options.kernel == DecodeKernel::kBalanced)
      fail("cuda::fused_linear_decode: form_weights runs on the streaming or the register kernel, not kBalanced");
    if (!deltas[0].signs) fail("cuda::fused_linear_decode: form_weights: row 0 has no delta");
    for (int r = 1; r < rows; ++r)
      if (deltas[r].signs != deltas[0].signs)
        fail("cuda::fused_linear_decode: form_weights needs every row of one variant; row ", r, " differs");
    if (options.kernel != DecodeKernel::kRegisters && stream_kernel_supports(w, K, x)) {
      StreamArgs a{};
      a.w = w, a.N = N, a.K = K, a.x = x, a.rows = rows, a.deltas = deltas.data(), a.y = y;
      a.blocks = options.blocks, a.stages = options.stages, a.form_weights = true;
      return fused_linear_stream(a, stream);
    }
    if (options.kernel == DecodeKernel::kStream)
      fail("cuda::fused_linear_decode: the streaming kernel does not run here (sm_90a, K a multiple of 8)");
    // The register kernel's W_eff form: every row in one launch.
    WeffParams p{};
    p.w = w, p.x = x, p.y = y, p.N = N, p.K = K, p.KB = sign_blocks(K), p.rows = rows;
    p.signs = reinterpret_cast<const uint4*>(deltas[0].signs);
    p.alpha = deltas[0].alpha, p.alpha_per_row = deltas[0].alpha_per_row ? 1 : 0;
    p.k_split = options.k_split ? options.k_split : weff_default_k_split(N);
    if (p.k_split != 1 && p.k_split != 2 && p.k_split != 4 && p.k_split != 8)
      fail("cuda::fused_linear_decode: k_split ", p.k_split, " (1, 2, 4 or 8)");
    p.aligned = K % kKBlock == 0 && aligned16(w) && aligned16(x);
    if (rows <= 8) return launch_weff<1, 2>(p, stream);
    if (rows <= 16) return launch_weff<2, 2>(p, stream);
    if (rows <= 24) return launch_weff<3, 1>(p, stream);
    return launch_weff<4, 1>(p, stream);
  }
  const bool streaming = options.kernel != DecodeKernel::kRegisters &&
                         stream_kernel_supports(w, K, x) &&
                         variants <= kMaxStreamVariants &&
                         (options.kernel == DecodeKernel::kStream || stream_kernel_preferred(N, K, rows));
  if (!streaming && rows > kMaxRows) {  // the register kernel takes 16 rows at a time
    DecodeOptions each = options;
    each.xq = nullptr;  // the layout is per launch's rows
    fused_linear_decode(w, N, K, x, kMaxRows, deltas.first(kMaxRows), y, stream, each);
    return fused_linear_decode(w, N, K, x + size_t(kMaxRows) * K, rows - kMaxRows, deltas.subspan(kMaxRows),
                               y + size_t(kMaxRows) * N, stream, each);
  }
  int k_split = options.k_split;
  if (!streaming) {
    if (k_split == 0) k_split = decode_default_k_split(N, rows);
    if (k_split != 1 && k_split != 2 && k_split != 4 && k_split != 8)
      fail("cuda::fused_linear_decode: k_split ", k_split, " (1, 2, 4 or 8)");
  }
  DecodeParams p{};
  p.w = w;
  p.x = x;
  p.y = y;
  p.N = N;
  p.K = K;
  p.KB = sign_blocks(K);
  p.rows = rows;
  p.k_split = k_split;
  // The vector path needs whole 64-column steps and 16-byte aligned rows.
  p.aligned = K % kKBlock == 0 && aligned16(w) && aligned16(x);
  // The register kernel's slots: one per row, or per variant and group of 4 rows when that saves
  // slots and the groups fit the warps. (The streaming kernel takes up to 32 rows and needs only to
  // know whether any row has a delta.)
  Slot by_row[kMaxDecodeRows], by_group[kMaxDecodeRows];
  int nrow = 0, ngroup = 0;
  for (int r = 0; r < rows; ++r) {
    const DeltaRef& d = deltas[r];
    if (!d.signs) continue;
    if (r < kMaxRows) {
      p.alpha[r] = d.alpha;
      p.alpha_per_row[r] = d.alpha_per_row ? 1 : 0;
    }
    const auto* sg = reinterpret_cast<const uint4*>(d.signs);
    by_row[nrow++] = Slot{sg, r, 1u};
    int s = 0;
    while (s < ngroup && !(by_group[s].signs == sg && by_group[s].row0 == r / 4 * 4)) ++s;
    if (s == ngroup) by_group[ngroup++] = Slot{sg, r / 4 * 4, 0};
    by_group[s].mask |= 1u << (r % 4);
  }
  if (options.rows_per_slot != 0 && options.rows_per_slot != 1 && options.rows_per_slot != 4)
    fail("cuda::fused_linear_decode: rows_per_slot ", options.rows_per_slot, " (0, 1 or 4)");
  const bool grouped = ngroup <= kWarps && (options.rows_per_slot == 4 || (options.rows_per_slot == 0 && ngroup < nrow));
  p.nslots = grouped ? ngroup : nrow;
  if (!streaming)
    for (int s = 0; s < p.nslots; ++s) p.slots[s] = grouped ? by_group[s] : by_row[s];
  // One row: the balanced grid, which quantizes x itself unless options.xq passes it, unless the
  // register kernel's own grid was asked for.
  const DeltaRef* row_delta = deltas[0].signs ? &deltas[0] : nullptr;
  if (!streaming && rows == 1 && options.kernel != DecodeKernel::kRegisters) {
    const uint8_t* row_xq = row_delta ? options.xq : nullptr;
    if (row_xq && !aligned16(row_xq)) fail("cuda::fused_linear_decode: quantized x not 16-byte aligned");
    const RowPlan plan = plan_row(N, K, row_delta != nullptr && !row_xq);
    if (plan.valid) return launch_row(plan, w, N, K, x, row_delta, row_xq, y, p.aligned, stream);
  }
  // The rows of x quantized for the delta term: as the caller passed them, or else quantized into a
  // scratch buffer of this stream (calls on one stream reuse it in stream order), by the streaming
  // kernel itself or by a launch before the register kernel.
  p.xq_block = quantized_x_block(rows);
  uint8_t* scratch = nullptr;
  if (p.nslots && options.xq) {
    if (!aligned16(options.xq)) fail("cuda::fused_linear_decode: quantized x not 16-byte aligned");
    p.xq = options.xq;
  } else if (p.nslots) {
    scratch = static_cast<uint8_t*>(stream_scratch(ScratchUse::kQuantizedX, stream, quantized_x_bytes(rows, K)));
    p.xq = scratch;
    if (!streaming) quantize_x(x, rows, K, scratch, stream);
  }
  if (streaming) {
    StreamArgs a{};
    a.w = w, a.N = N, a.K = K, a.x = x, a.rows = rows, a.deltas = deltas.data();
    if (scratch)
      a.xq_scratch = scratch;
    else if (p.nslots)
      a.xq = p.xq;
    a.y = y, a.blocks = options.blocks, a.stages = options.stages;
    return fused_linear_stream(a, stream);
  }
  if (rows <= 8)
    launch_slots<1>(p, grouped, stream);
  else
    launch_slots<2>(p, grouped, stream);
}

size_t quantized_x_bytes(int rows, int K) { return size_t(sign_blocks(K)) * quantized_x_block(rows); }

void quantize_x(const __nv_bfloat16* x, int rows, int K, uint8_t* xq, cudaStream_t stream, bool pairs) {
  if (rows < 1 || rows > kMaxDecodeRows || K < 1) fail("cuda::quantize_x: ", rows, " rows of ", K, " columns");
  const int KB = sign_blocks(K), span = pairs ? 2 : 1, items = rows * ((KB + span - 1) / span) * span * 8;
  launch_chained(prepare_x_kernel, dim3(unsigned((items + kPrepThreads - 1) / kPrepThreads)), dim3(kPrepThreads), 0,
                 stream, x, rows, K, KB, aligned16(x) && K % 8 == 0, xq, quantized_x_block(rows), pairs);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

void quantize_x_in_block(const __nv_bfloat16* x, int K, uint8_t* xq, cudaStream_t stream) {
  if (K < 1) fail("cuda::quantize_x_in_block: ", K, " columns");
  const size_t smem = size_t(sign_blocks(K)) * kRowPlaneBytes;
  if (smem > kRowSmemMax) fail("cuda::quantize_x_in_block: ", K, " columns need more shared memory than a block has");
  if (smem > (48u << 10)) allow_row_smem<quantize_in_block_kernel>();
  quantize_in_block_kernel<<<1, kWarps * 32, smem, stream>>>(x, K, K % 8 == 0 && aligned16(x), xq);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

int weff_default_k_split(int N) {
  // The fewest warps per tile along K (2, 4, 8) that still give every multiprocessor a block: the
  // warps of a block then share more of their loads of x (through L1). Run 279 (compute_80 build,
  // 2-32 rows of one variant): the fastest of 2, 4 and 8 at all five benchmark shapes, or within 1%
  // (bench/cuda/NOTES.md, part 30).
  const int64_t tiles = (int64_t(N) + 15) / 16, sms = multiprocessors();
  for (int ks : {2, 4})
    if ((tiles * ks + kWarps - 1) / kWarps >= sms) return ks;
  return kWarps;
}

int decode_default_k_split(int N, int rows) {
  // Measured (bench/cuda/NOTES.md, run 5 with v6, run 18 with v8): k_split 8 was fastest or within
  // 2% at every benchmark shape, N = 4096..28672: more warps per tile keep more bytes in flight. For
  // one row, the most warps per tile (8, then 4) that still fits every block in one wave (2 blocks
  // per multiprocessor), else 2: at 8192 rows 4 took 40.16 µs against 41.22 with 8 (run 76); at
  // 11008 and 28672 rows 2 was 2–8% faster than 8 (runs 41, 47, 49) and 4 slower than both (run 76).
  if (rows != 1) return kWarps;
  const int sms = multiprocessors();
  const int64_t tiles = (int64_t(N) + 15) / 16;
  for (int ks : {kWarps, kWarps / 2})
    if ((tiles * ks + kWarps - 1) / kWarps <= 2 * int64_t(sms)) return ks;
  return 2;
}

}  // namespace bitdelta::cuda
