// The streaming decode kernel's ring of TMA stages with nothing consuming them but a barrier: what
// its stage geometry (rows per tile, columns per stage, ring depth, what else rides in a stage) lets
// the memory deliver, set beside the floor of a plain read of the same bytes (read_floor.cu).
#include "tile_read.h"

#include <algorithm>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/packed_signs.h"
#include "backend/cuda/tma.cuh"
#include "common.h"

namespace bitdelta::bench {

namespace bcuda = bitdelta::cuda;

std::string TileReadConfig::name() const {
  std::string s = std::to_string(rows) + "x" + std::to_string(cols) + " S" + std::to_string(stages);
  if (blocks_per_sm > 1) s += " " + std::to_string(blocks_per_sm) + "/SM";
  if (variants) s += " +" + std::to_string(variants) + "v";
  if (side_bytes) s += " +side" + std::to_string(side_bytes / 1024) + "K";
  if (rotate) s += " rot";
  return s;
}

namespace {

constexpr int kMaxVariants = 16;

struct Params {
  CUtensorMap w;
  CUtensorMap signs[kMaxVariants];
  const uint8_t* side;
  int R, C, S, nvar, side_bytes, stage_bytes, tx_bytes, KB, whole, ks, units, rotate;
};

__global__ void __launch_bounds__(64) tile_read_kernel(const __grid_constant__ Params p) {
#ifdef BITDELTA_FUSED_WGMMA
  using namespace bcuda;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  const uint32_t full0 = smem_addr(smem + p.S * p.stage_bytes), empty0 = full0 + 8 * p.S;
  const int grid = int(gridDim.x);
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.S; ++s) mbar_init(full0 + 8 * s, 1), mbar_init(empty0 + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // Unit u: rows n0.., column blocks kb0 + [0, nst) (whole tiles from a rotated start).
  const auto unit_range = [&](int u, int& n0, int& kb0, int& nst) {
    if (u < p.whole) {
      n0 = u * p.R, kb0 = p.rotate ? (int(blockIdx.x) * 7) % p.KB : 0, nst = p.KB;
      return;
    }
    const int part = (u - p.whole) % p.ks;
    n0 = (p.whole + (u - p.whole) / p.ks) * p.R;
    kb0 = p.KB * part / p.ks;
    nst = p.KB * (part + 1) / p.ks - kb0;
  };
  if (threadIdx.x == 0) {
    int it = 0;
    for (int u = int(blockIdx.x); u < p.units; u += grid) {
      int n0, kb0, nst;
      unit_range(u, n0, kb0, nst);
      for (int i = 0; i < nst; ++i, ++it) {
        const int slot = it % p.S, kb = (kb0 + i) % p.KB;
        if (it >= p.S) mbar_wait(empty0 + 8 * slot, ((it / p.S) & 1) ^ 1);
        const uint32_t st = smem_addr(smem + slot * p.stage_bytes), full = full0 + 8 * slot;
        mbar_expect_tx(full, p.tx_bytes);
        for (int c = 0; c < p.C / 64; ++c) tma_2d(st + c * p.R * 128, &p.w, kb * p.C + 64 * c, n0, full);
        uint32_t off = p.R * p.C * 2;
        for (int v = 0; v < p.nvar; ++v, off += p.R / 16 * p.C / 256 * 512)
          tma_3d(st + off, &p.signs[v], 0, kb * (p.C / 256), n0 / 16, full);
        if (p.side_bytes) tma_1d(st + off, p.side + size_t(kb % 64) * p.side_bytes, p.side_bytes, full);
      }
    }
  } else if (threadIdx.x == 32) {
    int it = 0;
    for (int u = int(blockIdx.x); u < p.units; u += grid) {
      int n0, kb0, nst;
      unit_range(u, n0, kb0, nst);
      for (int i = 0; i < nst; ++i, ++it) {
        mbar_wait(full0 + 8 * (it % p.S), (it / p.S) & 1);
        mbar_arrive(empty0 + 8 * (it % p.S));
      }
    }
  }
#endif
}

}  // namespace

double tile_read_us(const TileReadConfig& c, const std::vector<TileReadSet>& sets, int N, int K, int reps) {
  if (c.rows % 16 || c.rows > 256 || c.cols % 256 || c.variants > kMaxVariants || c.side_bytes % 16 ||
      c.stages < 1 || K % c.cols)
    fail("tile_read_us: config ", c.name(), " does not fit K = ", K);
  int device = 0, sms = 0, optin = 0;
  BITDELTA_CUDA_CHECK(cudaGetDevice(&device));
  BITDELTA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  BITDELTA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  Params p{};
  p.R = c.rows, p.C = c.cols, p.S = c.stages, p.nvar = c.variants, p.side_bytes = c.side_bytes;
  p.tx_bytes = c.rows * c.cols * 2 + c.variants * (c.rows / 16) * (c.cols / 256) * 512 + c.side_bytes;
  p.stage_bytes = (p.tx_bytes + 1023) / 1024 * 1024;
  const int smem = 1024 + c.stages * p.stage_bytes + 16 * c.stages;
  if (smem * c.blocks_per_sm > optin + 1024 * (c.blocks_per_sm - 1) || smem > optin)
    fail("tile_read_us: config ", c.name(), " needs ", smem, " bytes of shared memory per block");
  p.KB = K / c.cols;
  const int tiles = (N + c.rows - 1) / c.rows, grid_max = sms * c.blocks_per_sm;
  // The streaming kernel's units until part 17 (whole tiles, then the leftover ones split along K);
  // it now takes equal ranges of units (NOTES.md, part 17). The bytes each block reads are close.
  p.whole = tiles / grid_max * grid_max;
  const int leftover = tiles - p.whole;
  p.ks = leftover == 0 ? 1 : std::max(1, std::min({8, grid_max / leftover, std::max(1, p.KB / 2)}));
  p.units = p.whole + leftover * p.ks;
  p.rotate = c.rotate ? 1 : 0;
  DeviceMem side(size_t(64) * std::max(c.side_bytes, 16));
  BITDELTA_CUDA_CHECK(cudaMemset(side.ptr, 0, size_t(64) * std::max(c.side_bytes, 16)));
  p.side = static_cast<const uint8_t*>(side.ptr);
  // One Params per set, encoded before timing.
  std::vector<Params> ps;
  for (const TileReadSet& s : sets) {
    Params q = p;
    const cuuint64_t dims[2] = {cuuint64_t(K), cuuint64_t(N)}, strides[1] = {cuuint64_t(K) * 2};
    const cuuint32_t box[2] = {64, cuuint32_t(c.rows)};
    bcuda::encode_tensor_map(&q.w, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, s.w, dims, strides, box,
                             CU_TENSOR_MAP_SWIZZLE_128B);
    for (int v = 0; v < c.variants; ++v) {
      const int KB256 = bcuda::sign_blocks(K);
      const cuuint64_t sd[3] = {128, cuuint64_t(KB256), cuuint64_t((N + 15) / 16)};
      const cuuint64_t ss[2] = {512, 512 * cuuint64_t(KB256)};
      const cuuint32_t sb[3] = {128, cuuint32_t(c.cols / 256), cuuint32_t(c.rows / 16)};
      bcuda::encode_tensor_map(&q.signs[v], CU_TENSOR_MAP_DATA_TYPE_UINT32, 3, s.signs.at(size_t(v)), sd, ss, sb,
                               CU_TENSOR_MAP_SWIZZLE_NONE);
    }
    ps.push_back(q);
  }
  BITDELTA_CUDA_CHECK(cudaFuncSetAttribute(tile_read_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int grid = std::min(p.units, grid_max);
  return time_us(
      [&](int rep) {
        tile_read_kernel<<<grid, 64, size_t(smem)>>>(ps[size_t(rep) % ps.size()]);
        BITDELTA_CUDA_CHECK(cudaGetLastError());
      },
      reps);
}

}  // namespace bitdelta::bench
