#include "fused_gemm_mma.cuh"

#include <algorithm>
#include <cstdint>

#include "cuda_check.cuh"
#include "mma.cuh"
#include "packed_signs.h"
#include "stream_scratch.cuh"
#include "weff.cuh"

namespace bitdelta::cuda {
namespace {

constexpr int kBM = 128;  // output rows (rows of W) per tile
constexpr int kBK = 64;   // columns per stage: 128 bytes of a bf16 row, 8 chunks of 16 bytes
// 8 warps: 4 along W's rows × 2 along x's, 32 × BN/2 each (4 warps of 64 × BN/2 took the same time
// for 512 rows of x and up to 1.3× as long for 17–48: run 286).
constexpr int kMI = 2;  // m16 tiles of W's rows per warp
constexpr int kThreads = 256;

// A tile of 128 rows of W × BN rows of x; per stage, in its ring slot:
//   W   [128 rows][8 chunks of 16 B], chunk c of row r at c ^ (r & 7) (ldmatrix reads 8 rows of one
//       logical chunk: the XOR spreads them over all banks)
//   x   [BN rows][8 chunks], the same swizzle
//   signs [8 row groups][8 g][2 t'][4 words]: for each row group, lane 4g + t of the packed layout
//       (packed_signs.h) with t = 2·(stage's 64-column quarter & 1) + t', the two of its four words
//       that the stage needs (4-byte copies; the others' places stay empty)
template <int BN, int S>
struct MmaTile {
  static constexpr int kWBytes = kBM * kBK * 2, kXBytes = BN * kBK * 2;
  static constexpr int kSignBytes = kBM / 16 * 8 * 2 * 16;
  static constexpr int kStageBytes = kWBytes + kXBytes + kSignBytes;
  static constexpr int kSmem = S * kStageBytes;
  static constexpr int WN = BN / 2;  // rows of x per warp
  static_assert(S >= 3, "two stages or more in flight ahead of the one on the tensor cores");
};

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// D = W_eff · xᵀ per tile (W the A operand, x the B operand: both K-contiguous, as mma's row.col
// wants), stored transposed into y[rows][N]. Split along K over gridDim.y blocks where the tiles
// alone would leave multiprocessors idle (few rows of x): each writes its sums to `parts`, and the
// last of a tile's blocks to arrive adds them in split order (the same floats whichever is last) and
// writes y.
template <int BN, int S, bool Delta>
__global__ void __launch_bounds__(kThreads, 2)
    mma_gemm_kernel(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x,
                    const uint32_t* __restrict__ signs, const float* __restrict__ alpha, int per_row,
                    float* __restrict__ y, int N, int K, int M, float* __restrict__ parts,
                    unsigned* __restrict__ arrived) {
  using T = MmaTile<BN, S>;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int last_flag;
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int MT = (M + BN - 1) / BN, tile = int(blockIdx.x), splits = int(gridDim.y), z = int(blockIdx.y);
  // The tiles of x's rows for one W tile are neighbouring blocks: W comes from memory once, x's rows
  // stay in L2.
  const int n0 = tile / MT * kBM, m0 = tile % MT * BN;
  const int KT = K / kBK, kt0 = KT * z / splits, kt1 = KT * (z + 1) / splits, KB = sign_blocks(K);
  const int row_groups = (N + 15) / 16;
  const uint32_t ring = smem_addr(smem);

  // What each thread copies per stage, the same every stage but for the columns: 16-byte chunk
  // ch = tid % 8 of W's rows r0 + 32·i and of x's rows r0 + 32·i (r0 = tid / 8), into slot offsets
  // that share the swizzle (r0 + 32·i ≡ r0 mod 8); and one word of the sign chunks (below). Element
  // offsets from the tile's first row, in 32 bits (under 128·K); rows past N or M read the tile's
  // first row instead and are zero-filled.
  const int ch = tid & 7, r0 = tid >> 3;
  const uint32_t dst0 = uint32_t(r0) * 128 + uint32_t((ch ^ (r0 & 7)) << 4);
  const __nv_bfloat16* w_tile = w + size_t(n0) * K + ch * 8;
  const __nv_bfloat16* x_tile = x + size_t(m0) * K + ch * 8;
  uint32_t w_off[kBM / 32], x_off[BN / 32];
  unsigned w_ok = 0, x_ok = 0;
#pragma unroll
  for (int i = 0; i < kBM / 32; ++i) {
    const bool ok = n0 + r0 + 32 * i < N;
    w_off[i] = ok ? uint32_t(r0 + 32 * i) * uint32_t(K) : 0u;
    w_ok |= unsigned(ok) << i;
  }
#pragma unroll
  for (int i = 0; i < BN / 32; ++i) {
    const bool ok = m0 + r0 + 32 * i < M;
    x_off[i] = ok ? uint32_t(r0 + 32 * i) * uint32_t(K) : 0u;
    x_ok |= unsigned(ok) << i;
  }
  // Signs: thread tid copies word 2·(quarter >> 1) + (tid & 1) of chunk c = tid / 2 = (rg·8 + g)·2 + t'
  // (the two words the stage reads; slots keep the chunk's 16-byte place).
  [[maybe_unused]] const uint32_t* s_src = nullptr;
  [[maybe_unused]] bool s_ok = false;
  if constexpr (Delta) {
    const int c = tid >> 1, rg = n0 / 16 + (c >> 4), cg = (c >> 1) & 7, tp = c & 1;
    s_ok = rg < row_groups;
    s_src = signs + (size_t(s_ok ? rg : 0) * KB * 32 + 4 * cg + tp) * 4 + (tid & 1);
  }

  // Stage kt into its slot; past kt1 (the ring's last S − 1 iterations) the copies are zero-fills of
  // a free slot, so that the loop has no branch around them.
  const auto load_stage = [&](int kt, int slot) {
    const uint32_t wt = ring + slot * T::kStageBytes, xt = wt + T::kWBytes, st = xt + T::kXBytes;
    const bool live = kt < kt1;
    const int k0 = (live ? kt : kt1 - 1) * kBK;
#pragma unroll
    for (int i = 0; i < kBM / 32; ++i)
      cp_async16(wt + dst0 + i * 32 * 128, w_tile + w_off[i] + k0, live && (w_ok >> i & 1));
#pragma unroll
    for (int i = 0; i < BN / 32; ++i)
      cp_async16(xt + dst0 + i * 32 * 128, x_tile + x_off[i] + k0, live && (x_ok >> i & 1));
    if constexpr (Delta) {  // block (k0 / 256) of the row group; quarter = (k0 % 256) / 64
      const int quarter = (k0 & 255) >> 6;
      cp_async4(st + (tid >> 1) * 16 + (2 * (quarter >> 1) + (tid & 1)) * 4,
                s_src + (k0 >> 8) * 128 + 8 * (quarter & 1) + 2 * (quarter >> 1), live && s_ok);
    }
  };

  // This warp's part: W rows wr .. wr + 16·kMI − 1 (kMI m16 tiles, row groups wr/16 + mi), x rows
  // wc .. wc + WN − 1 (WN/8 n8 tiles).
  const int wr = 16 * kMI * (warp & 3), wc = T::WN * (warp >> 2);
  // −α of rows g and g + 8 of each m16 tile, as bf16 pairs; a sign bit of 1 flips it to +α.
  [[maybe_unused]] uint32_t na[kMI][2] = {};
  if constexpr (Delta)
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = min(n0 + wr + 16 * mi + g + 8 * h, N - 1);
        na[mi][h] = neg_alpha_pair(alpha[per_row ? n : 0]);
      }
  const int sh0 = 15 - 2 * t;  // delta_pair's shift of this lane's first pair (bits 2t, 16 + 2t)
  // ldmatrix.x4 sources: for A, matrix q = lane / 8 is rows +8·(q & 1), columns +8·(q >> 1); for B
  // (two n8 tiles), rows +8·(q >> 1), columns +8·(q & 1). Row lane % 8 of each, so the swizzle's
  // XOR is lane & 7 for every row.
  const int sw = lane & 7;
  const uint32_t a_row = uint32_t(wr + sw + 8 * ((lane >> 3) & 1)) * 128, a_hi = lane >> 4;
  const uint32_t b_row = uint32_t(wc + sw + 8 * (lane >> 4)) * 128, b_hi = (lane >> 3) & 1;
  float acc[kMI][T::WN / 8][4] = {};
  const auto compute = [&](int kt, int slot) {
    const uint32_t wt = ring + slot * T::kStageBytes, xt = wt + T::kWBytes, st = xt + T::kXBytes;
    // The signs of this lane's rows g and g + 8 of each m16 tile: words (t', i) of the chunk
    // (row group, g), i = 2·(quarter >> 1) for row g and + 1 for row g + 8, t' = 0 for the stage's
    // columns 0..31 and 1 for 32..63; bit c is column c. Per 16 columns of a word (z: its low or high
    // two bytes, then those of the word shifted right by one) each column's right neighbour sits 16
    // bits above it: a lane's pair (2t, 2t + 1) is then at bits 2t and 16 + 2t, (2t + 8, 2t + 9) at
    // 8 + 2t and 24 + 2t (delta_pair's shifts sh0 and sh0 − 8).
    [[maybe_unused]] const uint32_t sp0 = st + ((wr >> 4) * 8 + g) * 32 + 8 * ((((kt * kBK) & 255) >> 6) >> 1);
#pragma unroll
    for (int tp = 0; tp < 2; ++tp) {  // columns 32·t' .. 32·t' + 31 of the stage: sign word t'
      [[maybe_unused]] uint32_t words[kMI][2];  // rows g and g + 8 of each m16 tile
      if constexpr (Delta)
#pragma unroll
        for (int mi = 0; mi < kMI; ++mi)
          asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                       : "=r"(words[mi][0]), "=r"(words[mi][1])
                       : "r"(sp0 + mi * 8 * 32 + 16 * tp)
                       : "memory");
#pragma unroll
      for (int hj = 0; hj < 2; ++hj) {
        const int j = 2 * tp + hj;  // columns 16j .. 16j + 15: half hj of the words
        uint32_t a[kMI][4], b[T::WN / 8][2];
#pragma unroll
        for (int mi = 0; mi < kMI; ++mi) {
          ldmatrix_x4(a[mi], wt + a_row + mi * 16 * 128 + (((2 * j + a_hi) ^ sw) << 4));
          if constexpr (Delta) {
            const uint32_t half = hj ? 0x7632 : 0x5410, w0 = words[mi][0], w8 = words[mi][1];
            const uint32_t z0 = __byte_perm(w0, w0 >> 1, half), z8 = __byte_perm(w8, w8 >> 1, half);
            a[mi][0] = bf16x2_add(a[mi][0], delta_pair(z0, sh0, na[mi][0]));
            a[mi][1] = bf16x2_add(a[mi][1], delta_pair(z8, sh0, na[mi][1]));
            a[mi][2] = bf16x2_add(a[mi][2], delta_pair(z0, sh0 - 8, na[mi][0]));
            a[mi][3] = bf16x2_add(a[mi][3], delta_pair(z8, sh0 - 8, na[mi][1]));
          }
        }
#pragma unroll
        for (int np = 0; np < T::WN / 16; ++np) {
          uint32_t r[4];
          ldmatrix_x4(r, xt + b_row + np * 16 * 128 + (((2 * j + b_hi) ^ sw) << 4));
          b[2 * np][0] = r[0], b[2 * np][1] = r[1], b[2 * np + 1][0] = r[2], b[2 * np + 1][1] = r[3];
        }
#pragma unroll
        for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
          for (int ni = 0; ni < T::WN / 8; ++ni) mma_bf16(acc[mi][ni], a[mi][0], a[mi][1], a[mi][2], a[mi][3], b[ni][0], b[ni][1]);
      }
    }
  };

  // The ring: S − 1 stages in flight ahead of the one on the tensor cores. One barrier per stage:
  // after it, every thread's copies of stage kt have landed and every warp is done with stage
  // kt − 1, whose slot then takes stage kt + S − 1. Every iteration commits a group, empty or not,
  // so that the wait's count holds.
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    load_stage(kt0 + s, s);
    cp_async_commit();
  }
  for (int kt = kt0, slot = 0; kt < kt1; ++kt) {
    cp_async_wait<S - 2>();
    __syncthreads();
    load_stage(kt + S - 1, slot == 0 ? S - 1 : slot - 1);  // the slot of stage kt − 1
    cp_async_commit();
    compute(kt, slot);
    slot = slot == S - 1 ? 0 : slot + 1;
  }

  if (splits > 1) {
    // This block's sums, [accumulator][thread] (coalesced), then the tile's merge; the accumulators
    // in their array order (the same in every block of the tile).
    constexpr int kAcc = kMI * (T::WN / 8) * 4;
    float* sums = &acc[0][0][0];
    float* part = parts + (size_t(tile) * splits + z) * kAcc * kThreads + tid;
#pragma unroll
    for (int i = 0; i < kAcc; ++i) part[i * kThreads] = sums[i];
    if (!last_to_arrive(arrived + tile, unsigned(splits), last_flag, [] { __syncthreads(); })) return;
    // 32 accumulators at a time, each part's 32 loads issued together before their adds (one round
    // trip to L2 per part and 32 sums, not one per sum: the loop of one load per add cost a split
    // launch at 33–128 rows a median 17 µs split 2 ways, 41 µs 8 ways, runs 292–293; 32 at a time
    // against 16 took a median 0.95–1.00× the time by splits, run 297).
    const float* tile_parts = parts + size_t(tile) * splits * kAcc * kThreads + tid;
    constexpr int kBatch = 32;
#pragma unroll
    for (int c0 = 0; c0 < kAcc; c0 += kBatch) {
#pragma unroll
      for (int i = 0; i < kBatch; ++i) sums[c0 + i] = __ldcg(tile_parts + (c0 + i) * kThreads);
      for (int q = 1; q < splits; ++q) {
        const float* pq = tile_parts + size_t(q) * kAcc * kThreads;
        float v[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) v[i] = __ldcg(pq + (c0 + i) * kThreads);
#pragma unroll
        for (int i = 0; i < kBatch; ++i) sums[c0 + i] += v[i];
      }
    }
  }
  // Accumulator (mi, ni): rows g and g + 8 of W's m16 tile, columns 2t, 2t + 1 of x's n8 tile.
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int ni = 0; ni < T::WN / 8; ++ni)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = n0 + wr + 16 * mi + g + 8 * h;
        if (n >= N) continue;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int m = m0 + wc + 8 * ni + 2 * t + c;
          if (m < M) y[size_t(m) * N + n] = acc[mi][ni][2 * h + c];
        }
      }
}

template <int BN, int S, bool Delta>
const void* kernel_of() {
  return reinterpret_cast<const void*>(mma_gemm_kernel<BN, S, Delta>);
}

template <int BN, int S>
void launch(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows, const DeltaRef& delta, float* y,
            cudaStream_t stream, int splits) {
  const int tiles = (N + kBM - 1) / kBM * ((rows + BN - 1) / BN);
  float* parts = nullptr;
  unsigned* arrived = nullptr;
  if (splits > 1) {
    parts = static_cast<float*>(stream_scratch(ScratchUse::kPrefillParts, stream,
                                               size_t(tiles) * splits * kBM * BN * sizeof(float)));
    arrived = static_cast<unsigned*>(
        stream_scratch(ScratchUse::kPrefillCounters, stream, size_t(tiles) * sizeof(unsigned), true));
  }
  const dim3 grid{unsigned(tiles), unsigned(splits)};
  const auto* s = reinterpret_cast<const uint32_t*>(delta.signs);
  const int per_row = delta.alpha_per_row ? 1 : 0;
  if (delta.signs)
    mma_gemm_kernel<BN, S, true><<<grid, kThreads, MmaTile<BN, S>::kSmem, stream>>>(w, x, s, delta.alpha, per_row, y,
                                                                                    N, K, rows, parts, arrived);
  else
    mma_gemm_kernel<BN, S, false><<<grid, kThreads, MmaTile<BN, S>::kSmem, stream>>>(w, x, nullptr, nullptr, 0, y, N,
                                                                                     K, rows, parts, arrived);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool mma_gemm_supported(const __nv_bfloat16* w, int K, const __nv_bfloat16* x, const DeltaRef& delta) {
  const auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  return K % kBK == 0 && K > 0 && aligned(w) && aligned(x) && aligned(delta.signs);
}

int mma_gemm_prepare() {
  int device = 0, optin = 0;
  BITDELTA_CUDA_CHECK(cudaGetDevice(&device));
  BITDELTA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const auto allow = [&](const void* with_delta, const void* base_only, int bytes) {
    if (bytes > optin) return;
    BITDELTA_CUDA_CHECK(cudaFuncSetAttribute(with_delta, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    BITDELTA_CUDA_CHECK(cudaFuncSetAttribute(base_only, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  };
  allow(kernel_of<64, 3, true>(), kernel_of<64, 3, false>(), MmaTile<64, 3>::kSmem);
  allow(kernel_of<64, 4, true>(), kernel_of<64, 4, false>(), MmaTile<64, 4>::kSmem);
  allow(kernel_of<128, 3, true>(), kernel_of<128, 3, false>(), MmaTile<128, 3>::kSmem);
  allow(kernel_of<128, 4, true>(), kernel_of<128, 4, false>(), MmaTile<128, 4>::kSmem);
  return optin;
}

int mma_gemm_smem(MmaGemmConfig c) {
  return c.bn == 64 ? (c.stages == 3 ? MmaTile<64, 3>::kSmem : MmaTile<64, 4>::kSmem)
                    : (c.stages == 3 ? MmaTile<128, 3>::kSmem : MmaTile<128, 4>::kSmem);
}

MmaGemmConfig mma_gemm_choose(int N, int K, int rows, int smem_optin, int sms) {
  // The configuration with the least modelled time, in stages of a 64-row tile: the waves of blocks
  // (one block per multiprocessor a wave) × the stages each block runs × 1.6 for a 128-row tile, and
  // two stages more per split past the first (the merge). Fitted to run 293 (4096², 12288 × 4096,
  // 22016 × 4096 and 4096 × 11008 at 33–256 rows on an H200): its picks took 1.005× the time of the
  // best of 24 configurations on geometric average, 1.08× at worst. 3 stages: 4 were no faster.
  // K split keeps at least 4 stages per block, and at most 16 splits.
  const int KT = K / kBK;
  MmaGemmConfig best{64, 3, 1};
  double best_t = 0;
  for (int bn : {64, 128}) {
    if (mma_gemm_smem({bn, 3, 1}) > smem_optin) continue;
    const double stage = bn == 128 ? 1.6 : 1.0;
    const long tiles = long((N + kBM - 1) / kBM) * ((rows + bn - 1) / bn);
    for (int split = 1; split <= std::max(1, std::min(16, KT / 4)); ++split) {
      const long waves = (tiles * split + sms - 1) / sms;
      const double t = stage * (double(waves) * ((KT + split - 1) / split) + 2 * (split - 1));
      if (best_t == 0 || t < best_t) best = {bn, 3, split}, best_t = t;
    }
  }
  return best;
}

void mma_gemm(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows, const DeltaRef& delta,
              float* y, cudaStream_t stream, MmaGemmConfig c) {
  if (!mma_gemm_supported(w, K, x, delta))
    fail("cuda::mma_gemm: needs K a multiple of 64 and 16-byte aligned W, x and signs (K = ", K, ")");
  if (N < 1 || rows < 1) fail("cuda::mma_gemm: empty shape");
  if ((c.bn != 64 && c.bn != 128) || (c.stages != 3 && c.stages != 4))
    fail("cuda::mma_gemm: no tile of ", c.bn, " rows of x with ", c.stages, " stages (64 or 128; 3 or 4)");
  if (c.k_split < 1 || c.k_split > K / kBK)
    fail("cuda::mma_gemm: K = ", K, " is ", K / kBK, " stages of 64 columns, not split ", c.k_split, " ways");
  if (c.bn == 64 && c.stages == 3) return launch<64, 3>(w, N, K, x, rows, delta, y, stream, c.k_split);
  if (c.bn == 64 && c.stages == 4) return launch<64, 4>(w, N, K, x, rows, delta, y, stream, c.k_split);
  if (c.bn == 128 && c.stages == 3) return launch<128, 3>(w, N, K, x, rows, delta, y, stream, c.k_split);
  launch<128, 4>(w, N, K, x, rows, delta, y, stream, c.k_split);
}

}  // namespace bitdelta::cuda
