// Throughput of warp-level mma shapes on this GPU: the integer ones the delta term could use, int8
// m16n8k32 (what the decode kernel uses: 512 sign×x products per instruction, after expanding
// the sign bits to bytes) against 1-bit m16n8k256 with AND + popcount (4096 sign×bit products per
// instruction, on the packed bits directly); and bf16 m16n8k16 with f32 accumulators, what the
// portable fused GEMM (fused_gemm_mma.cu) issues, the yardstick for its TF/s. Every warp runs 8
// independent accumulator chains on register operands; the grid fills every multiprocessor with 16
// warps. Prints instructions/s per SM and the implied multiply-accumulate rate.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace {

constexpr int kChains = 8, kIters = 4096;

enum class Shape { kS8, kB1, kBf16 };

template <Shape kShape>
__global__ void mma_loop(int* out, uint32_t seed) {
  int acc[kChains][4] = {};
  float facc[kChains][4] = {};
  uint32_t a0 = seed ^ threadIdx.x, a1 = a0 * 3u, a2 = a0 * 5u, a3 = a0 * 7u, b0 = a0 * 11u, b1 = a0 * 13u;
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if constexpr (kShape == Shape::kBf16)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(facc[c][0]), "+f"(facc[c][1]), "+f"(facc[c][2]), "+f"(facc[c][3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      else if constexpr (kShape == Shape::kB1)
        asm volatile(
            "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+r"(acc[c][0]), "+r"(acc[c][1]), "+r"(acc[c][2]), "+r"(acc[c][3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      else
        asm volatile(
            "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+r"(acc[c][0]), "+r"(acc[c][1]), "+r"(acc[c][2]), "+r"(acc[c][3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
  }
  int s = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c)
    s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3] + int(facc[c][0] + facc[c][1] + facc[c][2] + facc[c][3]);
  if (s == 0x12345678) out[0] = s;  // keeps the loop
}

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e = (x);                                                                  \
    if (e != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e));                        \
      return 1;                                                                           \
    }                                                                                     \
  } while (0)

template <Shape kShape>
int run(const cudaDeviceProp& prop, double ghz, int* out) {
  const int warps_per_sm = 16, blocks = prop.multiProcessorCount * warps_per_sm / 4;
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  mma_loop<kShape><<<blocks, 128>>>(out, 1);  // warm-up
  CHECK(cudaGetLastError());
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK(cudaEventRecord(e0));
    mma_loop<kShape><<<blocks, 128>>>(out, rep);
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    best = ms < best ? ms : best;
  }
  const double instr = double(blocks) * 4 * kIters * kChains, s = best * 1e-3;
  const int k = kShape == Shape::kB1 ? 256 : kShape == Shape::kS8 ? 32 : 16;
  const double macs = instr * 16.0 * 8 * k;
  const char* name = kShape == Shape::kB1 ? "m16n8k256 b1 and.popc" : kShape == Shape::kS8 ? "m16n8k32 s8" : "m16n8k16 bf16 (f32)";
  std::printf("%-24s %8.3f ms  %6.3f mma/clk/SM at %.2f GHz  %8.1f T products/s (%.0f TFLOP/s)\n", name, best,
              instr / s / prop.multiProcessorCount / (ghz * 1e9), ghz, macs / s / 1e12, 2 * macs / s / 1e12);
  return 0;
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int khz = 0;
  CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  const double ghz = khz / 1e6;
  std::printf("device: %s, %d SMs, max SM clock %.2f GHz (rates below assume it)\n", prop.name,
              prop.multiProcessorCount, ghz);
  int* out = nullptr;
  CHECK(cudaMalloc(&out, 4));
  if (run<Shape::kS8>(prop, ghz, out) || run<Shape::kB1>(prop, ghz, out) || run<Shape::kBf16>(prop, ghz, out)) return 1;
  return 0;
}
