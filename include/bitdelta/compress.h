// The BitDelta compressor: fine-tune + base -> delta file (docs/FORMAT.md), streaming tensor by
// tensor so peak memory stays a small multiple of the largest tensor's rows in flight.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "bitdelta/checkpoint.h"
#include "bitdelta/delta_file.h"

namespace bitdelta {

// The rule for which weights get 1-bit compression: 2-D floating weights named
// "...(layers|layer|h|blocks).<i>.<...>.weight", i.e. the linear layers inside transformer blocks
// (attention q/k/v/o, MLP gate/up/down, whatever the architecture calls them).
bool is_block_linear(const std::string& name, const TensorInfo& info);

struct CompressProgress {
  size_t tensors_done = 0, tensors_total = 0;
  uint64_t bytes_done = 0, bytes_total = 0;  // input bytes (base + fine-tune) processed
};

struct CompressOptions {
  AlphaMode alpha_mode = AlphaMode::Row;
  size_t threads = 0;  // 0: all hardware threads
  std::string created_by = "bitdelta";
  std::function<void(const CompressProgress&)> on_progress;  // called from the calling thread
};

struct TensorError {
  std::string name;
  Shape shape;
  double rel_error;  // ||Δ − α·S|| / ||Δ|| (0 when Δ = 0)
};

struct CompressReport {
  uint64_t base_bytes = 0, finetuned_bytes = 0, output_bytes = 0;
  size_t compressed = 0, whole = 0, omitted = 0;
  std::vector<TensorError> errors;  // one per compressed weight, in name order
  double seconds = 0;
};

CompressReport compress(const Checkpoint& base, const Checkpoint& finetuned, const std::filesystem::path& out,
                        const CompressOptions& options = {});

}  // namespace bitdelta
