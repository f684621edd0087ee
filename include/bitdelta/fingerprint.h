// Cheap identity of a set of tensors: XXH3-128 over names, dtypes, shapes and up to three
// 4 KiB windows of each tensor's bytes (docs/FORMAT.md defines it byte for byte).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "bitdelta/checkpoint.h"
#include "bitdelta/tensor.h"

namespace bitdelta {

inline constexpr size_t kFingerprintWindow = 4096;

// The tensors may come in any order; they are hashed in sorted name order. Returns 32 hex digits.
std::string fingerprint(std::vector<std::pair<std::string, TensorView>> tensors);
// The fingerprint of every tensor of a checkpoint (all shards).
std::string fingerprint(const Checkpoint& checkpoint);

}  // namespace bitdelta
