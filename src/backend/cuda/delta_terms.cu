#include "delta_terms.cuh"

#include <algorithm>
#include <vector>

#include "block_trace.cuh"
#include "cuda_check.cuh"
#include "delta_b1.cuh"
#include "fused_linear_decode.cuh"
#include "launch.cuh"
#include "mma.cuh"

namespace bitdelta::cuda {
namespace {

#ifdef BITDELTA_STREAM_TRACE
__device__ unsigned long long g_terms_trace[kTermsTraceBlocks * kTermsTraceEvents];
__device__ __forceinline__ void terms_trace_at(int event, unsigned long long value) {
  if (threadIdx.x == 0 && blockIdx.x < kTermsTraceBlocks) g_terms_trace[blockIdx.x * kTermsTraceEvents + event] = value;
}
#define TERMS_TRACE(event) terms_trace_at(event, trace_clock())
#else
#define TERMS_TRACE(event)
#endif

constexpr int kWarps = 8;
constexpr int kCols = 2;  // 256-column blocks per load batch: groups × kCols sign fragments in flight
// Per slot rows RS: the row groups (16 output rows) a warp takes, and the blocks per multiprocessor
// its registers allow. Single-row slots take 2 groups at 4 blocks (64 registers, 32 warps), pairs of
// rows 4 groups at 2 (118 registers). Run 318, against 4 groups at 2 blocks for both: single-row
// slots 2-3% faster at the 11008 shapes, the 7B batch-8 mixed step 1.3%; pairs 5-9% slower with 2
// groups (at 3 or 4 blocks), so they keep 4.
template <int RS>
constexpr int kGroupsOf = RS == 1 ? 2 : 4;
template <int RS>
constexpr int kBlocksOf = RS == 1 ? 4 : 2;

// Up to RS rows of one variant.
struct TermSlot {
  const uint4* signs;
  const float* alpha;
  int per_row;
  int n;       // rows (1..RS)
  int row[2];  // rows of x and y
};

struct TermParams {
  const uint8_t* xq;
  int xq_block;  // bytes per 256-column block of xq (quantized_x_block)
  float* y;
  int N, KB, nslots;
  int wk;  // warps along K per row-group set (2, 4 or 8); the block's 8 / wk sets take kGroupsOf<RS> groups each
  int store;  // y = the terms (y not read), not y += them
  TermSlot slots[kMaxDecodeRows];
};

// kOuts: the block's outputs per thread (sets · kSetOut ≤ kOuts · 256; 2 where pairs of slot rows
// take 2 warps along K).
template <int RS, int kOuts>
__global__ void __launch_bounds__(kWarps * 32, kBlocksOf<RS>) delta_terms_kernel(const TermParams p) {
  pdl_launch_dependents();  // launch.cuh
  TERMS_TRACE(kTermsEntry);
#ifdef BITDELTA_STREAM_TRACE
  terms_trace_at(kTermsSm, trace_sm());
#endif
  constexpr int kGroups = kGroupsOf<RS>;
  constexpr int kSetOut = kGroups * RS * 16;         // outputs of a set of kGroups row groups
  __shared__ float part[kWarps][kSetOut];            // per warp: [group][slot row][row of the group]
  __shared__ float sq[RS];                           // per slot row: Σ over K of scale·Σq
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31, g = lane >> 2, t = lane & 3;
  const int sets = kWarps / p.wk, s = int(blockIdx.x) % p.nslots;
  const int block_rg0 = int(blockIdx.x) / p.nslots * sets * kGroups, rg0 = block_rg0 + warp / p.wk * kGroups;
  const TermSlot& slot = p.slots[s];
  const int nrows = slot.n, RG = (p.N + 15) / 16;
  // This warp's blocks of 256 columns: part warp % wk of K, in whole pairs of blocks (x's scale is a
  // pair's: quantize_x with pairs), so kb0 is even.
  const int KP = (p.KB + 1) / 2, kp = warp % p.wk;
  const int kb0 = 2 * (KP * kp / p.wk), kb1 = min(p.KB, 2 * (KP * (kp + 1) / p.wk));
  // delta_b1.cuh: the plane weights relative to lane t's 2^(2t), which multiplies the sums once at the
  // end (a power of two: the same floats as the full weights per block, unless subnormal).
  const int s2 = sign2(t);
  float acc[kGroups][RS][2] = {};
  // Lane's fragment of (row group rg, block kb): slot.signs[(rg·KB + kb)·32 + lane]. Groups past the
  // last read the last (their sums are dropped).
  const uint4* sg[kGroups];
#pragma unroll
  for (int u = 0; u < kGroups; ++u) sg[u] = slot.signs + size_t(min(rg0 + u, RG - 1)) * p.KB * 32 + lane;
  const uint4* planes = reinterpret_cast<const uint4*>(p.xq + kQuantizedPlanes);
  const float2* scales = reinterpret_cast<const float2*>(p.xq);
  const int pstride = p.xq_block >> 4, sstride = p.xq_block >> 3;
  // What the end needs goes out before the loop, so that its latency hides behind the loop's: thread
  // tid writes the outputs f = tid + 256·o < sets·kSetOut, each y[row i][n] of (set f / kSetOut, group
  // u, slot row i, row e % 16 of the group), e = f % kSetOut; their α now (weights), the y they add
  // to after the wait (none with p.store); warp i < RS sums slot row i's Σq term.
  int eset[kOuts], e[kOuts], ei[kOuts], en[kOuts];
  bool writes[kOuts];
  float al[kOuts], y0[kOuts], q = 0.0f;
#pragma unroll
  for (int o = 0; o < kOuts; ++o) {
    const int f = int(threadIdx.x) + o * kWarps * 32;
    eset[o] = f / kSetOut, e[o] = f % kSetOut, ei[o] = e[o] / 16 % RS;
    en[o] = (block_rg0 + eset[o] * kGroups + e[o] / (RS * 16)) * 16 + e[o] % 16;
    writes[o] = eset[o] < sets && ei[o] < nrows && en[o] < p.N;
    al[o] = writes[o] ? __ldg(slot.alpha + (slot.per_row ? en[o] : 0)) : 0.0f;
    y0[o] = 0.0f;
  }
  // A batch: a pair of blocks kb, kb + 1 (kCols), per block j the sign fragments a[·][j] and the slot
  // rows' bit-planes b[·][j] (zero past kb1: a last pair of one block), and the pair's scales sc[·]
  // (delta_pair_unshifted: the two blocks' popcounts add in the mma's accumulator). The next pair's
  // signs and x are loaded as soon as their registers are free: with single-row slots each row
  // group's signs as soon as its work is done, x after the pair; with pairs of slot rows all after
  // the pair (run 311 measured the two orders on single blocks, run 312 loads of x with the signs'
  // instead of just before their use: 4-6% faster at pairs of rows). Blocks in pairs against one
  // block at a time (run 315, compute_80 build): single-row slots 1-6% faster, the 7B batch-8 mixed
  // step 2.5-3%; pairs of rows 0-2%, the batch-32 step level. The first pair's signs go out before
  // the wait: they are weights (launch.cuh).
  constexpr bool kEarly = RS == 1;
  uint4 a[kGroups][kCols], b[RS][kCols];
  float sc[RS];
  const auto load_signs = [&](int kb, int u) {
#pragma unroll
    for (int j = 0; j < kCols; ++j) a[u][j] = ldg_stream(sg[u] + size_t(min(kb + j, kb1 - 1)) * 32);
  };
  const auto load_x = [&](int kb) {
#pragma unroll
    for (int i = 0; i < RS; ++i) {
      const int r = slot.row[min(i, nrows - 1)];
      sc[i] = __ldcg(scales + size_t(kb) * sstride + r).x;
#pragma unroll
      for (int j = 0; j < kCols; ++j)
        b[i][j] = kb + j < kb1 ? __ldcg(planes + size_t(kb + j) * pstride + r * 32 + lane) : make_uint4(0, 0, 0, 0);
    }
  };
  if (kb0 < kb1)
#pragma unroll
    for (int u = 0; u < kGroups; ++u) load_signs(kb0, u);
  pdl_wait();  // x's quantized rows and y come from the launches before
  TERMS_TRACE(kTermsWaited);
  float* out[kOuts];
#pragma unroll
  for (int o = 0; o < kOuts; ++o) {
    out[o] = writes[o] ? p.y + size_t(slot.row[ei[o]]) * p.N + en[o] : nullptr;
    if (writes[o] && !p.store) y0[o] = __ldcg(out[o]);
  }
  if (kb0 < kb1) load_x(kb0);
  if (warp < nrows && warp < RS)
    for (int kb = lane; kb < p.KB; kb += 32) {
      const float2 v = __ldcg(scales + size_t(kb) * sstride + slot.row[warp]);
      q += v.x * v.y;
    }
  static_assert(kCols == 2, "a batch is a pair of blocks");
  for (int kb = kb0; kb < kb1; kb += kCols) {
    const bool more = kb + kCols < kb1;
#pragma unroll
    for (int u = 0; u < kGroups; ++u) {
#pragma unroll
      for (int i = 0; i < RS; ++i) {
        if (i >= nrows) break;
        delta_pair_unshifted(a[u][0], b[i][0], a[u][1], b[i][1], sc[i], s2, acc[u][i]);
      }
      if (kEarly && more) load_signs(kb + kCols, u);
    }
    if (!kEarly && more)
#pragma unroll
      for (int u = 0; u < kGroups; ++u) load_signs(kb + kCols, u);
    if (more) load_x(kb + kCols);
  }
  // Each lane holds its planes' part of rows g and g + 8 of each group: summed over the 4 lanes of g.
#pragma unroll
  for (int u = 0; u < kGroups; ++u)
#pragma unroll
    for (int i = 0; i < RS; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v = acc[u][i][h] * plane_shift(t);
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (t == 0) part[warp][(u * RS + i) * 16 + g + 8 * h] = v;
      }
  if (warp < nrows && warp < RS) {  // Σq's term of slot row `warp`
#pragma unroll
    for (int o = 16; o; o >>= 1) q += __shfl_xor_sync(0xffffffffu, q, o);
    if (lane == 0) sq[warp] = q;
  }
  __syncthreads();
  // y[row][n] += α·(2·Σ_warps − Σq), the set's warps in order.
#pragma unroll
  for (int o = 0; o < kOuts; ++o)
    if (writes[o]) {
      float v = 0.0f;
#pragma unroll
      for (int w = 0; w < p.wk; ++w) v += part[eset[o] * p.wk + w][e[o]];
      *out[o] = y0[o] + al[o] * (2.0f * v - sq[ei[o]]);
    }
  TERMS_TRACE(kTermsDone);
}

}  // namespace

#ifdef BITDELTA_STREAM_TRACE
std::vector<unsigned long long> terms_trace_take() {
  return take_trace(g_terms_trace, size_t(kTermsTraceBlocks) * kTermsTraceEvents);
}
#endif

void delta_terms(const uint8_t* xq, int rows, int N, int K, std::span<const DeltaRef> deltas, float* y,
                 cudaStream_t stream, bool store, int warps_along_k) {
  if (rows < 1 || rows > kMaxDecodeRows) fail("cuda::delta_terms: ", rows, " rows (1..", kMaxDecodeRows, " allowed)");
  if (warps_along_k != 0 && warps_along_k != 2 && warps_along_k != 4 && warps_along_k != 8)
    fail("cuda::delta_terms: ", warps_along_k, " warps along K (2, 4 or 8)");
  if (int(deltas.size()) != rows) fail("cuda::delta_terms: ", deltas.size(), " deltas for ", rows, " rows");
  if (N < 1 || K < 1) fail("cuda::delta_terms: empty weight [", N, ", ", K, "]");
  if (reinterpret_cast<uintptr_t>(xq) & 15) fail("cuda::delta_terms: quantized x not 16-byte aligned");
  // The rows of each variant, in order of first appearance.
  std::vector<std::vector<int>> by_variant;
  std::vector<const DeltaRef*> variant;
  for (int r = 0; r < rows; ++r) {
    const DeltaRef& d = deltas[size_t(r)];
    if (!d.signs) continue;
    if (!d.alpha) fail("cuda::delta_terms: row ", r, " has signs but no alpha");
    if (reinterpret_cast<uintptr_t>(d.signs) & 15) fail("cuda::delta_terms: row ", r, "'s packed signs are not 16-byte aligned");
    size_t v = 0;
    while (v < variant.size() && variant[v]->signs != d.signs) ++v;
    if (v == variant.size()) variant.push_back(&d), by_variant.emplace_back();
    by_variant[v].push_back(r);
  }
  if (variant.empty()) return;
  // Slots of up to RS rows: 2 where that makes fewer slots (each slot reads its variant's bits), else
  // 1 (fewer accumulators). (4 rows took more than 128 registers: ptxas spilled 104 bytes.)
  size_t with_delta = 0;
  for (const auto& rv : by_variant) with_delta += rv.size();
  const int RS = with_delta > variant.size() ? 2 : 1;
  TermParams p{};
  p.xq = xq, p.xq_block = quantized_x_block(rows), p.y = y, p.N = N, p.KB = sign_blocks(K), p.store = store;
  for (size_t v = 0; v < variant.size(); ++v)
    for (size_t a = 0; a < by_variant[v].size(); a += size_t(RS)) {
      TermSlot& s = p.slots[p.nslots++];
      s.signs = reinterpret_cast<const uint4*>(variant[v]->signs);
      s.alpha = variant[v]->alpha;
      s.per_row = variant[v]->alpha_per_row ? 1 : 0;
      s.n = int(std::min(by_variant[v].size() - a, size_t(RS)));
      for (int i = 0; i < s.n; ++i) s.row[i] = by_variant[v][a + size_t(i)];
    }
  // Warps along K (2, 4 or 8; 8 / wk sets of row groups per block): the fewest that leave each warp
  // at most 4 blocks of 256 columns (2 load batches) and whose sets' outputs fit the block's
  // threads, one each. Slots may then take half as many, 8 blocks per warp (with pairs of slot rows
  // two outputs per thread), where that is estimated no slower: the estimate is the waves of blocks
  // (kBlocksOf per multiprocessor) times the load batches per warp. Longer K ranges spread each
  // warp's start and end (more than half of its instructions at 2 batches: run 332's SASS counts)
  // over more work, but half as many blocks may leave the last wave short: run 333, with 2 warps
  // along K wherever K = 4096, had 4096² with 18 slots (288 blocks for 264 block slots) 1-5%
  // slower. With this estimate (run 334, normal build, 32 rows, the delta terms alone against 4
  // warps along K): 7-10% less time at 11008 × 4096 and 22016 × 4096 with 7 or 14 variants, 10-15%
  // at 4096², 11008 × 4096 and 12288 × 4096 with 4 (the compute_80 build 8-10%), level where it
  // keeps 4. Single-row slots took it in session 56 (8 blocks per warp for all of them at K = 4096
  // had been mixed, part 35): run 384 (H100, 16 rows of 16 variants, the route beside the streaming
  // base, alternated twice) 4096² 26.01-26.07 → 24.85-24.91 µs, 11008 × 4096 63.51-63.55 →
  // 62.22-62.30, the terms alone 1% slower; the 7B mixed step of 14 variants level at batch 4 to 32
  // (three rounds). At K = 8192 (4 warps along K instead of 8 where the estimate ties), run 387 (an
  // H100, the same (b) alternated with k_split naming the warps): 8192² 86.88 µs against 87.98 at 8,
  // 28672 × 8192 302.5 against 303.1; at 4096² and 11008 × 4096 the estimate's 2 beat 4 by 4.4% and
  // 2.2%; at 4096 × 11008 (8, where 4 would leave 11 blocks per warp) 4 was 0.3% faster.
  const int groups = RS == 1 ? kGroupsOf<1> : kGroupsOf<2>;
  const auto row_blocks = [&](int wk) {  // blocks per slot
    const int rows_per_block = 16 * (kWarps / wk * groups);
    return (N + rows_per_block - 1) / rows_per_block;
  };
  p.wk = 8;
  for (int wk : {4, 2})
    if (p.KB <= 4 * wk && kWarps / wk * groups * RS * 16 <= kWarps * 32) p.wk = wk;
  if (const int half = p.wk / 2; !warps_along_k && half >= 2 && p.KB <= 8 * half) {
    const int64_t resident = int64_t(RS == 1 ? kBlocksOf<1> : kBlocksOf<2>) * multiprocessors(), KP = (p.KB + 1) / 2;
    const auto cost = [&](int wk) {
      return (int64_t(p.nslots) * row_blocks(wk) + resident - 1) / resident * ((KP + wk - 1) / wk);
    };
    if (cost(half) <= cost(p.wk)) p.wk = half;
  }
  if (warps_along_k) p.wk = warps_along_k;
  const int rgs = kWarps / p.wk * groups;  // row groups per block
  const dim3 grid(unsigned(p.nslots * row_blocks(p.wk)));
  if (RS == 1)
    launch_chained(delta_terms_kernel<1, 1>, grid, dim3(kWarps * 32), 0, stream, p);
  else if (rgs * RS * 16 <= kWarps * 32)
    launch_chained(delta_terms_kernel<2, 1>, grid, dim3(kWarps * 32), 0, stream, p);
  else
    launch_chained(delta_terms_kernel<2, 2>, grid, dim3(kWarps * 32), 0, stream, p);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

}  // namespace bitdelta::cuda
