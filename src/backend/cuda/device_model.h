// The model on a CUDA device (issue 6): the base's weights uploaded once, each variant's delta in
// device memory (built from a pinned host copy that stays cached under its own byte budget), per-
// sequence KV caches in device memory, and one forward step over rows of many sequences and
// variants. Plain C++ so that the CPU side (model.cpp) can hold it; without a CUDA build every entry
// point fails with one line saying so (device_model_none.cpp).
//
// Numerics, against the CPU backend (float32 throughout): linear layers take bf16 activations (the
// input of every linear is rounded to bf16, ≤ 2⁻⁹ relative) and accumulate in float32 on the tensor
// cores; the KV cache holds bf16; norms, RoPE, softmax and the residual stream stay float32. Weights
// that are not bf16 are converted to bf16 on upload. When a step has 48 or more rows of one variant
// (a prefill), they run on W_eff rounded to bf16 chunk by chunk (bench/cuda/NOTES.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "bitdelta/model.h"

namespace bitdelta::cuda {

// "" when a CUDA device can be used; otherwise why not (a build without CUDA, no device, ...).
std::string unavailable_reason();

struct DeviceOptions {
  int device = 0;                                // CUDA device ordinal
  uint64_t host_cache_bytes = uint64_t(16) << 30;  // pinned host copies of deltas kept for reloads
  bool graphs = true;  // decode steps replayed as CUDA graphs when the same batch comes again
};

// A variant's tensors on the device (its delta's signs, α and whole tensors; its norms and biases).
class DeviceVariant;
// A sequence's KV cache on the device; freed when the last reference goes.
class DeviceKV;

struct DeviceRow {
  std::shared_ptr<DeviceKV>* kv;  // the sequence's cache (created or grown here)
  int variant;                    // model variant id (0: the base)
  int32_t token;
  size_t position;
  bool want_logits;
};

// Decode steps captured as CUDA graphs and steps replayed from one.
struct GraphStats {
  uint64_t captured = 0, replayed = 0;
};

struct DeviceMemory {
  uint64_t base_bytes = 0;      // the base's weights on the device
  uint64_t variant_bytes = 0;   // all uploaded variants' delta tensors
  uint64_t device_used = 0, device_total = 0;  // cudaMemGetInfo
};

class DeviceModel {
 public:
  // Uploads the base (variant 0 of the CPU model: `base` holds its views and float32 norms; it must
  // outlive this object).
  DeviceModel(const ModelConfig& config, const VariantWeights& base, std::span<const float> inv_freq,
              const DeviceOptions& options);
  ~DeviceModel();
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;

  // Builds a variant's device tensors on a stream of its own, while other steps run: from the
  // pinned host copy of `delta` if one is cached, else from the file (which then joins the host
  // tier). Thread-safe; `weights` is the variant as the CPU model resolved it.
  std::shared_ptr<DeviceVariant> upload(const VariantWeights& weights, const DeltaFile& delta,
                                        UploadStats* stats = nullptr) const;
  // Makes an uploaded variant usable under `id` (engine thread); remove drops it.
  void install(int id, std::shared_ptr<DeviceVariant> variant);
  void remove(int id);

  // One step; logits of the rows with want_logits, in row order, [count, vocab]. A step of decode
  // rows (no prompt run) whose batch has the same launches as the step before (the same rows'
  // variants in the same order, the same attention split, the same step buffers) is captured as a
  // CUDA graph, and later steps with those launches replay it: the positions and tokens are in the
  // row descriptors, which every step copies in before its launches.
  std::vector<float> forward(std::span<const DeviceRow> rows);
  // A copy of a sequence's cache, made on the device's stream after the steps before it: the
  // cache of a sequence that continues from another's prompt (Model::fork_sequence). Only its
  // first `length` positions are copied (the copy has the same capacity).
  std::shared_ptr<DeviceKV> clone_kv(const DeviceKV& kv, size_t length) const;
  uint64_t kv_bytes(const DeviceKV& kv) const;  // the device memory the cache holds
  GraphStats graph_stats() const;

  DeviceMemory memory() const;
  std::string device_name() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bitdelta::cuda
