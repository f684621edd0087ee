// What a kernel needs of one variant's delta of one weight [N, K].
#pragma once

#include <cstdint>

namespace bitdelta {

struct DeltaRef {
  // [N, ceil(K/8)], LSB first (the file's layout); the CUDA kernels take the packed layout of
  // cuda::pack_signs here instead. nullptr: no delta.
  const uint8_t* signs = nullptr;
  const float* alpha = nullptr;    // [N] or [1]; may be unaligned inside a file: read with memcpy
  bool alpha_per_row = true;
  // The CPU kernels' layout of the same bits (cpu::pack_signs), which cpu::fused_linear reads;
  // required there whenever `signs` is set. The reference and the CUDA upload read `signs`.
  const uint32_t* packed = nullptr;
};

}  // namespace bitdelta
