// Which of the CUDA backend's code runs on the current device (host-side; defined in
// fused_linear_decode.cu). The build holds sm_90a and sm_80 machine code and compute_80 PTX
// (CMakeLists.txt).
#pragma once

namespace bitdelta::cuda {

// The architecture the code loaded for the current device was compiled for: the PTX version of its
// kernels (cudaFuncGetAttributes' ptxVersion of a probe kernel built with the same -gencode targets as
// all the others): 90 where the sm_90a binary code runs (H100, H200); 80 where the sm_80 code runs
// (Ampere and Ada) or the driver compiled the compute_80 PTX (newer GPUs, Blackwell included, which
// cannot run sm_90a code; a build with the PTX alone; any GPU under CUDA_FORCE_PTX_JIT=1). The
// decisions below follow it, not the device's compute capability alone: kernels compiled from
// compute_80 have no griddepcontrol and no wgmma/TMA bodies.
int loaded_code_arch();

// Whether the sm_90a kernels (the streaming decode kernel, the fused prefill GEMM) run here: a
// compute-capability 9.0 device running the sm_90a code.
bool sm90a_kernels_run();

// Whether the current device runs programmatic dependent launch: sm_90+ running code compiled for it
// (elsewhere every kernel starts after the one before).
bool dependent_launch_supported();

}  // namespace bitdelta::cuda
