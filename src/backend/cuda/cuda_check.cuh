// Error checks for CUDA and cuBLAS calls: every failure throws bitdelta::Error naming the call.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "bitdelta/error.h"

#define BITDELTA_CUDA_CHECK(call)                                                                  \
  do {                                                                                             \
    cudaError_t bitdelta_err_ = (call);                                                            \
    if (bitdelta_err_ != cudaSuccess)                                                              \
      ::bitdelta::fail(#call, " failed: ", cudaGetErrorString(bitdelta_err_), " (", __FILE__, ":", \
                       __LINE__, ")");                                                             \
  } while (0)

#define BITDELTA_CUBLAS_CHECK(call)                                                              \
  do {                                                                                           \
    cublasStatus_t bitdelta_st_ = (call);                                                        \
    if (bitdelta_st_ != CUBLAS_STATUS_SUCCESS)                                                   \
      ::bitdelta::fail(#call, " failed: cuBLAS status ", int(bitdelta_st_), " (", __FILE__, ":", \
                       __LINE__, ")");                                                           \
  } while (0)

// After a kernel launch: catches bad configurations at once (asynchronous faults surface later).
#define BITDELTA_CUDA_CHECK_LAUNCH() BITDELTA_CUDA_CHECK(cudaGetLastError())
