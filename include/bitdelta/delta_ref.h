// What a kernel needs of one variant's delta of one weight [N, K].
#pragma once

#include <cstdint>

namespace bitdelta {

struct DeltaRef {
  const uint8_t* signs = nullptr;  // [N, ceil(K/8)], LSB first; nullptr: no delta
  const float* alpha = nullptr;    // [N] or [1]; may be unaligned inside a file: read with memcpy
  bool alpha_per_row = true;
};

}  // namespace bitdelta
