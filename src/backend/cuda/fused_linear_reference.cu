#include "fused_linear_reference.cuh"

#include "cuda_check.cuh"

namespace bitdelta::cuda {
namespace {

struct RefDeltas {
  const uint8_t* signs[16];
  const float* alpha[16];
  int per_row[16];
};

__global__ void reference_kernel(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x,
                                 int rows, RefDeltas d, float* y) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
  if (n >= N || r >= rows) return;
  const size_t row_bytes = (size_t(K) + 7) / 8;
  const uint8_t* signs = d.signs[r];
  const float a = signs ? d.alpha[r][d.per_row[r] ? n : 0] : 0.0f;
  double acc = 0.0;
  for (int k = 0; k < K; ++k) {
    float weff = __bfloat162float(w[size_t(n) * K + k]);
    if (signs) weff += (signs[n * row_bytes + k / 8] >> (k % 8)) & 1 ? a : -a;
    acc += double(weff) * double(__bfloat162float(x[size_t(r) * K + k]));
  }
  y[size_t(r) * N + n] = float(acc);
}

}  // namespace

void fused_linear_reference(const __nv_bfloat16* w, int N, int K, const __nv_bfloat16* x, int rows,
                            std::span<const DeltaRef> deltas, float* y, cudaStream_t stream) {
  if (rows < 1 || rows > 16 || int(deltas.size()) != rows)
    fail("cuda::fused_linear_reference: 1..16 rows, one delta each");
  RefDeltas d{};
  for (int r = 0; r < rows; ++r) {
    d.signs[r] = deltas[r].signs;
    d.alpha[r] = deltas[r].alpha;
    d.per_row[r] = deltas[r].alpha_per_row;
  }
  reference_kernel<<<dim3((N + 127) / 128, rows), 128, 0, stream>>>(w, N, K, x, rows, d, y);
  BITDELTA_CUDA_CHECK_LAUNCH();
}

}  // namespace bitdelta::cuda
