// A Llama-family model on the CPU: the base loaded once (zero-copy views into its mmapped
// safetensors), any number of BitDelta variants on top of it, and a forward step over rows of many
// sequences of different variants.
#pragma once

#include <array>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "bitdelta/checkpoint.h"
#include "bitdelta/delta_ref.h"
#include "bitdelta/delta_file.h"
#include "bitdelta/model_config.h"
#include "bitdelta/thread_pool.h"

namespace bitdelta {

namespace cuda {
class DeviceModel;
class DeviceVariant;
class DeviceKV;
}  // namespace cuda

enum LinearKind { kQ, kK, kV, kO, kGate, kUp, kDown, kLinearCount };

// One weight table entry: where a tensor is, and what it must look like.
struct WeightSpec {
  std::string name;
  Shape shape;
};
// The declarative table of every tensor a config needs (per layer and global).
std::vector<WeightSpec> weight_table(const ModelConfig& config);

// Everything one variant computes with. The base is variant 0; a variant shares every tensor view
// with the base except what its delta replaces, and adds sign bits + α per compressed linear.
struct VariantWeights {
  std::string name;
  std::shared_ptr<const DeltaFile> delta;  // null for the base
  TensorView embed, lm_head;
  std::vector<float> final_norm;
  struct Layer {
    std::vector<float> attn_norm, mlp_norm;
    std::array<TensorView, kLinearCount> linear;
    std::array<DeltaRef, kLinearCount> delta;     // signs == nullptr: none
    std::array<std::vector<float>, kLinearCount> bias;  // empty: none
  };
  std::vector<Layer> layers;
  std::vector<std::shared_ptr<const uint32_t[]>> packed_signs;  // CPU: what the layers' delta.packed point into
};

// The keys and values of one sequence, all layers.
struct Sequence {
  int variant = 0;
  size_t length = 0;                          // tokens already in the cache
  std::vector<std::vector<float>> keys, values;  // CPU: per layer [position][kv_heads * head_dim]
  std::shared_ptr<cuda::DeviceKV> device_kv;     // CUDA: the cache in device memory
};

enum class Device { Cpu, Cuda };

struct ModelOptions {
  size_t threads = 0;                              // CPU worker threads (0: all cores)
  Device device = Device::Cpu;
  int cuda_device = 0;                             // CUDA device ordinal
  uint64_t host_cache_bytes = uint64_t(16) << 30;  // CUDA: pinned host copies of deltas kept for reloads
  bool cuda_graphs = true;  // CUDA: decode steps replayed as graphs when a batch stays (cuda::DeviceModel)
};
// The options for `--device TEXT` ("cpu", "cuda" or "cuda:N"); throws Error naming TEXT otherwise.
ModelOptions model_options(const std::string& device, size_t threads = 0,
                           uint64_t host_cache_bytes = ModelOptions{}.host_cache_bytes, bool cuda_graphs = true);

// What a variant's upload to a device did: its bytes there, whether the pinned host copy was
// cached (no file read), and the time to build that copy (plan, pin, read the file: 0 work on a
// hit) and to copy it to the device. Within read_s, page_s is the file's paging-in, front to back,
// and pin_s the pinning of the buffer's pages, on their own thread beside it.
struct UploadStats {
  uint64_t bytes = 0;
  bool host_hit = false;
  double read_s = 0, copy_s = 0, page_s = 0, pin_s = 0;
};

// A variant made ready off the engine thread (prepare_variant): its weights resolved against the
// base and, on a device, its tensors uploaded. install_variant then makes it usable at once.
struct PreparedVariant {
  std::unique_ptr<VariantWeights> weights;
  std::shared_ptr<cuda::DeviceVariant> device;
  UploadStats upload;  // on a device
};

struct ForwardRow {
  Sequence* sequence;
  int32_t token;
  bool want_logits;
};

class Model {
 public:
  explicit Model(const std::filesystem::path& checkpoint_dir, size_t threads = 0);
  Model(const std::filesystem::path& checkpoint_dir, const ModelOptions& options);
  ~Model();

  const ModelConfig& config() const { return config_; }
  const Checkpoint& checkpoint() const { return base_; }
  const std::string& fingerprint() const { return fingerprint_; }
  ThreadPool& pool() const { return *pool_; }
  Device device() const { return device_ ? Device::Cuda : Device::Cpu; }
  cuda::DeviceModel* device_model() const { return device_.get(); }  // null on the CPU

  // Adds a variant from a delta file made against this base (refused, naming both fingerprints,
  // when made for another base unless `force`). Returns its id; the base is 0. The base is never
  // copied.
  int add_variant(const std::string& name, const std::filesystem::path& delta_path, bool force = false);
  int add_variant(const std::string& name, std::shared_ptr<const DeltaFile> delta, bool force = false);
  // add_variant in two halves: prepare (thread-safe, may take long: validation, device upload) and
  // install (cheap; the thread that runs forward).
  std::unique_ptr<PreparedVariant> prepare_variant(const std::string& name, std::shared_ptr<const DeltaFile> delta,
                                                   bool force = false) const;
  int install_variant(std::unique_ptr<PreparedVariant> prepared);
  // Drops a variant (its delta file is unmapped when nothing else holds it). Sequences of it must
  // be finished first. The id is not reused.
  void remove_variant(int id);
  int find_variant(const std::string& name) const;  // -1 if absent
  size_t variant_count() const { return variants_.size(); }
  const VariantWeights& variant(int id) const;

  Sequence new_sequence(int variant) const;
  // A copy of a sequence's first `length` positions (all of them by default: its keys and values
  // so far, on the device where they live) that then continues on its own: sequences of one prompt
  // prefill it once, and a prompt that begins like an earlier one starts from its cache.
  Sequence fork_sequence(const Sequence& sequence, size_t length = SIZE_MAX) const;
  // The memory a sequence's cache holds (CPU: float32 vectors; CUDA: its device buffer).
  uint64_t sequence_bytes(const Sequence& sequence) const;

  // One step over rows of many sequences: each row appends its token at the next position of its
  // sequence (rows of one sequence in order). Returns the logits of the rows with want_logits,
  // in order, [count, vocab_size].
  std::vector<float> forward(std::span<const ForwardRow> rows);

 private:
  ModelConfig config_;
  Checkpoint base_;
  std::string fingerprint_;
  std::unique_ptr<ThreadPool> pool_;
  std::vector<std::unique_ptr<VariantWeights>> variants_;
  const VariantWeights* base_weights_ = nullptr;  // variants_[0], read by prepare_variant on other threads
  std::vector<float> inv_freq_;  // rotary frequencies, head_dim / 2
  std::unique_ptr<cuda::DeviceModel> device_;  // set with Device::Cuda: forward runs there
};

}  // namespace bitdelta
