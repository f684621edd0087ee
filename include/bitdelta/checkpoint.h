// Hugging Face checkpoint directories: config.json plus model.safetensors, or shards listed in
// model.safetensors.index.json. Shards are opened lazily, on first access to one of their tensors.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bitdelta/safetensors.h"

namespace bitdelta {

class Checkpoint {
 public:
  // Throws Error if `dir` is not a checkpoint directory (naming what is missing).
  explicit Checkpoint(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return dir_; }
  const nlohmann::json& config() const { return config_; }
  std::string architecture() const;  // config.architectures[0], or "" if absent

  const std::vector<std::string>& tensor_names() const { return names_; }  // sorted
  bool contains(const std::string& name) const { return shard_of_.count(name) > 0; }
  // The shard file holding `name` (opened on first use); throws if the tensor is missing.
  const SafetensorsFile& file_of(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;
  TensorView tensor(const std::string& name) const;

  std::vector<std::string> shard_names() const;  // file names, in sorted order
  const SafetensorsFile& shard(const std::string& file_name) const;
  uint64_t total_tensor_bytes() const;

 private:
  std::filesystem::path dir_;
  nlohmann::json config_;
  std::map<std::string, std::string> shard_of_;  // tensor name -> shard file name
  std::vector<std::string> names_;
  mutable std::mutex mutex_;
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> shards_;
};

// Reads a JSON file of a checkpoint (config.json, generation_config.json, ...); throws Error naming
// the file when it cannot be opened or parsed.
nlohmann::json read_json_file(const std::filesystem::path& path);

// True if `dir` looks like a checkpoint directory (has config.json and safetensors weights).
bool is_checkpoint_dir(const std::filesystem::path& dir);

}  // namespace bitdelta
