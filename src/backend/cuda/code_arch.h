// Which of the CUDA backend's code runs on the current device (host-side; defined in
// fused_linear_decode.cu). The build holds sm_90a and sm_80 machine code and compute_90 PTX
// (CMakeLists.txt): H100/H200 run the sm_90a code, 8.x GPUs the sm_80 code, and later GPUs
// (Blackwell, which cannot run sm_90a code) the PTX, compiled by the driver at first use.
#pragma once

namespace bitdelta::cuda {

// What the code loaded for the current device was compiled with, read from the attributes of a probe
// kernel built with the same -gencode targets as all the others (no launch):
struct LoadedCode {
  int ptx_version = 0;          // cudaFuncAttributes::ptxVersion: 90 (sm_90a code, compute_90 PTX) or 80
  bool sm90a = false;           // the sm_90a kernels' bodies (wgmma, TMA: tma.cuh), only in sm_90a code
  bool griddepcontrol = false;  // programmatic launch's instructions (launch.cuh): code for sm_90 and later
};
LoadedCode loaded_code();

// The decisions follow the loaded code, not the device's compute capability alone: a kernel compiled
// for sm_80, or from PTX without the sm_90a features, has no wgmma/TMA body and no griddepcontrol
// (a build with one PTX alone, or CUDA_FORCE_PTX_JIT=1, shows it on an H100/H200).
// Whether the sm_90a kernels (the streaming decode kernel, the fused prefill GEMM) run here: a
// compute-capability 9.0 device running the sm_90a code.
bool sm90a_kernels_run();

// Whether the current device runs programmatic dependent launch: sm_90 or later, running code that
// has its instructions (elsewhere every kernel starts after the one before).
bool dependent_launch_supported();

}  // namespace bitdelta::cuda
