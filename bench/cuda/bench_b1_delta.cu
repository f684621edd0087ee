// Prototype, for measurement only (not used by the engine): the delta term x·Sᵀ of V variants with
// one row of x each, computed with the 1-bit mma straight from the sign bits in the file's layout
// ([N, K/8] bytes, LSB first). x is quantized to 16-bit integers q and laid out as 16 bit-planes;
// per 16 output rows and 256 columns a warp issues two mma.m16n8k256.and.popc (8 planes each):
//   Σ_k s_k·q_k = 2·Σ_p w_p·popc(bits ∧ plane_p) − Σ_p w_p·popc(plane_p),  w_p = 2^p (p < 15), −2^15.
// Checked exactly against a CPU integer dot product on a small case, then timed at the benchmark
// shapes with 16 variants: bytes = the signs (V·N·K/8), roofline = bytes / device copy bandwidth.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

namespace {

#define CHECK(x)                                                                 \
  do {                                                                           \
    cudaError_t e = (x);                                                         \
    if (e != cudaSuccess) {                                                      \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e));               \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)


// One warp: 16 output rows (tile) of one variant v over all of K. planes: [V][16][K/32] words.
// kPacked: the signs in fragment order, [tile][K/256][32 lanes] × 16 bytes (one coalesced 512-byte
// load per warp and block); otherwise the file's layout (16 rows × 32 bytes per warp and block).
// kUnroll: 256-column blocks in flight per warp.
// ks warps share one (tile, variant), each over 1/ks of K (a block of 32·ks threads per tile and
// variant), summing in shared memory; ks = 0: one warp per tile and variant, 4 per block.
template <int kLayout, int kUnroll>  // kLayout: 0 file, 1 fragment order tile-major, 2 block-major
__global__ void __launch_bounds__(256) b1_delta(const uint32_t* const* signs, const uint32_t* planes,
                                                const int* plane_popc, int V, int N, int K, int ks, long long* y) {
  __shared__ long long part[8][16];
  const int lane = threadIdx.x % 32, wib = threadIdx.x / 32;
  const int warp = ks ? blockIdx.x : (blockIdx.x * blockDim.x + threadIdx.x) / 32, kpart = ks ? wib : 0, nparts = ks ? ks : 1;
  const int tiles = N / 16, v = warp / tiles, tile = warp % tiles;
  if (v >= V) return;  // whole warps (whole blocks when ks > 0)
  const int g = lane >> 2, t = lane & 3, KW = K / 32, KB = K / 256;
  const uint32_t* rowA = signs[v] + size_t(tile * 16 + g) * KW;  // row g of the tile
  const uint32_t* rowB = rowA + size_t(8) * KW;                  // row g + 8
  const uint32_t* pl = planes + size_t(v) * 16 * KW;
  int lo[4] = {}, hi[4] = {};  // planes 0..7 and 8..15: D fragments
  const int kb_begin = KB * kpart / nparts, kb_end = KB * (kpart + 1) / nparts;
  for (int kb = kb_begin; kb < kb_end; kb += kUnroll) {
    uint32_t a[kUnroll][4], b[kUnroll][4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int w = (min(kb + u, kb_end - 1)) * 8 + t;
      if (kLayout > 0) {
        const int kbu = min(kb + u, kb_end - 1);
        const size_t frag = kLayout == 1 ? size_t(tile) * KB + kbu : size_t(kbu) * tiles + tile;
        const uint4 f = __ldg(reinterpret_cast<const uint4*>(signs[v]) + frag * 32 + lane);
        a[u][0] = f.x, a[u][1] = f.y, a[u][2] = f.z, a[u][3] = f.w;
      } else {
        a[u][0] = __ldg(rowA + w);
        a[u][1] = __ldg(rowB + w);
        a[u][2] = __ldg(rowA + w + 4);
        a[u][3] = __ldg(rowB + w + 4);
      }
      b[u][0] = __ldg(pl + size_t(g) * KW + w);
      b[u][1] = __ldg(pl + size_t(g) * KW + w + 4);
      b[u][2] = __ldg(pl + size_t(g + 8) * KW + w);
      b[u][3] = __ldg(pl + size_t(g + 8) * KW + w + 4);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (kb + u >= kb_end) break;
      asm volatile(
          "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+r"(lo[0]), "+r"(lo[1]), "+r"(lo[2]), "+r"(lo[3])
          : "r"(a[u][0]), "r"(a[u][1]), "r"(a[u][2]), "r"(a[u][3]), "r"(b[u][0]), "r"(b[u][1]));
      asm volatile(
          "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+r"(hi[0]), "+r"(hi[1]), "+r"(hi[2]), "+r"(hi[3])
          : "r"(a[u][0]), "r"(a[u][1]), "r"(a[u][2]), "r"(a[u][3]), "r"(b[u][2]), "r"(b[u][3]));
    }
  }
  // D[row][plane]: lo[0], lo[1] = row g, planes 2t, 2t+1; lo[2], lo[3] = row g+8; hi: planes + 8.
  const auto weight = [](int p) -> long long { return p == 15 ? -(1LL << 15) : (1LL << p); };
  const int* pp = plane_popc + v * 16;
  long long ra = 0, rb = 0;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int p = 2 * t + i;
    // Σ q over all of K (the plane popcounts) is subtracted once per tile: by the first K part.
    const long long cp = kpart == 0 ? pp[p] : 0, cq = kpart == 0 ? pp[p + 8] : 0;
    ra += weight(p) * (2LL * lo[i] - cp) + weight(p + 8) * (2LL * hi[i] - cq);
    rb += weight(p) * (2LL * lo[2 + i] - cp) + weight(p + 8) * (2LL * hi[2 + i] - cq);
  }
  for (int o = 1; o < 4; o <<= 1) {
    ra += __shfl_xor_sync(0xffffffffu, ra, o);
    rb += __shfl_xor_sync(0xffffffffu, rb, o);
  }
  if (!ks) {
    if (t == 0) {
      y[size_t(v) * N + tile * 16 + g] = ra;
      y[size_t(v) * N + tile * 16 + g + 8] = rb;
    }
    return;
  }
  if (t == 0) part[kpart][g] = ra, part[kpart][g + 8] = rb;
  __syncthreads();
  if (threadIdx.x < 16) {
    long long sum = 0;
    for (int i = 0; i < ks; ++i) sum += part[i][threadIdx.x];
    y[size_t(v) * N + tile * 16 + threadIdx.x] = sum;
  }
}

struct Problem {
  int V, N, K;
  std::vector<std::vector<uint32_t>> signs;  // file layout as words (K % 256 == 0)
  std::vector<std::vector<int16_t>> q;
  std::vector<uint32_t> planes;
  std::vector<int> popc;
};

Problem make(int V, int N, int K, uint32_t seed) {
  std::mt19937 rng(seed);
  Problem p{V, N, K, {}, {}, std::vector<uint32_t>(size_t(V) * 16 * (K / 32)), std::vector<int>(V * 16)};
  for (int v = 0; v < V; ++v) {
    p.signs.emplace_back(size_t(N) * K / 32);
    for (auto& w : p.signs.back()) w = rng();
    p.q.emplace_back(K);
    for (auto& x : p.q.back()) x = int16_t(rng());
    for (int k = 0; k < K; ++k)
      for (int b = 0; b < 16; ++b)
        if ((uint16_t(p.q[v][k]) >> b) & 1) {
          p.planes[(size_t(v) * 16 + b) * (K / 32) + k / 32] |= 1u << (k % 32);
          ++p.popc[v * 16 + b];
        }
  }
  return p;
}

// The fragment-order copy of one variant's signs (file layout as words, K % 256 == 0): fragments
// (tile, block) in tile-major order, or block-major (all tiles of one 256-column block together).
std::vector<uint32_t> fragment_order(const std::vector<uint32_t>& s, int N, int K, bool block_major) {
  const int KW = K / 32, KB = K / 256;
  std::vector<uint32_t> out(s.size());
  for (int tile = 0; tile < N / 16; ++tile)
    for (int kb = 0; kb < KB; ++kb)
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane >> 2, t = lane & 3, w = kb * 8 + t;
        const size_t rowA = size_t(tile * 16 + g) * KW, rowB = rowA + size_t(8) * KW;
        const size_t frag = block_major ? size_t(kb) * (N / 16) + tile : size_t(tile) * KB + kb;
        uint32_t* o = &out[(frag * 32 + lane) * 4];
        o[0] = s[rowA + w], o[1] = s[rowB + w], o[2] = s[rowA + w + 4], o[3] = s[rowB + w + 4];
      }
  return out;
}

struct Device {
  std::vector<uint32_t*> s;
  uint32_t** sp = nullptr;
  uint32_t* planes = nullptr;
  int* popc = nullptr;
  long long* y = nullptr;
};

Device upload(const Problem& p, int layout) {
  Device d;
  for (const auto& s0 : p.signs) {
    const auto s = layout ? fragment_order(s0, p.N, p.K, layout == 2) : s0;
    uint32_t* ptr;
    CHECK(cudaMalloc(&ptr, s.size() * 4));
    CHECK(cudaMemcpy(ptr, s.data(), s.size() * 4, cudaMemcpyHostToDevice));
    d.s.push_back(ptr);
  }
  CHECK(cudaMalloc(&d.sp, p.V * sizeof(uint32_t*)));
  CHECK(cudaMemcpy(d.sp, d.s.data(), p.V * sizeof(uint32_t*), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&d.planes, p.planes.size() * 4));
  CHECK(cudaMemcpy(d.planes, p.planes.data(), p.planes.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&d.popc, p.popc.size() * 4));
  CHECK(cudaMemcpy(d.popc, p.popc.data(), p.popc.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&d.y, size_t(p.V) * p.N * 8));
  return d;
}

void launch(const Problem& p, const Device& d, int layout, int unroll = 4, int ks = 0) {
  const int warps = p.V * (p.N / 16);
  const int blocks = ks ? warps : (warps + 3) / 4, threads = ks ? 32 * ks : 128;
  if (layout == 2)
    b1_delta<2, 4><<<blocks, threads>>>(d.sp, d.planes, d.popc, p.V, p.N, p.K, ks, d.y);
  else if (layout == 1 && unroll == 8)
    b1_delta<1, 8><<<blocks, threads>>>(d.sp, d.planes, d.popc, p.V, p.N, p.K, ks, d.y);
  else if (layout == 1)
    b1_delta<1, 4><<<blocks, threads>>>(d.sp, d.planes, d.popc, p.V, p.N, p.K, ks, d.y);
  else
    b1_delta<0, 4><<<blocks, threads>>>(d.sp, d.planes, d.popc, p.V, p.N, p.K, ks, d.y);
  CHECK(cudaGetLastError());
}

}  // namespace

int main() {
  const auto ks_of = [](int mode) { return mode == 3 ? 2 : mode == 4 ? 4 : mode == 5 ? 8 : 0; };
  const auto layout_of = [](int mode) { return mode == 0 ? 0 : mode == 6 ? 2 : 1; };
  for (int mode : {0, 1, 2, 3, 4, 5, 6}) {  // exactness against a CPU integer dot product
    const bool packed = mode > 0;
    const Problem p = make(3, 48, 4096, 7);
    const Device d = upload(p, layout_of(mode));
    launch(p, d, layout_of(mode), mode == 2 ? 8 : 4, ks_of(mode));
    std::vector<long long> y(size_t(p.V) * p.N);
    CHECK(cudaMemcpy(y.data(), d.y, y.size() * 8, cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int v = 0; v < p.V; ++v)
      for (int n = 0; n < p.N; ++n) {
        long long want = 0;
        for (int k = 0; k < p.K; ++k)
          want += ((p.signs[v][size_t(n) * (p.K / 32) + k / 32] >> (k % 32)) & 1) ? p.q[v][k] : -p.q[v][k];
        bad += y[size_t(v) * p.N + n] != want;
      }
    std::printf("exactness (%s, %d blocks in flight, K split over %d warps): %d of %d outputs differ from the CPU integer dot product\n",
                mode == 6 ? "fragment order, block-major" : packed ? "fragment order" : "file layout", mode == 2 ? 8 : 4, std::max(1, ks_of(mode)), bad, p.V * p.N);
    if (bad) return 1;
  }
  double copy_bw = 0;
  {
    const size_t bytes = size_t(1) << 30;
    void *a, *b;
    CHECK(cudaMalloc(&a, bytes));
    CHECK(cudaMalloc(&b, bytes));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    float best = 1e30f;
    for (int r = 0; r < 10; ++r) {
      CHECK(cudaEventRecord(e0));
      CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      best = ms < best ? ms : best;
    }
    copy_bw = 2.0 * bytes / (best * 1e-3);
    std::printf("device copy bandwidth: %.0f GB/s\n", copy_bw / 1e9);
  }
  std::printf("%-12s %-15s %4s %10s %10s %8s %8s\n", "shape", "signs", "V", "time_us", "MB", "GB/s", "roof/t");
  const int shapes[5][2] = {{4096, 4096}, {11008, 4096}, {4096, 11008}, {8192, 8192}, {28672, 8192}};
  for (const auto& s : shapes)
  for (int mode : {0, 1, 6, 3, 2, 4, 5}) {
    const int N = s[0], K = s[1] / 256 * 256;  // the prototype needs K % 256 == 0 (11008 = 43·256)
    const Problem p = make(16, N, K, 1);
    const Device d = upload(p, layout_of(mode));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int r = 0; r < 50; ++r) {
      CHECK(cudaEventRecord(e0));
      launch(p, d, layout_of(mode), mode == 2 ? 8 : 4, ks_of(mode));
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms * 1e3f);
    }
    std::sort(t.begin(), t.end());
    const double us = t[t.size() / 2], bytes = 16.0 * N * K / 8;
    std::printf("%5dx%-6d %-15s %4d %10.2f %10.1f %8.0f %8.3f\n", N, K, mode == 0 ? "file, 4 blocks" : mode == 1 ? "fragment, 4" : mode == 2 ? "fragment, 8" : mode == 3 ? "frag 4, ks 2" : mode == 4 ? "frag 4, ks 4" : mode == 5 ? "frag 4, ks 8" : "block-major, 4", 16, us, bytes / 1e6, bytes / (us * 1e-6) / 1e9,
                bytes / copy_bw / (us * 1e-6));
    for (auto* ptr : d.s) CHECK(cudaFree(ptr));
    CHECK(cudaFree(d.sp));
    CHECK(cudaFree(d.planes));
    CHECK(cudaFree(d.popc));
    CHECK(cudaFree(d.y));
  }
  return 0;
}
