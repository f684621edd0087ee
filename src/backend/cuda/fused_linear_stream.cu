#include "fused_linear_stream.cuh"

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "block_trace.cuh"
#include "cuda_check.cuh"
#include "delta_b1.cuh"
#include "fused_linear_decode.cuh"
#include "launch.cuh"
#include "packed_signs.h"
#include "stream_scratch.cuh"
#include "tma.cuh"

namespace bitdelta::cuda {
namespace {

constexpr int kBM = 64;          // output rows per tile: wgmma's M for one warpgroup
constexpr int kBK = 256;         // columns per stage: one packed sign block
constexpr int kMaxRows = 32;     // rows of x per launch
// Three consumer warpgroups (two until part 20: the 32-row kernel is bound by its consumers, and a third
// made the mixed batch-32 decode step 3% faster, run 207), and a producer warpgroup (one thread issues
// the copies: one thread W and x, one the sign tiles and x's bit-planes).
constexpr int kGroups = 3;
constexpr int kConsumers = 128 * kGroups;
constexpr int kThreads = kConsumers + 128;
// Registers per thread (setmaxnreg): the consumers take what the producer warpgroup does not need.
// setmaxnreg only moves registers within the block's allocation at launch (128 per thread: consumers
// 152, producer 56, which its two copy threads need: at 40 they spilled), and an increase waits until
// they are free: more in all hangs the block (run 201).
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8, kProducerRegs = 56;
constexpr int kConsumerRegs = (kThreads * kLaunchRegs - 128 * kProducerRegs) / kConsumers / 8 * 8;
static_assert(kConsumers * kConsumerRegs + 128 * kProducerRegs <= kThreads * kLaunchRegs);
constexpr int kWStage = kBM * kBK * 2;     // W's bytes per stage: 4 swizzled chunks of 64 × 64
constexpr int kSignTile = kBM / 16 * 512;  // one variant's sign bits per stage
constexpr int kMaxStages = 8;

// A stage: [W: 4 chunks × 64 rows × 128 B][x: 4 chunks × BN rows × 128 B][signs: nvar × 2 KB]
// [quantized x: one block of quantized_x_block(rows) bytes], 1024-byte aligned (the swizzle atoms).
struct StreamParams {
  CUtensorMap w, x;
  CUtensorMap signs[kMaxStreamVariants];  // per distinct variant
  uint8_t* xq;
  // With quantize: the kernel quantizes x (xg) into xq first, block b taking 256-column blocks b,
  // b + blocks, …, and then sets ready[kb] = 1 (one word per block of K, then a count of the blocks
  // that have seen them all; zero between launches: see the kernel).
  const __nv_bfloat16* xg;
  unsigned long long* ready;
  int quantize, K;
  float* y;
  // Where the two sums of a tile cut between two blocks meet: one word per row of x and tile row,
  // [tile][row][64], zero between launches (see the kernel).
  unsigned long long* meet;
  const float* alpha[kMaxRows];  // per delta row
  int drow[kMaxRows];            // delta rows: row of x, and index into signs
  int dvar[kMaxRows];
  int alpha_per_row[kMaxRows];
  // Units: (64-row tile, 256-column block), tiles·KB of them in tile order; block b takes the range
  // [units·b / blocks, units·(b + 1) / blocks), in whole tiles when `whole`.
  // tx_w: a stage's bytes of W and x (the base's half); tx_d: of the sign tiles and x's bit-planes.
  int N, KB, rows, nvar, nd, units, blocks, whole, stages, stage_bytes, tx_w, tx_d, xq_block;
#ifdef BITDELTA_STREAM_TRACE
  int knock;  // StreamKnock bits (fused_linear_stream.cuh)
#endif
};

#ifdef BITDELTA_STREAM_TRACE
// The timeline diagnostic (CMake option BITDELTA_STREAM_TRACE; bench_cuda_fused_linear --stream-trace):
// each block's events, %globaltimer in ns (stream_trace_take, fused_linear_stream.cuh).
__device__ unsigned long long g_stream_trace[kTraceBlocks * kTraceEvents];
__device__ __forceinline__ void trace_at(int event, unsigned long long value) {
  if (blockIdx.x < kTraceBlocks) g_stream_trace[blockIdx.x * kTraceEvents + event] = value;
}
__device__ __forceinline__ void trace_now(int event) { trace_at(event, trace_clock()); }
#define STREAM_TRACE(cond, event) \
  if (cond) trace_now(event)
#else
#define STREAM_TRACE(cond, event)
#endif

// Consumer warpgroup g's delta rows of ND: warpgroup 0 (which also runs the base) takes the first
// H = ND / 3, warpgroups 1 and 2 share the rest (with none for warpgroup 0, 16 rows each spilled at 152
// registers). group_first_row: its first; group_rows: how many.
template <int ND>
__host__ __device__ constexpr int group_first_row(int g) {
  constexpr int H = ND / kGroups;
  return g == 0 ? 0 : H + (ND - H) * (g - 1) / (kGroups - 1);
}
template <int ND>
__host__ __device__ constexpr int group_rows(int g) {
  constexpr int H = ND / kGroups;
  return g == 0 ? H : H + (ND - H) * g / (kGroups - 1) - group_first_row<ND>(g);
}

#ifdef BITDELTA_FUSED_WGMMA
// d (64 rows × BN columns of f32 per warpgroup) += A (desc: 64 × 16 of W) · B (desc: 16 × BN of xᵀ),
// both K-major in shared memory. scale-d as an immediate (see the prefill kernel's wgmma).
template <int BN, bool Accumulate>
__device__ __forceinline__ void wgmma_ss(float (&d)[BN / 2], uint64_t da, uint64_t db) {
  static_assert(BN == 8 || BN == 16 || BN == 32);
  if constexpr (BN == 8)
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, %6, 1, 1, 0, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(da), "l"(db), "n"(Accumulate ? 1 : 0));
  if constexpr (BN == 16)
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, %10, 1, "
        "1, 0, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "n"(Accumulate ? 1 : 0));
  if constexpr (BN == 32)
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15}, %16, %17, %18, 1, 1, 0, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "n"(Accumulate ? 1 : 0));
}

// x's 256-column blocks b, b + blocks, … (b: this block) quantized into xq as prepare_x does (a thread
// per row of x and 32 columns: quantize_item), by threads t = 0..n − 1 of the calling ones (n and
// their first thread's index multiples of 32); the caller then synchronizes them and publishes the
// blocks (StreamParams::ready).
__device__ __forceinline__ void quantize_blocks(const __nv_bfloat16* x, int K, int rows, int KB, int blocks, uint8_t* xq,
                                             int xq_block, int t, int n) {
  for (int kb = blockIdx.x; kb < KB; kb += blocks)
    for (int it = t; it < rows * 8; it += n)  // whole groups of 8 lanes; aligned: operands_fit
      quantize_x_item(x, K, true, it >> 3, kb, it & 7, xq, xq_block);
  fence_proxy_async_global();  // the writes, before other blocks' copies read them
}

#endif

// Persistent: block b takes the range [units·b / blocks, units·(b + 1) / blocks) of the (64-row tile,
// 256-column block) units in tile order (ranges of whole tiles where that is within 5% of even): a
// piece of the tile where the range starts, whole tiles, a piece of the tile where it ends. A range
// holds at least KB units, or exactly half a tile, so a tile is cut between at most two blocks. The
// producer's ring runs on across pieces, so a piece's first copies fly while the last one's epilogue
// runs. A slot's W and x, and its signs and bit-planes, are refilled apart (two barrier pairs, two
// producer threads): W goes back once the base's wgmma is done. A piece's sums go to shared memory
// (two buffers, in turn), then to y: a whole tile's are stored, a cut tile's meet the other block's
// by exchange, with no wait (write_piece). W and the
// signs of the first stages are issued before the wait for the kernel before (launch.cuh); x after
// it. x's bit-planes: with `quantize`, the consumers of block b first quantize x's 256-column blocks
// b, b + blocks, … into xq (quantize_blocks) and publish each (ready[kb] = 1, released), and the
// producer warp that copies the bit-planes waits until every block of K is published before it
// copies any; blocks ≤ multiprocessors, so all are resident and no wait is circular. The last block
// whose warp has seen them all sets the words back to zero for the next launch (no block reads or
// writes them again; the next launch touches them only after its wait for this one), so that a
// launch carries no value of its own: the same launch can be replayed (a CUDA graph of the step). (Until part 19 a launch before,
// prepare_x, quantized x: the linear then waited for two kernels to finish, not one.)
// (Until part 17 the tiles left over after whole ones were split in up to 8 parts that met through
// memory in part order, early parts released with a count, final parts waiting for it: NOTES.md.)
// BN: rows of x per tile (8, 16 or 32, the wgmma's N; rows past `rows` are zero-filled by the TMA).
// ND: delta rows computed per stage (nd rounded up; the padding repeats delta row 0 and is dropped), a
// constant so that the delta loop has no branches and its rows' 1-bit mma overlap.
// Weff (with ND = 0; every row of one variant, StreamArgs::form_weights): the variant's sign tile
// comes with W, and all consumers first turn the stage's W into W_eff = W + α·S in bf16, in place
// (each thread 5–6 of its 2048 16-byte units), so that warpgroup 0's wgmma computes the delta with the
// base: the rows' 1-bit mma would cost per row what W_eff costs once.
template <int BN, int ND, bool Weff = false>
__global__ void __launch_bounds__(kThreads, 1) stream_kernel(const __grid_constant__ StreamParams p) {
  static_assert(!Weff || ND == 0, "W_eff replaces the delta rows");
#ifdef BITDELTA_FUSED_WGMMA
  pdl_launch_dependents();  // launch.cuh: the next kernel may start; this one waits below
  STREAM_TRACE(threadIdx.x == 0, kTraceEntry);
#ifdef BITDELTA_STREAM_TRACE
  if (threadIdx.x == 0) trace_at(kTraceSm, trace_sm());
#endif
  constexpr int kXStage = 4 * BN * 128;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
#ifdef BITDELTA_STREAM_TRACE
  const int knock = p.knock;
#else
  constexpr int knock = 0;
#endif
  const int S = p.stages;
  float* red0 = reinterpret_cast<float*>(smem + S * p.stage_bytes);  // [2][BN][64]: pieces' sums, in turn
  // Two rings over the same slots: a slot's W and x (kFullW / kEmptyW: warpgroup 0, the base) and its
  // sign tiles and bit-planes (kFullD / kEmptyD: the warpgroups with delta rows) are refilled apart, by
  // two producer threads, so that W, the most bytes, goes back to the producer once the base's wgmma
  // is done rather than after every delta row of the slot (a ring of two stages at 16 and 32 rows:
  // the consumers' time on a stage added to each refill's latency; part 21).
  // Slot s's four barriers at bars + 32·s: kFullW, kEmptyW, kFullD, kEmptyD (one address per slot, the
  // others at immediate offsets from it).
  const uint32_t bars = smem_addr(red0 + 2 * kBM * BN);
  constexpr int kFullW = 0, kEmptyW = 8, kFullD = 16, kEmptyD = 24;  // a slot's barriers (byte offsets)
  constexpr int kDeltaArrivals = 128 * ((group_rows<ND>(0) > 0) + (group_rows<ND>(1) > 0) + (group_rows<ND>(2) > 0));
  // Per padded delta row d (the padding repeats delta row 0): the byte offsets of its sign tile in a
  // stage, of its row's bit-planes and of its row's (scale, Σq) in the quantized block. One 16-byte
  // load per row and stage, where the offsets read from the parameters took about a dozen
  // instructions (a select, two indexed constant loads, the multiplications). Alone it was up to 2%
  // slower; with delta_block_unshifted, 1-3% faster at 32 rows of 14 variants than either (runs
  // 209-210).
  const uint32_t dtab = bars + 32 * S;  // int4[ND]
  const int sgn_off = kWStage + kXStage, xq_off = sgn_off + p.nvar * kSignTile;
  const int tid = threadIdx.x;
  const int per = p.whole ? p.KB : 1, items = p.units / per;
  const int u0 = int(int64_t(items) * blockIdx.x / p.blocks) * per;
  const int u1 = int(int64_t(items) * (blockIdx.x + 1) / p.blocks) * per;
  // Calls f(T, kb0, nst) for the block's pieces in tile order: tile T, blocks [kb0, kb0 + nst) of K.
  // Stops where f returns false. (The cut tiles first, whole tiles last, as the one-row kernel takes
  // them, was 0.2–1.7% slower here: runs 169–170.)
  const int T0 = u0 / p.KB, pieces = u1 > u0 ? (u1 - 1) / p.KB - T0 + 1 : 0;
  const auto for_pieces = [&](auto&& f) {
    for (int j = 0; j < pieces; ++j) {
      const int T = T0 + j, from = max(u0, T * p.KB), to = min(u1, (T + 1) * p.KB);
      if (!f(T, from - T * p.KB, to - from)) return;
    }
  };
  // A piece's sums red[row of x][tile row] to y; a cut tile's two blocks meet in p.meet, a word per
  // element (meet_swap / meet_sum, stream_scratch.cuh), the second writing y. Both swap every word of
  // the piece's rows, past N too, so that all are emptied again. A thread's swaps are issued
  // together, so that their round trips overlap.
  const auto write_piece = [&](const float* red, int T, bool cut) {
    const int from = tid, step = kConsumers;
    const int n0 = T * kBM, valid = min(kBM, p.N - n0), count = p.rows * kBM;
    if (!cut) {
      for (int e = from; e < count; e += step)
        if ((e & (kBM - 1)) < valid) p.y[size_t(e / kBM) * p.N + n0 + (e & (kBM - 1))] = red[e];
      return;
    }
    unsigned long long* meet = p.meet + size_t(T) * count;
    constexpr int kBatch = 4;  // exchanges in flight per thread
    for (int e0 = from; e0 < count; e0 += kBatch * step) {
      unsigned long long other[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int e = e0 + j * step;
        other[j] = e < count ? meet_swap(meet + e, red[e]) : 0ull;
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int e = e0 + j * step;
        if (other[j] == 0) continue;  // the other block writes y
        const float v = meet_sum(meet + e, red[e], other[j]);
        if ((e & (kBM - 1)) < valid) p.y[size_t(e / kBM) * p.N + n0 + (e & (kBM - 1))] = v;
      }
    }
  };
  if (tid < ND) {
    const int d = tid < p.nd ? tid : 0, row = p.drow[d];
    asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(dtab + 16 * tid),
                 "r"(sgn_off + p.dvar[d] * kSignTile), "r"(xq_off + kQuantizedPlanes + row * 512),
                 "r"(xq_off + row * 8), "r"(0)
                 : "memory");
  }
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(bars + 32 * s + kFullW, 1);
      mbar_init(bars + 32 * s + kEmptyW, 128);
      if constexpr (ND > 0) {
        mbar_init(bars + 32 * s + kFullD, 1);
        mbar_init(bars + 32 * s + kEmptyD, kDeltaArrivals);
      }
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // The producer: per ring stage `it` (block kb of the tile at n0), W, x and the sign tiles, and x's
  // bit-planes. W and the signs are weights: those of the first S stages are issued before the wait for
  // the kernel before (launch.cuh), so that they stream into shared memory while it finishes; x and its
  // bit-planes, written by kernels, after. W and x complete the slot's kFullW barrier, the signs and
  // bit-planes its kFullD; the producer warpgroup's first warp refills the former, its second warp
  // (which also waits for x's quantized blocks) the latter.
  const auto issue_w = [&](int it, int n0, int kb) {
    const int slot = it % S, k0 = kb * kBK;
    const uint32_t st = smem_addr(smem + slot * p.stage_bytes), full = bars + 32 * slot + kFullW;
    mbar_expect_tx(full, p.tx_w);
#pragma unroll
    for (int c = 0; c < 4; ++c) tma_2d(st + c * (kBM * 128), &p.w, k0 + 64 * c, n0, full);
    if constexpr (Weff) tma_3d(st + sgn_off, &p.signs[0], 0, kb, n0 / 16, full);
  };
  const auto issue_signs = [&](int it, int n0, int kb) {
    const int slot = it % S;
    const uint32_t st = smem_addr(smem + slot * p.stage_bytes), full = bars + 32 * slot + kFullD;
    mbar_expect_tx(full, p.tx_d);
    for (int v = 0; v < p.nvar; ++v) tma_3d(st + sgn_off + v * kSignTile, &p.signs[v], 0, kb, n0 / 16, full);
  };
  const auto issue_x = [&](int it, int kb) {
    if (knock & kKnockXCopies) return;
    const int slot = it % S, k0 = kb * kBK;
    const uint32_t st = smem_addr(smem + slot * p.stage_bytes), full = bars + 32 * slot + kFullW;
#pragma unroll
    for (int c = 0; c < 4; ++c) tma_2d(st + kWStage + c * (BN * 128), &p.x, k0 + 64 * c, 0, full);
  };
  const auto issue_xq = [&](int it, int kb) {
    if (knock & kKnockXCopies) return;
    const int slot = it % S;
    const uint32_t st = smem_addr(smem + slot * p.stage_bytes), full = bars + 32 * slot + kFullD;
    tma_1d(st + xq_off, p.xq + size_t(kb) * p.xq_block, uint32_t(p.xq_block), full);
  };
  // Calls f(it, n0, kb) for the block's ring stages it in [from, to).
  const auto for_stages = [&](int from, int to, auto&& f) {
    int it = 0;
    for_pieces([&](int T, int kb0, int nst) {
      for (int i = 0; i < nst && it < to; ++i, ++it)
        if (it >= from) f(it, T * kBM, kb0 + i);
      return it < to;
    });
  };
  if (tid == kConsumers)
    for_stages(0, S, [&](int it, int n0, int kb) {
      issue_w(it, n0, kb);
      if constexpr (ND > 0) issue_signs(it, n0, kb);
    });
  pdl_wait();

  if (tid >= kConsumers) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (tid == kConsumers) {  // W and x: the first warp's first thread
      for_stages(0, S, [&](int it, int, int kb) { issue_x(it, kb); });
      for_stages(S, 1 << 30, [&](int it, int n0, int kb) {
        mbar_wait(bars + 32 * (it % S) + kEmptyW, ((it / S) & 1) ^ 1);
        issue_w(it, n0, kb);
        issue_x(it, kb);
      });
      STREAM_TRACE(true, kTraceIssued);
    } else if (ND > 0 && tid >= kConsumers + 32 && tid < kConsumers + 64) {  // the second warp: signs, planes
      if (p.quantize) {
        // Every block's x blocks quantized (below): the warp polls the words together.
        const int lane = tid - kConsumers - 32;
        for (int kb = lane; kb < p.KB; kb += 32)
          while (ld_acquire_u64(p.ready + kb) != 1ull) {
          }
        __syncwarp();
        fence_proxy_async_global();  // the generic writes seen, before the copies read them
        // Counted at ready[KB]; the last block to get here zeroes the words for the next launch.
        int last = 0;
        if (lane == 0) last = atomicAdd(p.ready + p.KB, 1ull) == static_cast<unsigned long long>(p.blocks - 1);
        if (__shfl_sync(~0u, last, 0)) {
          for (int kb = lane; kb <= p.KB; kb += 32) p.ready[kb] = 0;
        }
      }
      if (tid == kConsumers + 32) {
        for_stages(0, S, [&](int it, int, int kb) { issue_xq(it, kb); });
        for_stages(S, 1 << 30, [&](int it, int n0, int kb) {
          mbar_wait(bars + 32 * (it % S) + kEmptyD, ((it / S) & 1) ^ 1);
          issue_signs(it, n0, kb);
          issue_xq(it, kb);
        });
      }
    }
    __syncwarp();
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
    if (p.quantize && p.nvar > 0) {  // x's blocks of this block (quantize_blocks), then published
      quantize_blocks(p.xg, p.K, p.rows, p.KB, p.blocks, p.xq, p.xq_block, tid, kConsumers);
      consumers_sync<kConsumers>();
      if (tid == 0)
        for (int kb = blockIdx.x; kb < p.KB; kb += p.blocks) st_release_u64(p.ready + kb, 1ull);
    }
    // Warpgroup 0: the base on wgmma and delta rows [0, H); warpgroups 1 and 2 share [H, ND)
    // (group_rows). A warp's 16 rows of the tile are 16·(warp % 4)... in all. (With two warpgroups, the
    // first took 3/8 of 8 or 16 delta rows and half of 32: runs 204 and 206.)
    const int wg = tid >> 7, wq = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int s2 = sign2(t);
    const int lane_sgn = (wq * 32 + lane) * 16;
    // Weff: this thread's 16-byte units of a stage's W, u = tid + 384·m (2048 of them: 4 chunks × 64
    // rows × 8, swizzled: unit u holds tile row (u / 8) % 64, columns 64·(u / 512) + 8·((u % 8) ⊕
    // (row % 8)) of the 256), and where the byte of their 8 sign bits lies in the stage's sign tile
    // (packed_signs.h: per 16-row group 128 words, lane 4g + t's word i).
    constexpr int kWUnits = kWStage / 16, kWeffUnits = (kWUnits + kConsumers - 1) / kConsumers;
    [[maybe_unused]] int wsoff[kWeffUnits], wrow[kWeffUnits];
    if constexpr (Weff) {
#pragma unroll
      for (int m = 0; m < kWeffUnits; ++m) {
        const int u = min(tid + kConsumers * m, kWUnits - 1), r = (u >> 3) & (kBM - 1);
        const int col = 64 * (u >> 9) + 8 * ((u & 7) ^ (r & 7)), rr = r & 15;
        const int i = (rr >> 3) | ((col >> 7) << 1), ti = (col & 127) >> 5;
        wrow[m] = r;
        wsoff[m] = sgn_off + (r >> 4) * 512 + ((4 * (rr & 7) + ti) * 4 + i) * 4 + ((col & 31) >> 3);
      }
    }
    // Warpgroup kG's work; kBase: warpgroup 0 (each form without a branch around its wgmma).
    const auto consume = [&]<int kG>() {
      constexpr bool kBase = kG == 0;
      constexpr int D0 = group_first_row<ND>(kG), DN = group_rows<ND>(kG);  // its delta rows [D0, D0 + DN)
      // The ring's next stage: its slot and phase, running values (S is a parameter: a division per
      // stage otherwise).
      int slot = 0, phase = 0;
      for_pieces([&](int T, int, int nst) {
        const int n0 = T * kBM;
        float acc[BN / 2];
        // Weff: −α of each unit's row as a bf16 pair (delta_pair flips it to +α where the sign bit is 1).
        [[maybe_unused]] uint32_t nal2[kWeffUnits];
        if constexpr (Weff) {
#pragma unroll
          for (int m = 0; m < kWeffUnits; ++m) {
            const int n = min(n0 + wrow[m], p.N - 1);
            nal2[m] = neg_alpha_pair(__ldg(p.alpha[0] + (p.alpha_per_row[0] ? n : 0)));
          }
        }
        float dacc[DN > 0 ? DN : 1][2], sq[DN > 0 ? DN : 1];
#pragma unroll
        for (int d = 0; d < (DN > 0 ? DN : 1); ++d) dacc[d][0] = dacc[d][1] = sq[d] = 0.0f;
        // The piece's α (tile rows 16·wq + g + 8h), loaded now so that the stages hide the load's
        // latency rather than the epilogue waiting on it.
        float al[DN > 0 ? DN : 1][2];
#pragma unroll
        for (int d = 0; d < DN; ++d)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int n = min(n0 + 16 * wq + g + 8 * h, p.N - 1), dd = D0 + d;
            al[d][h] = dd < p.nd ? __ldg(p.alpha[dd] + (p.alpha_per_row[dd] ? n : 0)) : 0.0f;
          }
        // Stage: warpgroup 0 runs W·xᵀ on wgmma (16 steps of k16) and hands W and x back once they are
        // done; the warpgroups with delta rows run their 1-bit mma on the stage's signs and bit-planes,
        // then hand those back.
        const auto stage = [&]<bool First>() {
          const uint8_t* st = smem + slot * p.stage_bytes;
          [[maybe_unused]] const uint32_t bar = bars + 32 * slot;  // (unused by a warpgroup without work)
          if constexpr (Weff) {  // W_eff in place, by every consumer, before the wgmma reads it
            mbar_wait(bar + kFullW, phase);
            const uint32_t sa = smem_addr(st);
#pragma unroll
            for (int m = 0; m < kWeffUnits; ++m) {
              const int u = tid + kConsumers * m;
              if (kWUnits % kConsumers != 0 && u >= kWUnits) break;  // whole warps
              uint32_t w0, w1, w2, w3, s8;
              asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                           : "=r"(w0), "=r"(w1), "=r"(w2), "=r"(w3)
                           : "r"(sa + 16 * u));
              asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(s8) : "r"(sa + wsoff[m]));
              const uint32_t z = __byte_perm(s8, s8 >> 1, 0x5410);  // (delta_pair)
              w0 = bf16x2_add(w0, delta_pair(z, 15, nal2[m]));
              w1 = bf16x2_add(w1, delta_pair(z, 13, nal2[m]));
              w2 = bf16x2_add(w2, delta_pair(z, 11, nal2[m]));
              w3 = bf16x2_add(w3, delta_pair(z, 9, nal2[m]));
              asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(sa + 16 * u), "r"(w0), "r"(w1), "r"(w2),
                           "r"(w3)
                           : "memory");
            }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // seen by the wgmma (async proxy)
            consumers_sync<kConsumers>();
          }
          if constexpr (kBase) {
            if constexpr (!Weff) mbar_wait(bar + kFullW, phase);
            STREAM_TRACE(First && tid == 0 && T == T0, kTraceFirst);
            const uint64_t dw = sw128_desc(smem_addr(st)), dx = sw128_desc(smem_addr(st + kWStage));
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int c = 0; c < 4; ++c)
#pragma unroll
              for (int k = 0; k < 4; ++k) {
                const uint64_t a = dw + ((c * kBM * 128) >> 4) + 2 * k, b = dx + ((c * BN * 128) >> 4) + 2 * k;
                if (First && c == 0 && k == 0)
                  wgmma_ss<BN, false>(acc, a, b);
                else
                  wgmma_ss<BN, true>(acc, a, b);
              }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            mbar_arrive(bar + kEmptyW);  // W and x back to the producer
          }
          if constexpr (DN > 0) mbar_wait(bar + kFullD, phase);
          if (DN > 0 && !(knock & kKnockDelta)) {
            // The table's address, opaque per stage, so that the rows' offsets are loaded again rather
            // than held in registers across the loop (with 32 rows they spilled).
            uint32_t tab = dtab;
            asm volatile("" : "+r"(tab));
#pragma unroll
            for (int d = 0; d < DN; ++d) {
              int o[4];  // dtab[D0 + d]
              asm("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                  : "=r"(o[0]), "=r"(o[1]), "=r"(o[2]), "=r"(o[3])
                  : "r"(tab + 16 * (D0 + d)));
              const uint4 a = *reinterpret_cast<const uint4*>(st + lane_sgn + o[0]);
              const uint4 b = *reinterpret_cast<const uint4*>(st + lane * 16 + o[1]);
              const float2 sc = *reinterpret_cast<const float2*>(st + o[2]);
              delta_block_unshifted(a, b, sc.x, s2, dacc[d]);
              sq[d] += sc.x * sc.y;
            }
          }
          if constexpr (DN > 0) mbar_arrive(bar + kEmptyD);
          phase ^= slot + 1 == S ? 1 : 0;
          slot = slot + 1 == S ? 0 : slot + 1;
        };
        stage.template operator()<true>();
        for (int s = 1; s < nst; ++s) stage.template operator()<false>();
        STREAM_TRACE(tid == 0 && T - T0 < kTracePieces, kTracePiece + 2 * (T - T0));

        // The piece's sums in red[row of x][tile row]: the base (acc[4j + 2h + e]: tile row 16·wq + g +
        // 8h, row of x 8j + 2t + e), then per delta row α·(2·Σ w_p·popc − Σ scale·Σq).
        // Two buffers in turn (pieces are of consecutive tiles): piece i + 2 writes this one after every
        // thread has passed piece i + 1's first barrier, so after its reads here; no barrier is needed
        // after them.
        if (knock & kKnockEpilogue) return true;
        float* red = red0 + ((T - T0) & 1) * (BN * kBM);
        if constexpr (kBase) {
#pragma unroll
          for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
              for (int e = 0; e < 2; ++e) red[(8 * j + 2 * t + e) * kBM + 16 * wq + g + 8 * h] = acc[4 * j + 2 * h + e];
        }
        consumers_sync<kConsumers>();
#pragma unroll
        for (int d = 0; d < DN; ++d)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float v = dacc[d][h] * plane_shift(t);  // (delta_block_unshifted)
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            const int nl = 16 * wq + g + 8 * h, dd = D0 + d;
            if (t == 0 && dd < p.nd) red[p.drow[dd] * kBM + nl] += al[d][h] * (2.0f * v - sq[d]);
          }
        consumers_sync<kConsumers>();
        if (!(knock & kKnockWrite)) write_piece(red, T, nst < p.KB);
        STREAM_TRACE(tid == 0 && T - T0 < kTracePieces, kTracePiece + 2 * (T - T0) + 1);
        return true;
      });
    };
    static_assert(kGroups == 3, "the dispatch names each consumer warpgroup");
    if (wg == 0)
      consume.template operator()<0>();
    else if (wg == 1)
      consume.template operator()<1>();
    else
      consume.template operator()<2>();
    STREAM_TRACE(tid == 0, kTraceDone);
  }
#endif
}

using KernelFn = void (*)(StreamParams);
// [BN 8, 16, 32][ND 0, 1, 2, 4, 8, 16, 32]
constexpr KernelFn kKernels[3][7] = {
    {stream_kernel<8, 0>, stream_kernel<8, 1>, stream_kernel<8, 2>, stream_kernel<8, 4>, stream_kernel<8, 8>, nullptr,
     nullptr},
    {stream_kernel<16, 0>, stream_kernel<16, 1>, stream_kernel<16, 2>, stream_kernel<16, 4>, stream_kernel<16, 8>,
     stream_kernel<16, 16>, nullptr},
    {stream_kernel<32, 0>, stream_kernel<32, 1>, stream_kernel<32, 2>, stream_kernel<32, 4>, stream_kernel<32, 8>,
     stream_kernel<32, 16>, stream_kernel<32, 32>}};
// W_eff formed in the stage (form_weights), ND = 0: [BN 16, 32].
constexpr KernelFn kKernelsWeff[2] = {stream_kernel<16, 0, true>, stream_kernel<32, 0, true>};
int nd_index(int nd) { return nd <= 2 ? nd : nd <= 4 ? 3 : nd <= 8 ? 4 : nd <= 16 ? 5 : 6; }

// Per device: whether the kernel runs there and its shared-memory limit (opted in once).
struct DeviceInfo {
  bool runs = false;
  int sms = 0, smem_optin = 0;
};

const DeviceInfo& device_info() {
  static std::mutex mutex;
  static std::map<int, DeviceInfo> infos;
  int dev = 0;
  BITDELTA_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard lock(mutex);
  auto [it, fresh] = infos.try_emplace(dev);
  if (fresh) {
    cudaDeviceProp prop{};
    BITDELTA_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    DeviceInfo& d = it->second;
    d.runs = sm90a_kernels_run() && tensor_map_encoder() != nullptr;
    d.sms = prop.multiProcessorCount;
    d.smem_optin = int(prop.sharedMemPerBlockOptin);
    const auto opt_in = [&](KernelFn k) {
      if (d.runs && k)
        BITDELTA_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(k),
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, d.smem_optin));
    };
    for (KernelFn k : kKernelsWeff) opt_in(k);
    for (const auto& row : kKernels)
      for (KernelFn k : row) opt_in(k);
  }
  return it->second;
}

// Tensor maps depend only on the pointer, the shape and the box: weights, deltas and the engine's
// activation buffers recur call after call, so each is encoded once (a stale entry for a freed and
// reused pointer of the same shape is the same map).
enum class MapKind { kW, kX8, kX16, kX32, kSigns };

CUtensorMap tensor_map(MapKind kind, const void* ptr, int N, int K) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int, int>, CUtensorMap> cache;
  int dev = 0;
  BITDELTA_CUDA_CHECK(cudaGetDevice(&dev));
  const auto key = std::make_tuple(int(kind) + 8 * dev, ptr, N, K);
  std::lock_guard lock(mutex);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  if (cache.size() > 4096) cache.clear();
  CUtensorMap map;
  if (kind == MapKind::kSigns) {
    // Blocks of 128 words [row group][column block]: one box = one block of 4 row groups (2 KB), each
    // 512 contiguous bytes.
    const int KB = sign_blocks(K);
    const cuuint64_t dims[3] = {128, cuuint64_t(KB), cuuint64_t((N + 15) / 16)};
    const cuuint64_t strides[2] = {512, 512 * cuuint64_t(KB)};
    const cuuint32_t box[3] = {128, 1, kBM / 16};
    encode_tensor_map(&map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 3, ptr, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_NONE);
  } else {
    const cuuint64_t dims[2] = {cuuint64_t(K), cuuint64_t(N)}, strides[1] = {cuuint64_t(K) * 2};
    const cuuint32_t rows = kind == MapKind::kW ? kBM : kind == MapKind::kX8 ? 8 : kind == MapKind::kX16 ? 16 : 32;
    const cuuint32_t box[2] = {64, rows};
    encode_tensor_map(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
  }
  cache.emplace(key, map);
  return map;
}

// The grid: one block per multiprocessor, each taking an equal range of the tiles·KB units. Ranges of
// whole tiles where that loads the busiest block at most 5% above the average (as the one-row kernel,
// fused_linear_decode.cu); else ranges of units, which hold at least KB units when blocks ≤ tiles, so
// that a tile is cut between at most two blocks. With fewer tiles than half the multiprocessors, two
// blocks per tile, each half of its K; between half and all of them, a block per tile.
// `blocks` > 0 (tests, benchmarks): that many ranges of units, at most the tiles or twice them.
struct Grid {
  int blocks, whole;
};
Grid choose_grid(int tiles, int KB, int sms, int blocks) {
  if (blocks > 0) {
    if (blocks > tiles && blocks != 2 * tiles)
      fail("cuda::fused_linear_stream: ", blocks, " blocks for ", tiles, " tiles (at most the tiles, or twice them)");
    return {blocks, 0};
  }
  if (tiles >= sms) {
    const int tpb = (tiles + sms - 1) / sms;
    if (int64_t(tpb) * sms * 100 <= int64_t(tiles) * 105) return {(tiles + tpb - 1) / tpb, 1};
    return {sms, 0};
  }
  if (2 * tiles <= sms && KB >= 2) return {2 * tiles, 0};
  return {tiles, 1};
}

}  // namespace

#ifdef BITDELTA_STREAM_TRACE
std::vector<unsigned long long> stream_trace_take() {
  return take_trace(g_stream_trace, size_t(kTraceBlocks) * kTraceEvents);
}

namespace {
int g_knock = 0;
}
void stream_knockout(int bits) { g_knock = bits; }
#endif

// TMA row strides of 16 bytes, and 16-byte aligned tensors.
static bool operands_fit(const __nv_bfloat16* w, int K, const __nv_bfloat16* x) {
  return K % 8 == 0 && (reinterpret_cast<uintptr_t>(w) & 15) == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0;
}

bool stream_kernel_supports(const __nv_bfloat16* w, int K, const __nv_bfloat16* x) {
  return device_info().runs && operands_fit(w, K, x);
}

bool stream_kernel_preferred(int N, int, int rows) {
  // Measured side by side with the register kernel (bench/cuda/NOTES.md, part 7; runs 47, 50, 53):
  //   1 row: the register kernel is as fast or faster (its 16-row tiles spread W over every
  //     multiprocessor; the streaming kernel's 64-row tiles give 4096 rows only 64);
  //   2–8 rows: the streaming kernel is 2–11% faster once W has at least 8192 rows (runs 47, 52);
  //     at 4096 × 4096 it is slower, at 4096 × 11008 within 2%;
  //   9–16 rows: it is faster or within 2% at every shape (run 53: one variant 1.07–1.43× cuBLAS
  //     against 1.15–1.91×);
  //   17–32 rows: one launch reads W once where the register kernel takes two: 1.56–1.94× faster.
  if (rows < 2) return false;
  return rows > 8 || N >= 8192;
}

void fused_linear_stream(const StreamArgs& a, cudaStream_t stream) {
  const DeviceInfo& info = device_info();
  if (!info.runs || !operands_fit(a.w, a.K, a.x)) fail("cuda::fused_linear_stream: this device or these operands");
  if (a.rows < 1 || a.rows > kMaxRows) fail("cuda::fused_linear_stream: ", a.rows, " rows (1..", kMaxRows, ")");
  // (W_eff formed takes 16 at 8 rows or fewer too: with n8 the decode step at 8 rows of one variant was
  // 7-9% slower than through the fused GEMM, with n16 5% faster: NOTES.md, part 28, runs 264-265.)
  const int BN = a.rows <= 8 && !a.form_weights ? 8 : a.rows <= 16 ? 16 : 32;
  StreamParams p{};
  p.N = a.N;
  p.KB = sign_blocks(a.K);
  p.rows = a.rows;
  p.xq = const_cast<uint8_t*>(a.xq);  // read only where quantize = 0
  p.y = a.y;
  p.w = tensor_map(MapKind::kW, a.w, a.N, a.K);
  p.x = tensor_map(BN == 8 ? MapKind::kX8 : BN == 16 ? MapKind::kX16 : MapKind::kX32, a.x, a.rows, a.K);
  const void* distinct[kMaxRows];
  if (a.form_weights) {  // one variant, every row: its tile rides with W; no delta rows, x not quantized
    const DeltaRef& d0 = a.deltas[0];
    if (!d0.signs || !d0.alpha) fail("cuda::fused_linear_stream: form_weights: row 0 has no delta");
    if ((reinterpret_cast<uintptr_t>(d0.signs) & 15) != 0)
      fail("cuda::fused_linear_stream: row 0's packed signs are not 16-byte aligned");
    for (int r = 1; r < a.rows; ++r)
      if (a.deltas[r].signs != d0.signs || a.deltas[r].alpha != d0.alpha ||
          a.deltas[r].alpha_per_row != d0.alpha_per_row)
        fail("cuda::fused_linear_stream: form_weights needs every row of one variant; row ", r, " differs");
    p.nvar = 1;
    p.signs[0] = tensor_map(MapKind::kSigns, d0.signs, a.N, a.K);
    p.alpha[0] = d0.alpha;
    p.alpha_per_row[0] = d0.alpha_per_row ? 1 : 0;
  }
  for (int r = 0; r < a.rows && !a.form_weights; ++r) {
    const DeltaRef& d = a.deltas[r];
    if (!d.signs) continue;
    if ((reinterpret_cast<uintptr_t>(d.signs) & 15) != 0)
      fail("cuda::fused_linear_stream: row ", r, "'s packed signs are not 16-byte aligned");
    int v = 0;
    while (v < p.nvar && distinct[v] != d.signs) ++v;
    if (v == p.nvar) {
      if (p.nvar == kMaxStreamVariants)
        fail("cuda::fused_linear_stream: more than ", kMaxStreamVariants, " variants in one launch");
      distinct[v] = d.signs;
      p.signs[p.nvar++] = tensor_map(MapKind::kSigns, d.signs, a.N, a.K);
    }
    p.drow[p.nd] = r;
    p.dvar[p.nd] = v;
    p.alpha[p.nd] = d.alpha;
    p.alpha_per_row[p.nd] = d.alpha_per_row ? 1 : 0;
    ++p.nd;
  }
  p.xq_block = quantized_x_block(a.rows);
  p.tx_w = kWStage + 4 * BN * 128 + (a.form_weights ? kSignTile : 0);
  p.tx_d = a.form_weights ? 0 : p.nvar * kSignTile + (p.nvar ? p.xq_block : 0);
  p.stage_bytes = (p.tx_w + p.tx_d + 1023) / 1024 * 1024;
#ifdef BITDELTA_STREAM_TRACE
  p.knock = g_knock;  // (the stages keep their layout; only the bytes each waits for change)
  if (p.knock & kKnockXCopies) {
    p.tx_w -= 4 * BN * 128;
    p.tx_d -= p.nvar ? p.xq_block : 0;
  }
#endif
  // Dynamic shared memory for S stages: alignment, the stages, red (two), a slot's four barriers, the
  // delta rows' offsets (the kernel's layout).
  const auto smem_bytes = [&](int S) {
    return 1024 + S * p.stage_bytes + 2 * kBM * BN * 4 + 32 * S + 16 * kMaxRows;
  };
  // (the barriers of kMaxStages set aside: the stage counts that runs 208-215 measured)
  p.stages = std::min(kMaxStages, (info.smem_optin - smem_bytes(0) - 32 * kMaxStages) / p.stage_bytes);
  if (a.stages > 0) p.stages = std::min(p.stages, a.stages);
  if (p.stages < 1) fail("cuda::fused_linear_stream: a stage of ", p.stage_bytes, " bytes does not fit");
  const int tiles = (a.N + kBM - 1) / kBM;
  const Grid grid = choose_grid(tiles, p.KB, info.sms, a.blocks);
  p.units = tiles * p.KB;
  p.blocks = grid.blocks;
  p.whole = grid.whole;
  if (p.nd > 0 && !a.xq == !a.xq_scratch)
    fail("cuda::fused_linear_stream: rows with a delta need x quantized or a buffer to quantize it into");
  if (p.nd > 0 && a.xq_scratch) {
    p.xq = a.xq_scratch;
    if (p.blocks <= info.sms) {  // x quantized by the blocks, which wait for each other: all resident
      p.quantize = 1;
      p.xg = a.x;
      p.K = a.K;
      p.ready = static_cast<unsigned long long*>(
          stream_scratch(ScratchUse::kStreamXReady, stream, size_t(p.KB + 1) * sizeof(unsigned long long), true));
    } else {  // a grid asked for (tests) larger than one block per multiprocessor
      quantize_x(a.x, a.rows, a.K, a.xq_scratch, stream);
    }
  }
  if (!grid.whole)  // where cut tiles' sums meet (zero between launches)
    p.meet = static_cast<unsigned long long*>(stream_scratch(
        ScratchUse::kStreamMeet, stream, size_t(tiles) * a.rows * kBM * sizeof(unsigned long long), true));
  const int smem = smem_bytes(p.stages);

  const int bi = BN == 8 ? 0 : BN == 16 ? 1 : 2;
  launch_chained(a.form_weights ? kKernelsWeff[bi - 1] : kKernels[bi][nd_index(p.nd)], dim3(unsigned(p.blocks)),
                 dim3(kThreads), size_t(smem), stream, p);
}

}  // namespace bitdelta::cuda
