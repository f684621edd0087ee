// Attention of decode rows over the KV cache on a CUDA device (issue 6): the tensor-core kernel
// (head_dim 64 and 128; backend/cuda/ops.cu), against the byte roofline, for several positions per
// block.
//   bench_gpu_attention [--quick | --case HEADS KV_HEADS HEAD_DIM ROWS POSITIONS]
// (--case: that one case alone, e.g. for a profiler.)
// Every row of a case is at the same position n − 1 of its own sequence's cache. Bytes = each row's
// keys and values once (rows × n × kv_dim × 2 × 2 B); with grouped-query heads the q heads of one kv
// head re-read it (from L2 if it stays there). The roofline is that over the device-to-device copy
// bandwidth (read + write) measured in the same run. Each timed call reads the next of several
// layers, so that a case's bytes do not sit in L2 between calls (as in a decode step). Forms: the
// positions per block the engine chooses (auto), and fixed 128 (one 32-position chunk per warp: the
// form before part 9), 256, 512 and the whole row (one block per row and head); with grouped-query
// heads also one q head per block ("auto, 1 head") and as many of a kv head as fit ("auto, grouped":
// up to 8); auto takes one of the two.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/ops.cuh"
#include "bitdelta/error.h"
#include "cuda/common.h"

using namespace bitdelta;

using bench::DeviceMem;

int main(int argc, char** argv) {
  try {
    const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
    const bool one_case = argc > 1 && std::strcmp(argv[1], "--case") == 0;
    if (one_case && argc != 7) fail("bench_gpu_attention: --case takes HEADS KV_HEADS HEAD_DIM ROWS POSITIONS");
    const auto arg = [&](int i) {
      const int v = std::atoi(argv[i]);
      if (v < 1) fail("bench_gpu_attention: --case: '", argv[i], "' is not a positive integer");
      return v;
    };
    cudaDeviceProp prop{};
    BITDELTA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
    const double copy_bw = bench::copy_bandwidth();
    std::printf("device-to-device copy of 2 GiB: %.0f GB/s, read + written (the roofline below)\n\n", copy_bw / 1e9);
    std::printf("%-18s %5s %6s %-12s %8s %9s %8s %7s\n", "heads/kv/dim", "rows", "n", "per block", "time_us", "MB",
                "GB/s", "roof/t");
    struct Config {
      int heads, kv_heads, head_dim;
    };
    std::vector<Config> configs = quick ? std::vector<Config>{{32, 32, 128}}
                                        : std::vector<Config>{{32, 32, 128}, {32, 8, 128}};
    std::vector<int> row_counts = quick ? std::vector<int>{1, 32} : std::vector<int>{1, 8, 32, 64};
    std::vector<int> lengths = quick ? std::vector<int>{520} : std::vector<int>{520, 2048, 8192};
    if (one_case) configs = {{arg(2), arg(3), arg(4)}}, row_counts = {arg(5)}, lengths = {arg(6)};
    for (const Config& cf : configs) {
      const int kv_dim = cf.kv_heads * cf.head_dim, q_dim = cf.heads * cf.head_dim;
      for (const int n : lengths) {
        for (const int rows : row_counts) {
          const double bytes = double(rows) * n * kv_dim * 2 * 2;
          // Layers to cycle through: at least 4× L2 of keys and values over them, at most 8.
          const int layers = int(std::clamp(4.0 * prop.l2CacheSize / bytes + 1, 1.0, 8.0));
          const size_t per_seq = size_t(layers) * 2 * size_t(n) * kv_dim * 2;  // bf16, capacity n
          DeviceMem kv(per_seq * size_t(rows)), q(size_t(rows) * q_dim * 4), out(size_t(rows) * q_dim * 2);
          BITDELTA_CUDA_CHECK(cudaMemset(kv.ptr, 0x3c, per_seq * size_t(rows)));  // bf16 0x3c3c ≈ 0.0115
          BITDELTA_CUDA_CHECK(cudaMemset(q.ptr, 0, size_t(rows) * q_dim * 4));
          std::vector<cuda::RowDesc> desc(static_cast<size_t>(rows));
          std::vector<int2> tiles(static_cast<size_t>(rows));
          for (int r = 0; r < rows; ++r) {
            desc[size_t(r)] = {0, n - 1, n, reinterpret_cast<__nv_bfloat16*>(static_cast<char*>(kv.ptr) + size_t(r) * per_seq),
                               nullptr, nullptr, nullptr};
            tiles[size_t(r)] = make_int2(r, 1);
          }
          DeviceMem ddesc(desc.size() * sizeof(cuda::RowDesc)), dtiles(tiles.size() * sizeof(int2));
          BITDELTA_CUDA_CHECK(cudaMemcpy(ddesc.ptr, desc.data(), desc.size() * sizeof(cuda::RowDesc), cudaMemcpyHostToDevice));
          BITDELTA_CUDA_CHECK(cudaMemcpy(dtiles.ptr, tiles.data(), tiles.size() * sizeof(int2), cudaMemcpyHostToDevice));
          const float scale = 1.0f / std::sqrt(float(cf.head_dim));
          struct Form {
            std::string name;
            int split_len, split_heads;
          };
          std::vector<Form> forms = {{"auto", 0, 0}, {"128", 128, 0}, {"256", 256, 0}, {"512", 512, 0}, {"whole", n, 0}};
          if (cf.heads != cf.kv_heads) {
            forms.push_back({"auto, 1 head", 0, 1});
            forms.push_back({"auto, grouped", 0, 8});
          }
          const auto launch = [&](int rep, int split_len, int split_heads) {
            cuda::attention(static_cast<const float*>(q.ptr), q_dim, static_cast<const cuda::RowDesc*>(ddesc.ptr),
                            static_cast<const int2*>(dtiles.ptr), rows, 1, n - 1, rep % layers, cf.heads, cf.kv_heads,
                            cf.head_dim, scale, static_cast<__nv_bfloat16*>(out.ptr), nullptr, split_len, split_heads);
          };
          // The engine's choice launched for 30 ms before any form is timed: the host has just allocated
          // and filled this case's buffers, and the first form timed after that came out 2 µs slower
          // than the same launch timed later (runs 240-241: 29.2 against 27.4 µs at 32 rows × 520
          // positions of 32/8/128; two untimed passes over the layers did not remove it).
          const auto warm_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(30);
          for (int rep = 0; std::chrono::steady_clock::now() < warm_until; ++rep) {
            launch(rep, 0, 0);
            if (rep % 16 == 15) BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
          }
          BITDELTA_CUDA_CHECK(cudaDeviceSynchronize());
          for (const auto& [name, split_len, split_heads] : forms) {
            if (split_len > n && name != "whole") continue;
            const double t = bench::time_us([&](int rep) { launch(rep, split_len, split_heads); }, quick ? 20 : 40);
            char shape[32];
            std::snprintf(shape, sizeof shape, "%d/%d/%d", cf.heads, cf.kv_heads, cf.head_dim);
            std::printf("%-18s %5d %6d %-12s %8.2f %9.1f %8.0f %7.3f\n", shape, rows, n, name.c_str(), t, bytes / 1e6,
                        bytes / (t * 1e-6) / 1e9, bytes / copy_bw / (t * 1e-6));
          }
        }
      }
    }
    std::printf(
        "\ncolumns: n = positions attended (the row's position + 1); per block = positions per thread block "
        "(auto: the engine's choice); time = median µs; MB = keys and values read once; roof/t = (MB / copy "
        "bandwidth) / time\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu_attention: %s\n", e.what());
    return 1;
  }
}
