#include "fused_linear_prefill.cuh"

#include <algorithm>
#include <cstdint>

#include "code_arch.h"
#include "cuda_check.cuh"
#include "fused_gemm_mma.cuh"
#include "fused_linear_decode.cuh"
#include "stream_scratch.cuh"
#include "tma.cuh"

namespace bitdelta::cuda {
namespace {

// One thread per 8 columns (one sign byte, 16 bytes of W, 16 bytes of W_eff), grid-stride so that a
// small grid can run beside a GEMM.
__global__ void expand_kernel(const __nv_bfloat16* w, int K, const uint8_t* signs,
                              const float* alpha, int per_row, int n0, int rows, int with_base,
                              int aligned, __nv_bfloat16* out) {
  const int row_bytes = (K + 7) / 8, KB = sign_blocks(K);
  const size_t total = size_t(rows) * row_bytes;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += size_t(gridDim.x) * blockDim.x) {
    const int r = int(i / row_bytes), b = int(i % row_bytes), n = n0 + r, k = b * 8;
    const float a = alpha[per_row ? n : 0];
    const uint32_t bits = packed_sign_byte(reinterpret_cast<const uint32_t*>(signs), KB, n, b);
    if (aligned) {
      uint4 v = with_base ? __ldg(reinterpret_cast<const uint4*>(w + size_t(n) * K + k))
                          : make_uint4(0, 0, 0, 0);
      uint32_t* h = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        __nv_bfloat162 pair = *reinterpret_cast<__nv_bfloat162*>(&h[j]);
        const float lo = __low2float(pair) + ((bits >> (2 * j)) & 1 ? a : -a);
        const float hi = __high2float(pair) + ((bits >> (2 * j + 1)) & 1 ? a : -a);
        pair = __floats2bfloat162_rn(lo, hi);
        h[j] = *reinterpret_cast<uint32_t*>(&pair);
      }
      *reinterpret_cast<uint4*>(out + size_t(r) * K + k) = v;
    } else {
      for (int j = 0; j < 8 && k + j < K; ++j) {
        const float base = with_base ? __bfloat162float(w[size_t(n) * K + k + j]) : 0.0f;
        out[size_t(r) * K + k + j] = __float2bfloat16_rn(base + ((bits >> j) & 1 ? a : -a));
      }
    }
  }
}

// --- The fused GEMM: W_eff formed in registers on its way to the tensor cores -------------------
//
// D = W_eff · Xᵀ per tile of BM output rows (n) × BN rows of x (m), the transposed product so that
// W is wgmma's A operand, which may come from registers: each consumer thread loads its A fragment
// of W with ldmatrix, adds ±α from its sign bits (bf16 add: bf16(w ± bf16(α)), one rounding, as
// materialize rounds W_eff) and issues wgmma.m64nBNk16 with x (B) read by the tensor cores from
// shared memory. Warp-specialized: two producer threads stream 64-column stages of W with the
// stage's sign words, and of x (both in the 128-byte swizzle that wgmma's descriptors name), into
// two rings (W's of 5–11 stages, x's of 4–14) with the tensor memory accelerator (TMA), each
// stage completing on a "full" mbarrier; the consumer warpgroups (64 output rows each) wait on
// them, compute, and release each slot on an "empty" mbarrier once nothing reads it any more: W's
// once the stage's wgmma are issued, x's once they retired. While the last one or two stages' wgmma
// run, the next stage's fragments are expanded into another register set. A block works through a
// list of pieces (FusedSchedule below); the rings run on from one piece to the next, so that the
// next piece's first stages load while the consumers write the last one's sums.
constexpr int kFusedBK = 64;  // columns per stage: one 128-byte swizzle row of bf16

// A tile shape: C consumer warpgroups of 64 output rows each (BM = 64·C) × BN rows of x, and as
// many ring stages as fit in shared memory. <1, 256>: 64 × 256 tiles, each W fragment expanded
// once for 256 rows of x (the least expansion work per product: many rows); <2, 256>: 128 × 256,
// twice the product per byte of x and W brought in; <2, 176>: 128 × 176, for row counts that
// 256-row tiles would pad or leave a partial wave with (512 = 3 · 176 − 16); <2, 128>: 128 × 128;
// <1, 64>: 64 × 64, for few rows (up to 64: twice the blocks of 128-row tiles, to stream W).
template <int C, int BN_>
struct FusedTile {
  static constexpr int kConsumers = 128 * C, kThreads = kConsumers + 128;  // + a producer warpgroup
  static constexpr int BM = 64 * C, BN = BN_;
  static constexpr int kWBytes = BM * kFusedBK * 2, kXBytes = BN * kFusedBK * 2;
  // Signs per stage: the TMA box [BM/16 row groups][8 g][2 t'][4 i] of 32-bit words (i: all four
  // registers of a lane, of which a stage needs two), copied as rows of 32 bytes (a t' pair's 8
  // words, contiguous in packed_signs.h). As rows of 16 bytes (4 i innermost) the copies came late:
  // the delta cost up to 42% over the base-only kernel where K is not a power of two (runs 420–421;
  // at 4096 × 11008 the 128 × 128 tile took 108 µs against 78, run 423); as 32-byte rows 1–13% (there
  // 78 against 77), and a 7B variant's 512-token TTFT 2–3% less (run 424). A copy's cost here goes by
  // its box's rows more than by its bytes.
  static constexpr int kSignBytes = BM / 16 * 8 * 2 * 4 * 4;
  // Register sets of W fragments: stage s uses set s % kSets, and after it the wgmma of the last
  // kSets − 1 stages may still run (so many fit beside the accumulators: two for tiles of more
  // than 160 rows of x, whose stages are long on the tensor cores; 128 × 176 spills with three).
  static constexpr int kSets = BN / 2 + 3 * 16 <= 128 ? 3 : 2;
  // Two rings, W's (with the signs) and x's. A W slot is free once its stage's wgmma were issued
  // (they wait for the fragments), an x slot only once they retired, kSets − 1 stages later: at a
  // stage's start all of W's kStages slots may be ahead of the consumers, kXStages − (kSets − 1) of
  // x's. In a model's prompt x was just written by the kernel before (in L2) and W comes from DRAM:
  // x's ring leads by 96 KB (3 stages of the 256-row tiles, 4 of 128 × 176, 6 of 128 × 128, 12 of
  // 64 × 64), W's takes the rest. One ring of 4 or 5 stages left the consumers waiting on their
  // stages' copies in a third of the warp samples, the producer on free slots (run 403). 7B prompts
  // on an H100, against one ring (ncu per launch, caches kept, run 413): down (4096 × 11008, 64 × 256,
  // 10 W stages) 80 µs against 115–116, o (4096²) 32.5 against 33.6, qkv and gate/up (128 × 256, 5 W
  // stages) 1.4–2.7% more; 512-token TTFT 4–5% less (runs 409, 413). x leading by 2 stages (W 14) made
  // o and down 17–22% slower (run 416), by 4 (W 6) no faster than one ring (run 408). 128 tokens, TTFT
  // within 0.1 ms; 64 tokens, 0–0.2 ms (0–3%) more (run 411, medians; x leading by 3 there, 0.1–0.4 ms,
  // run 410). Case (c) agrees once x is written just before each call as in the model (run 415:
  // 4096 × 11008 1.22–1.25 × cuBLAS against one ring's 1.54–1.56); with x left clean in L2 by the call
  // before, one ring looked faster at every shape (runs 410, 412).
  static constexpr int kWStageBytes = kWBytes + kSignBytes, kBudget = 220 * 1024 - 1024;
  static constexpr int kXStages = kSets - 1 + (3 * kXBytes > 96 * 1024 ? 3 : 96 * 1024 / kXBytes);
  static constexpr int kStages = (kBudget - kXStages * (kXBytes + 16)) / (kWStageBytes + 16);  // W's
  static constexpr int kSmem = kStages * kWStageBytes + kXStages * kXBytes + 16 * (kStages + kXStages) + 1024;
  static constexpr int kRegs =
      C == 2 ? 232 : 248;  // consumers' registers (setmaxnreg); producer 40
  static_assert(kStages >= 4, "a tile's W stages must fit in shared memory");
  static_assert(kSets == 2 || kSets == 3, "the stage loop is written for 2 or 3 register sets");
  static_assert(kRegs % 8 == 0 && kConsumers * kRegs + 128 * 40 <= 65536, "setmaxnreg budget");
};
using FusedTile128 = FusedTile<2, 128>;
using FusedTile256 = FusedTile<1, 256>;
using FusedTile2x256 = FusedTile<2, 256>;
using FusedTile2x176 = FusedTile<2, 176>;
using FusedTile64 = FusedTile<1, 64>;

// x_last: x's last tile of rows, whose box holds only the rows x has there (rounded up to 8, the
// swizzle's period): a box zero-filling rows past x's end made 17–32 rows of x slower than 48 (run
// 98: 190 against 145 µs at 28672 × 8192; 135 with the short box, run 99).
struct FusedMaps {
  CUtensorMap w, x, x_last, signs;
};

// Which block does what: whole tiles first, then the stages of the rest spread over blocks. The
// blocks come in groups of MT, one per tile of x's rows, that run the same pieces of W's tiles at
// the same time: each W tile then comes from memory once, for all of x (x's rows stay in L2), as
// the GEMM's intensity needs. Group q of `groups` takes the whole W tiles q, q + groups, … below
// `whole`; then, if q < sk_groups, the stretch [⌊I·q/sk_groups⌋, ⌊I·(q+1)/sk_groups⌋) of the
// I = (NT − whole)·KT stages of the other W tiles, in order. A tile shared by groups is then the
// last piece of the first of them (the one with its stage 0) and the first piece of the others, so
// that its parts are usually all written by the time the first gets to it.
// One tile per block is whole = groups = NT, sk_groups = 0; stream-K spreads the last one or two
// waves' worth of tiles over all groups.
struct FusedSchedule {
  int NT, MT, whole, groups, sk_groups, KT;
  int x_last_rows;    // rows of x a stage of the last x tile copies (x_last's box); the rows past
                      // them in shared memory hold stale data, which reaches only outputs not written
  float* parts;       // per block two slots of a tile's sums: [2·b] its piece from stage 0, [2·b + 1] another
  unsigned* arrived;  // per shared tile, the pieces that have written their sums (zero between launches)
};

// f(W tile, x tile, first stage, end stage) for each piece of block u's work, in order. One call
// of f in one loop, so that f (the kernel's main loop) is inlined once.
template <typename F>
__device__ __forceinline__ void for_each_piece(const FusedSchedule& s, int u, F&& f) {
  const int q = u / s.MT, mt = u % s.MT, I = q < s.sk_groups ? (s.NT - s.whole) * s.KT : 0;
  const int b = I ? int((long long)I * (q + 1) / s.sk_groups) : 0;
  int nt = q, a = I ? int((long long)I * q / s.sk_groups) : 0;  // the next whole tile; the next shared stage
  while (nt < s.whole || a < b) {
    int k0 = 0, k1 = s.KT, t = nt;
    if (nt < s.whole) {
      nt += s.groups;
    } else {
      t = s.whole + a / s.KT, k0 = a % s.KT, k1 = min(s.KT, k0 + (b - a));
      a += k1 - k0;
    }
    f(t, mt, k0, k1);
  }
}

#ifdef BITDELTA_FUSED_WGMMA
// The group whose stretch holds stage i of the I shared ones: the last q with ⌊I·q/groups⌋ ≤ i.
__device__ __forceinline__ int stretch_of(int i, int I, int groups) {
  return int(((long long)(i + 1) * groups + I - 1) / I) - 1;
}

// d (64 rows × N columns of f32 per warpgroup) = a (registers: this warp's 16 rows × 16) · B
// (desc), plus d when Accumulate. scale-d is an immediate: a zeroed accumulator or a predicate set
// in the asm would be ordinary instructions defining wgmma inputs, and ptxas then serializes the
// wgmma; without Accumulate the accumulator's old (undefined) value is not read.
template <int N, bool Accumulate>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 2], const uint32_t (&a)[4],
                                             uint64_t desc) {
  static_assert(N == 64 || N == 128 || N == 176 || N == 256);
  if constexpr (N == 64)
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, %37, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(Accumulate ? 1 : 0));
  if constexpr (N == 128)
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, %69, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
          "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
          "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(Accumulate ? 1 : 0));
  if constexpr (N == 176)
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n176k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, {%88, %89, %90, %91}, %92, %93, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
          "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
          "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]),
          "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),
          "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(Accumulate ? 1 : 0));
  if constexpr (N == 256)
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, %133, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
          "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
          "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]),
          "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),
          "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]),
          "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]),
          "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]),
          "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]),
          "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),
          "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(Accumulate ? 1 : 0));
}

#endif  // BITDELTA_FUSED_WGMMA

// Delta = false: W alone (the same kernel without the sign term: what the expansion costs).
template <bool Delta, typename T>
__global__ void __launch_bounds__(T::kThreads, 1)
    fused_gemm_kernel(const __grid_constant__ FusedMaps maps, const __grid_constant__ FusedSchedule sched,
                      const float* __restrict__ alpha, int per_row, float* __restrict__ y, int N, int M) {
#ifdef BITDELTA_FUSED_WGMMA
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  constexpr int S = T::kStages, SX = T::kXStages;
  uint8_t* w_tiles = smem;                       // [W stage][BM rows][128 B], swizzled
  uint8_t* x_tiles = smem + S * T::kWBytes;      // [x stage][BN rows][128 B], swizzled
  uint8_t* s_tiles = x_tiles + SX * T::kXBytes;  // [W stage][BM/16 rg][8 g][2 t'][4 i] words
  const uint32_t full0 = smem_addr(s_tiles + S * T::kSignBytes), empty0 = full0 + 8 * S;  // W's
  const uint32_t xfull0 = empty0 + 8 * S, xempty0 = xfull0 + 8 * SX;                        // x's

  // Whether this block adds a shared tile's sums; two, by parity of the shared pieces: a consumer
  // warpgroup may write the next one's while the other still reads this one's.
  __shared__ int last_piece[2];
  const int tid = threadIdx.x, unit = int(blockIdx.x);
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, T::kConsumers);
    }
    for (int s = 0; s < SX; ++s) {
      mbar_init(xfull0 + 8 * s, 1);
      mbar_init(xempty0 + 8 * s, T::kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (tid >= T::kConsumers) {  // the producer warpgroup: one thread issues W's copies, another x's
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (tid == T::kConsumers) {
      int g = 0;  // the W ring's running stage
      for_each_piece(sched, unit, [&](int nt, int, int kb, int ke) {
        const int n0 = nt * T::BM;
        for (int kt = kb; kt < ke; ++kt, ++g) {
          const int slot = g % S, k0 = kt * kFusedBK, s = (k0 & 255) >> 6;
          const uint32_t full = full0 + 8 * slot;
          mbar_wait(empty0 + 8 * slot, ((g / S) & 1) ^ 1);
          mbar_expect_tx(full, T::kWBytes + (Delta ? T::kSignBytes : 0));
          tma_2d(smem_addr(w_tiles + slot * T::kWBytes), &maps.w, k0, n0, full);
          if (Delta)
            tma_5d(smem_addr(s_tiles + slot * T::kSignBytes), &maps.signs, 0, s & 1, 0, k0 >> 8,
                   n0 / 16, full);
        }
      });
    } else if (tid == T::kConsumers + 32) {
      int g = 0;  // the x ring's running stage
      for_each_piece(sched, unit, [&](int, int mt, int kb, int ke) {
        const int m0 = mt * T::BN;
        const bool last_x = mt == sched.MT - 1;
        for (int kt = kb; kt < ke; ++kt, ++g) {
          const int slot = g % SX;
          const uint32_t full = xfull0 + 8 * slot;
          mbar_wait(xempty0 + 8 * slot, ((g / SX) & 1) ^ 1);
          mbar_expect_tx(full, (last_x ? sched.x_last_rows : T::BN) * kFusedBK * 2);
          tma_2d(smem_addr(x_tiles + slot * T::kXBytes), last_x ? &maps.x_last : &maps.x, kt * kFusedBK, m0, full);
        }
      });
    }
  } else {  // the consumer warpgroups
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(T::kRegs));
    const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int rw = 64 * wg + 16 * warp;  // this warp's first row in the tile
    // The piece in hand: its tile's first output row and x row, and its first stage. −α of rows g
    // and g + 8 as bf16 pairs (both halves); flipping the sign where a sign bit is 1 gives +α.
    int n0 = 0, m0 = 0, kb = 0, parity = 0;
    // The rings, kept as running values rather than recomputed from the running stage (a division
    // by S and its remainder per stage): the next stage's W slot and x slot, and both phases (bit 0
    // W's, bit 1 x's).
    int slot = 0, xslot = 0, phases = 0, rslot = 0;  // rslot: the next x slot to release
    uint32_t alpha2[2];
    const int sh0 = 15 - 2 * t;  // delta_pair's shift of this lane's first pair (bits 2t, 16 + 2t)
    // ldmatrix.x4 source of this lane: matrix q = lane / 8 (rows +8·(q&1), columns +8·(q>>1)), row
    // lane % 8.
    const int lrow = rw + ((lane >> 3) & 1) * 8 + (lane & 7), lcol = lane >> 4;
    uint32_t loff[4];  // of 16-column chunk j of the stage, in the 128-byte swizzle
#pragma unroll
    for (int j = 0; j < 4; ++j) loff[j] = lrow * 128 + (((2 * j + lcol) ^ (lrow & 7)) << 4);
    const uint32_t w_smem = smem_addr(w_tiles), s_smem = smem_addr(s_tiles) + ((rw >> 4) * 8 + g) * 32;
    const uint64_t desc0 = sw128_desc(smem_addr(x_tiles));  // + (slot · kXBytes) / 16 per slot

    float acc[T::BN / 2];  // written first by each piece's stage 0 wgmma (scale-d = 0)
    uint32_t afrag[T::kSets][4][4];
    // The accumulators as operands of an empty asm: the compiler cannot move their reads or writes
    // across it (a read of acc above the wgmma's wait would read unfinished sums).
    const auto fence_accumulators = [&] {
#pragma unroll
      for (int i = 0; i < T::BN / 2; ++i) asm volatile("" : "+f"(acc[i])::"memory");
    };

    // Stage j of the piece in hand: wait for its W and signs, expand its fragments into register set
    // P, wait for its x, issue its 4 wgmma and release W's slot, then wait until at most the wgmma
    // of this stage and the kSets − 2 before it run, and release the x slot of the stage before
    // those. Branch-free: ptxas serializes the wgmma of a loop with branches in it.
    const auto stage = [&]<int P, bool First, bool Release>(int j) {
      const int s = (kb + j) & 3;  // the stage's 64 columns within its 256-column sign block
      mbar_wait(full0 + 8 * slot, phases & 1);
      const uint32_t wt = w_smem + slot * T::kWBytes;  // block-uniform: the lane's part is in loff
      // Words (t', i): i = 2(s>>1) for row g, +1 for row g + 8; t' even for columns 0..31 of the
      // stage, odd for 32..63; bit c is column c (rows: x, y for t' even, z, w for t' odd).
      [[maybe_unused]] const uint32_t sp = s_smem + (slot * T::kSignBytes + 8 * (s >> 1));
      uint2 e{}, o{};
      if constexpr (Delta) {
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(e.x), "=r"(e.y) : "r"(sp));
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(o.x), "=r"(o.y) : "r"(sp + 16));
      }
      const uint32_t w4[4] = {e.x, e.y, o.x, o.y};
      // Per word, columns 0..15 (zl) and 16..31 (zh) with each column's right neighbour 16 bits
      // above it: the word's low (high) two bytes, then those of the word shifted right by one. A
      // lane's pair (2t, 2t + 1) is then at bits 2t and 16 + 2t, (2t + 8, 2t + 9) at 8 + 2t and
      // 24 + 2t: delta_pair shifts them to 15 and 31 (one shift and two byte permutes per word).
      uint32_t zl[4], zh[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        zl[i] = __byte_perm(w4[i], w4[i] >> 1, 0x5410);
        zh[i] = __byte_perm(w4[i], w4[i] >> 1, 0x7632);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t addr = wt + loff[j];
        uint32_t r0, r1, r2, r3;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                     : "r"(addr));
        // Chunk j: columns 16j.. of the stage: word t' = j / 2, half j % 2 of it.
        [[maybe_unused]] const uint32_t z0 =
            (j & 1) ? zh[(j >> 1) * 2] : zl[(j >> 1) * 2];  // row g
        [[maybe_unused]] const uint32_t z8 =
            (j & 1) ? zh[(j >> 1) * 2 + 1] : zl[(j >> 1) * 2 + 1];  // row g + 8
        if constexpr (Delta) {
          afrag[P][j][0] = bf16x2_add(r0, delta_pair(z0, sh0, alpha2[0]));
          afrag[P][j][1] = bf16x2_add(r1, delta_pair(z8, sh0, alpha2[1]));
          afrag[P][j][2] = bf16x2_add(r2, delta_pair(z0, sh0 - 8, alpha2[0]));
          afrag[P][j][3] = bf16x2_add(r3, delta_pair(z8, sh0 - 8, alpha2[1]));
        } else {
          afrag[P][j][0] = r0, afrag[P][j][1] = r1, afrag[P][j][2] = r2, afrag[P][j][3] = r3;
        }
      }
      mbar_wait(xfull0 + 8 * xslot, phases >> 1);
      const uint64_t desc = desc0 + uint64_t(xslot * (T::kXBytes >> 4));
      uint64_t descs[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) descs[j] = desc + 2 * j;  // +32 B per 16 columns
        // Pin the wgmma inputs' definitions before the fence.
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        asm volatile("" : "+l"(descs[j])::"memory");
#pragma unroll
        for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(afrag[P][j][r])::"memory");
      }
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
      wgmma_m64k16<T::BN, !First>(acc, afrag[P][0], descs[0]);
#pragma unroll
      for (int j = 1; j < 4; ++j) wgmma_m64k16<T::BN, true>(acc, afrag[P][j], descs[j]);
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      // W's slot: issuing the wgmma waited for its fragments, so the ldmatrix reads are done (an
      // arrival right after the expansion could overtake them: run 405, 19 of 162 checks of
      // 128 × 176 tiles wrong, none since).
      mbar_arrive(empty0 + 8 * slot);
      asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(T::kSets - 1) : "memory");
      if constexpr (Release) {
        mbar_arrive(xempty0 + 8 * rslot);
        rslot = rslot + 1 == SX ? 0 : rslot + 1;
      }
      phases ^= (slot + 1 == S ? 1 : 0) | (xslot + 1 == SX ? 2 : 0);
      slot = slot + 1 == S ? 0 : slot + 1;
      xslot = xslot + 1 == SX ? 0 : xslot + 1;
    };
    // Stage j of a piece releases the x slot of stage j − (kSets − 1), whose wgmma the wait retired;
    // the first kSets − 1 stages release none, and the piece's last ones are released after it. The
    // loop takes kSets stages at a time (register sets by constant).
    const auto piece = [&](int nt, int mt, int k0, int k1) {
      n0 = nt * T::BM, m0 = mt * T::BN, kb = k0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = min(n0 + rw + g + 8 * h, N - 1);
        alpha2[h] = neg_alpha_pair(Delta ? alpha[per_row ? n : 0] : 0.0f);
      }
      const int n = k1 - k0;
      rslot = xslot;         // the piece's stage 0 is the first its stages release
      fence_accumulators();  // the last piece's reads of acc stay before this piece's wgmma
      if constexpr (T::kSets == 3) {
        stage.template operator()<0, true, false>(0);
        if (n > 1) stage.template operator()<1, false, false>(1);
        int j = 2;
        for (; j + 2 < n; j += 3) {
          stage.template operator()<2, false, true>(j);
          stage.template operator()<0, false, true>(j + 1);
          stage.template operator()<1, false, true>(j + 2);
        }
        if (j < n) stage.template operator()<2, false, true>(j);
        if (j + 1 < n) stage.template operator()<0, false, true>(j + 1);
      } else {
        stage.template operator()<0, true, false>(0);
        int j = 1;
        for (; j + 1 < n; j += 2) {
          stage.template operator()<1, false, true>(j);
          stage.template operator()<0, false, true>(j + 1);
        }
        if (j < n) stage.template operator()<1, false, true>(j);
      }
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      fence_accumulators();  // no read of acc moves above the wait
      for (int j = max(0, n - (T::kSets - 1)); j < n; ++j) {
        mbar_arrive(xempty0 + 8 * rslot);
        rslot = rslot + 1 == SX ? 0 : rslot + 1;
      }

      if (k0 > 0 || k1 < sched.KT) {
        // A shared tile: its pieces' sums are added in piece order, the same sums on every run. The
        // piece from stage 0 usually comes last: then it adds the others' sums to its own. Otherwise
        // each piece writes its sums (thread-major float4s) and counts itself, and the last to
        // arrive adds all of them from memory.
        const int I = (sched.NT - sched.whole) * sched.KT, i0 = (nt - sched.whole) * sched.KT;
        const int first = stretch_of(i0, I, sched.sk_groups), last = stretch_of(i0 + sched.KT - 1, I, sched.sk_groups);
        const int group = unit / sched.MT;
        const auto slot = [&](int v) {  // group v's part of this tile
          return reinterpret_cast<float4*>(sched.parts) +
                 size_t(2 * (v * sched.MT + mt) + (v == first ? 0 : 1)) * (T::BM * T::BN / 4) + tid;
        };
        unsigned* arrived = sched.arrived + (nt - sched.whole) * sched.MT + mt;
        if (tid == 0) {
          unsigned before = 0;
          if (group == first)
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(before) : "l"(arrived) : "memory");
          last_piece[parity] = group == first && before == unsigned(last - first);
        }
        consumers_sync<T::kConsumers>();
        const int bit = parity;
        parity ^= 1;
        if (!last_piece[bit]) {
          float4* mine = slot(group);
#pragma unroll
          for (int c = 0; c < T::BN / 8; ++c)
            __stcg(mine + c * T::kConsumers, make_float4(acc[4 * c], acc[4 * c + 1], acc[4 * c + 2], acc[4 * c + 3]));
          if (!last_to_arrive(arrived, unsigned(last - first + 1), last_piece[bit],
                              [] { consumers_sync<T::kConsumers>(); }))
            return;
          const float4* part = slot(first);
#pragma unroll
          for (int c = 0; c < T::BN / 8; ++c) {
            const float4 q = __ldcg(part + c * T::kConsumers);
            acc[4 * c] = q.x, acc[4 * c + 1] = q.y, acc[4 * c + 2] = q.z, acc[4 * c + 3] = q.w;
          }
        } else if (tid == 0) {
          *arrived = 0;  // for the next launch (last_to_arrive resets it on the other path)
        }
        for (int v = first + 1; v <= last; ++v) {
          const float4* part = slot(v);
#pragma unroll
          for (int c = 0; c < T::BN / 8; ++c) {
            const float4 q = __ldcg(part + c * T::kConsumers);
            acc[4 * c] += q.x, acc[4 * c + 1] += q.y, acc[4 * c + 2] += q.z, acc[4 * c + 3] += q.w;
          }
        }
      }
      // acc[4i + e]: row g, x row 8i + 2t + e; acc[4i + 2 + e]: row g + 8. y is [M, N].
#pragma unroll
      for (int i = 0; i < T::BN / 8; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int m = m0 + 8 * i + 2 * t + e, n = n0 + rw + g;
          if (m >= M) continue;
          if (n < N) y[size_t(m) * N + n] = acc[4 * i + e];
          if (n + 8 < N) y[size_t(m) * N + n + 8] = acc[4 * i + 2 + e];
        }
    };
    for_each_piece(sched, unit, piece);
  }
#endif
}

}  // namespace

void expand_delta(const __nv_bfloat16* w, int K, const DeltaRef& delta, int n0, int rows,
                  bool with_base, __nv_bfloat16* out, cudaStream_t stream, int max_blocks) {
  if (!delta.signs || !delta.alpha) fail("cuda::expand_delta: no delta");
  const bool aligned = K % 8 == 0 && (reinterpret_cast<uintptr_t>(w) & 15) == 0 &&
                       (reinterpret_cast<uintptr_t>(out) & 15) == 0;
  const size_t threads = size_t(rows) * ((K + 7) / 8);
  size_t blocks = (threads + 255) / 256;
  if (max_blocks > 0) blocks = std::min(blocks, size_t(max_blocks));
  expand_kernel<<<unsigned(blocks), 256, 0, stream>>>(w, K, delta.signs, delta.alpha,
                                                      delta.alpha_per_row ? 1 : 0, n0, rows,
                                                      with_base ? 1 : 0, aligned ? 1 : 0, out);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

PrefillLinear::PrefillLinear(cudaStream_t stream, size_t scratch_elems)
    : stream_(stream), scratch_elems_(scratch_elems) {
  BITDELTA_CUBLAS_CHECK(cublasCreate(&handle_));
  BITDELTA_CUBLAS_CHECK(cublasSetStream(handle_, stream_));
  BITDELTA_CUDA_CHECK(cudaStreamCreateWithFlags(&helper_, cudaStreamNonBlocking));
  // The wgmma fused GEMM is built for sm_90a only: where that code does not run (code_arch.h), kFused
  // takes the portable one.
  int device = 0;
  cudaDeviceProp prop{};
  BITDELTA_CUDA_CHECK(cudaGetDevice(&device));
  BITDELTA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  fused_arch_ = sm90a_kernels_run() && tensor_map_encoder() != nullptr;
  sms_ = prop.multiProcessorCount;
  smem_optin_ = mma_gemm_prepare();
  if (fused_arch_) {
    const auto allow = [](const void* kernel, int bytes) {
      BITDELTA_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    };
    allow(reinterpret_cast<const void*>(fused_gemm_kernel<true, FusedTile128>),
          FusedTile128::kSmem);
    allow(reinterpret_cast<const void*>(fused_gemm_kernel<false, FusedTile128>),
          FusedTile128::kSmem);
    allow(reinterpret_cast<const void*>(fused_gemm_kernel<true, FusedTile256>),
          FusedTile256::kSmem);
    allow(reinterpret_cast<const void*>(fused_gemm_kernel<false, FusedTile256>),
          FusedTile256::kSmem);
    allow(reinterpret_cast<const void*>(fused_gemm_kernel<true, FusedTile2x256>),
          FusedTile2x256::kSmem);
    allow(reinterpret_cast<const void*>(fused_gemm_kernel<false, FusedTile2x256>),
          FusedTile2x256::kSmem);
    allow(reinterpret_cast<const void*>(fused_gemm_kernel<true, FusedTile2x176>),
          FusedTile2x176::kSmem);
    allow(reinterpret_cast<const void*>(fused_gemm_kernel<false, FusedTile2x176>),
          FusedTile2x176::kSmem);
    allow(reinterpret_cast<const void*>(fused_gemm_kernel<true, FusedTile64>), FusedTile64::kSmem);
    allow(reinterpret_cast<const void*>(fused_gemm_kernel<false, FusedTile64>), FusedTile64::kSmem);
  }
  for (int i = 0; i < 2; ++i) {
    BITDELTA_CUDA_CHECK(cudaMalloc(&scratch_[i], scratch_elems_ * sizeof(__nv_bfloat16)));
    BITDELTA_CUDA_CHECK(cudaEventCreateWithFlags(&expanded_[i], cudaEventDisableTiming));
    BITDELTA_CUDA_CHECK(cudaEventCreateWithFlags(&consumed_[i], cudaEventDisableTiming));
  }
}

PrefillLinear::~PrefillLinear() {
  for (int i = 0; i < 2; ++i) {
    cudaEventDestroy(expanded_[i]);
    cudaEventDestroy(consumed_[i]);
    cudaFree(scratch_[i]);
  }
  cudaStreamDestroy(helper_);
  cublasDestroy(handle_);
}

// Row-major Y[rows, n_rows] (leading dimension ldy) = X[rows, K] · W_rows[n_rows, K]ᵀ, i.e.
// column-major Yᵀ = W_rowsᵀᵀ · Xᵀ.
void PrefillLinear::gemm(const __nv_bfloat16* w_rows, int n_rows, int K, const __nv_bfloat16* x,
                         int rows, float* y, int ldy, float beta) {
  const float one = 1.0f;
  BITDELTA_CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, n_rows, rows, K, &one,
                                     w_rows, CUDA_R_16BF, K, x, CUDA_R_16BF, K, &beta, y,
                                     CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

bool PrefillLinear::fused_gemm_supported(const __nv_bfloat16* w, int K,
                                         const __nv_bfloat16* x) const {
  return fused_arch_ && K % kFusedBK == 0 && K >= 2 * kFusedBK &&
         (reinterpret_cast<uintptr_t>(w) & 15) == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0;
}

template <typename T>
void launch_fused(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows,
                  const DeltaRef& delta, float* y, cudaStream_t stream, int sms, FusedSplit split) {
  FusedMaps maps;
  const cuuint64_t wdims[2] = {cuuint64_t(K), cuuint64_t(N)},
                   xdims[2] = {cuuint64_t(K), cuuint64_t(rows)};
  const cuuint64_t rstride[1] = {cuuint64_t(K) * 2};
  const int last_rows = (rows - (rows - 1) / T::BN * T::BN + 7) / 8 * 8;
  const cuuint32_t wbox[2] = {kFusedBK, T::BM}, xbox[2] = {kFusedBK, T::BN},
                   xlbox[2] = {kFusedBK, cuuint32_t(last_rows)};
  encode_tensor_map(&maps.w, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, w, wdims, rstride, wbox,
         CU_TENSOR_MAP_SWIZZLE_128B);
  encode_tensor_map(&maps.x, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, x, xdims, rstride, xbox,
         CU_TENSOR_MAP_SWIZZLE_128B);
  encode_tensor_map(&maps.x_last, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, x, xdims, rstride, xlbox,
         CU_TENSOR_MAP_SWIZZLE_128B);
  FusedSchedule sched{};
  sched.x_last_rows = last_rows;
  sched.NT = (N + T::BM - 1) / T::BM;
  sched.MT = (rows + T::BN - 1) / T::BN;
  sched.KT = K / kFusedBK;
  sched.whole = sched.groups = sched.NT;  // one tile per block
  if (split == FusedSplit::kStreamK && sched.MT <= sms && sched.NT % (sms / sched.MT) != 0) {
    // One block per multiprocessor, in groups of MT.
    sched.groups = sms / sched.MT;
    // All but the last one or two waves' worth of W tiles go whole; those are spread over all
    // groups as stages (each group then has at least KT of them), so that no multiprocessor idles
    // for most of a last, partial wave.
    sched.whole = std::max(0, sched.NT / sched.groups - 1) * sched.groups;
    sched.sk_groups = std::min(sched.groups, (sched.NT - sched.whole) * sched.KT);
    const size_t blocks = size_t(sched.groups) * sched.MT, shared = size_t(sched.NT - sched.whole) * sched.MT;
    sched.parts = static_cast<float*>(
        stream_scratch(ScratchUse::kPrefillParts, stream, 2 * blocks * T::BM * T::BN * sizeof(float)));
    sched.arrived = static_cast<unsigned*>(
        stream_scratch(ScratchUse::kPrefillCounters, stream, shared * sizeof(unsigned), true));
  } else if (split != FusedSplit::kTilePerBlock && sched.MT <= sms) {
    sched.groups = std::min(sms / sched.MT, sched.NT);  // persistent, or stream-K on whole waves: whole tiles only
  }
  const float* alpha = nullptr;
  int per_row = 0;
  if (delta.signs) {
    // The packed signs as words [row group][column block][g][t' pair][8 words] (packed_signs.h:
    // [g][t'][i]), a box row of 32 bytes per g (FusedTile's kSignBytes says why).
    const int KB = sign_blocks(K);
    const cuuint64_t sdims[5] = {8, 2, 8, cuuint64_t(KB), cuuint64_t((N + 15) / 16)};
    const cuuint64_t sstrides[4] = {32, 64, 512, 512 * cuuint64_t(KB)};
    const cuuint32_t sbox[5] = {8, 1, 8, 1, T::BM / 16};
    encode_tensor_map(&maps.signs, CU_TENSOR_MAP_DATA_TYPE_UINT32, 5, delta.signs, sdims, sstrides, sbox,
           CU_TENSOR_MAP_SWIZZLE_NONE);
    alpha = delta.alpha;
    per_row = delta.alpha_per_row ? 1 : 0;
  }
  const auto kernel = delta.signs ? fused_gemm_kernel<true, T> : fused_gemm_kernel<false, T>;
  kernel<<<unsigned(sched.groups * sched.MT), T::kThreads, T::kSmem, stream>>>(maps, sched, alpha, per_row, y, N,
                                                                               rows);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

void PrefillLinear::fused_gemm(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x,
                               int rows, const DeltaRef& delta, float* y) {
  FusedConfig c = fused_config_;
  if (c.bm == 0 || c.bn == 0) {
    // By rows: 64 × 64 tiles up to 64 rows, 128 × 128 up to 128; beyond, 128 × 256 where those
    // tiles fill the multiprocessors, else 64 × 256 (twice the tiles). 128 × 176 instead of
    // 128 × 256 where those make less than two waves (stream-K would split every tile) and 176's
    // waves of whole tiles do more than 90% useful work (padding rows and idle multiprocessors
    // counted) and more than 256's: e.g. 512 rows in three at 11008 × 4096. Whole tiles on
    // persistent blocks where they make whole waves (or nearly: 90%), else stream-K
    // (bench/cuda/NOTES.md, parts 10 and 11).
    const auto tiles = [&](int bm, int bn) { return (N + bm - 1) / bm * ((rows + bn - 1) / bn); };
    const auto useful = [&](int bm, int bn) {  // of the multiprocessors' time, with whole tiles per block
      const int waves = (tiles(bm, bn) + sms_ - 1) / sms_;
      return double(N) * rows / (double(waves) * sms_ * bm * bn);
    };
    c.bm = rows <= 64 ? 64 : rows <= 128 ? 128 : tiles(128, 256) * 10 >= sms_ * 9 ? 128 : 64;
    c.bn = rows <= 64 ? 64 : rows <= 128 ? 128 : 256;
    if (c.bm == 128 && c.bn == 256 && tiles(128, 256) < 2 * sms_ &&
        useful(128, 176) > std::max(0.9, useful(128, 256)))
      c.bn = 176;
    const int last_wave = tiles(c.bm, c.bn) % sms_;
    c.split = last_wave == 0 || last_wave * 10 >= sms_ * 9 ? FusedSplit::kPersistent : FusedSplit::kStreamK;
  }
  if (c.bm == 64 && c.bn == 256)
    launch_fused<FusedTile256>(w, N, K, x, rows, delta, y, stream_, sms_, c.split);
  else if (c.bm == 128 && c.bn == 256)
    launch_fused<FusedTile2x256>(w, N, K, x, rows, delta, y, stream_, sms_, c.split);
  else if (c.bm == 128 && c.bn == 176)
    launch_fused<FusedTile2x176>(w, N, K, x, rows, delta, y, stream_, sms_, c.split);
  else if (c.bm == 128 && c.bn == 128)
    launch_fused<FusedTile128>(w, N, K, x, rows, delta, y, stream_, sms_, c.split);
  else if (c.bm == 64 && c.bn == 64)
    launch_fused<FusedTile64>(w, N, K, x, rows, delta, y, stream_, sms_, c.split);
  else
    fail("cuda::PrefillLinear: no fused tile of ", c.bm, " x ", c.bn);
}

void PrefillLinear::fused_gemm_mma(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows,
                                   const DeltaRef& delta, float* y) {
  MmaGemmConfig c = mma_gemm_choose(N, K, rows, smem_optin_, sms_);
  if (fused_config_.mma_bn) c.bn = fused_config_.mma_bn;
  if (fused_config_.mma_stages) c.stages = fused_config_.mma_stages;
  if (fused_config_.mma_k_split) c.k_split = std::min(fused_config_.mma_k_split, K / 64);  // at most K/64
  if (mma_gemm_smem(c) > smem_optin_)
    fail("cuda::PrefillLinear: the portable fused GEMM's tile of ", c.bn, " rows in ", c.stages, " stages takes ",
         mma_gemm_smem(c), " bytes of shared memory; this GPU allows a block ", smem_optin_);
  mma_gemm(w, N, K, x, rows, delta, y, stream_, c);
}

void PrefillLinear::run(PrefillMethod method, const __nv_bfloat16* w, int N, int K,
                        const __nv_bfloat16* x, int rows, const DeltaRef& delta, float* y,
                        int chunk_rows, int expand_blocks) {
  if (N < 1 || K < 1 || rows < 1) fail("cuda::PrefillLinear: empty shape");
  if (method == PrefillMethod::kFused || method == PrefillMethod::kFusedMma) {
    // Without a delta: the fused kernel on W alone (for measurement). The sm_90a kernel where it runs
    // and takes the operands, else the portable one; where neither takes them: materialize, or
    // cuBLAS without a delta.
    if (method == PrefillMethod::kFused && fused_gemm_supported(w, K, x) &&
        (reinterpret_cast<uintptr_t>(delta.signs) & 15) == 0)
      return fused_gemm(w, N, K, x, rows, delta, y);
    if ((method == PrefillMethod::kFusedMma || rows <= kPortableFusedRows) && mma_gemm_supported(w, K, x, delta))
      return fused_gemm_mma(w, N, K, x, rows, delta, y);
    method = PrefillMethod::kMaterialize;
  }
  if (method == PrefillMethod::kBaseOnly || !delta.signs) return gemm(w, N, K, x, rows, y, N, 0.0f);
  const int fit = int(std::min<size_t>(scratch_elems_ / size_t(K), size_t(N)));
  if (fit < 1)
    fail("cuda::PrefillLinear: scratch of ", scratch_elems_, " elements holds no row of ", K);
  const int chunk = chunk_rows > 0 ? std::min(chunk_rows, fit) : fit;
  switch (method) {
    case PrefillMethod::kTwoGemms:
      gemm(w, N, K, x, rows, y, N, 0.0f);
      for (int n0 = 0; n0 < N; n0 += chunk) {
        const int nc = std::min(chunk, N - n0);
        expand_delta(w, K, delta, n0, nc, false, scratch_[0], stream_);
        gemm(scratch_[0], nc, K, x, rows, y + n0, N, 1.0f);
      }
      return;
    case PrefillMethod::kMaterialize:
      for (int n0 = 0; n0 < N; n0 += chunk) {
        const int nc = std::min(chunk, N - n0);
        expand_delta(w, K, delta, n0, nc, true, scratch_[0], stream_);
        gemm(scratch_[0], nc, K, x, rows, y + n0, N, 0.0f);
      }
      return;
    case PrefillMethod::kPipelined: {
      // helper expands chunk i into buffer i%2 once the GEMM of chunk i-2 has consumed it; the main
      // stream's GEMM of chunk i waits for that expansion.
      BITDELTA_CUDA_CHECK(cudaEventRecord(consumed_[0], stream_));
      BITDELTA_CUDA_CHECK(cudaEventRecord(consumed_[1], stream_));
      int i = 0;
      for (int n0 = 0; n0 < N; n0 += chunk, ++i) {
        const int nc = std::min(chunk, N - n0), b = i % 2;
        BITDELTA_CUDA_CHECK(cudaStreamWaitEvent(helper_, consumed_[b], 0));
        expand_delta(w, K, delta, n0, nc, true, scratch_[b], helper_, expand_blocks);
        BITDELTA_CUDA_CHECK(cudaEventRecord(expanded_[b], helper_));
        BITDELTA_CUDA_CHECK(cudaStreamWaitEvent(stream_, expanded_[b], 0));
        gemm(scratch_[b], nc, K, x, rows, y + n0, N, 0.0f);
        BITDELTA_CUDA_CHECK(cudaEventRecord(consumed_[b], stream_));
      }
      return;
    }
    case PrefillMethod::kBaseOnly:
    case PrefillMethod::kFused:
    case PrefillMethod::kFusedMma:
      break;
  }
}

}  // namespace bitdelta::cuda
