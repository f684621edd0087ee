// Materializes a variant: base + delta -> a complete Hugging Face checkpoint directory, so a
// variant can be exported to any other engine. (The engine itself never materializes W_eff.)
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>

#include "bitdelta/checkpoint.h"
#include "bitdelta/delta_file.h"

namespace bitdelta {

struct ApplyOptions {
  bool force = false;  // apply even if the delta was made for a base with another fingerprint
  size_t threads = 0;
  std::function<void(size_t done, size_t total)> on_progress;  // tensors written
};

// Refuses (throws) a delta whose base_fingerprint differs from the base's unless options.force.
// Writes to a temp directory beside out_dir and renames it into place when complete; out_dir
// must not exist or be an empty directory.
void apply_delta(const Checkpoint& base, const DeltaFile& delta, const std::filesystem::path& out_dir,
                 const ApplyOptions& options = {});

// W_eff rows [row_begin, row_end) of one compressed weight, in the base's dtype:
// round(float32(W_base) + α[r]·(bit ? +1 : −1)). dst holds (row_end − row_begin) rows.
void reconstruct_rows(const TensorView& base, const CompressedWeight& w, uint64_t row_begin, uint64_t row_end,
                      std::byte* dst);

}  // namespace bitdelta
