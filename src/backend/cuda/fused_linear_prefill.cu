#include "fused_linear_prefill.cuh"

#include <algorithm>
#include <cstdint>

#include "cuda_check.cuh"
#include "fused_linear_decode.cuh"

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

void PrefillLinear::run(PrefillMethod method, const __nv_bfloat16* w, int N, int K,
                        const __nv_bfloat16* x, int rows, const DeltaRef& delta, float* y,
                        int chunk_rows, int expand_blocks) {
  if (N < 1 || K < 1 || rows < 1) fail("cuda::PrefillLinear: empty shape");
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
      break;
  }
}

}  // namespace bitdelta::cuda
