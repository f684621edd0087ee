#include "bitdelta/checkpoint.h"

#include <algorithm>
#include <fstream>

#include "bitdelta/error.h"

namespace bitdelta {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

}  // namespace

json read_json_file(const fs::path& path) {
  std::ifstream in(path);
  if (!in) fail(path.string(), ": cannot open");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail(path.string(), ": invalid JSON (", e.what(), ")");
  }
}

bool is_checkpoint_dir(const fs::path& dir) {
  std::error_code ec;
  return fs::is_directory(dir, ec) && fs::exists(dir / "config.json", ec) &&
         (fs::exists(dir / kSingleFile, ec) || fs::exists(dir / kIndexFile, ec));
}

Checkpoint::Checkpoint(const fs::path& dir) : dir_(dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail(dir.string(), ": not a directory (expected a Hugging Face checkpoint directory)");
  if (!fs::exists(dir / "config.json", ec))
    fail(dir.string(), ": not a Hugging Face checkpoint directory (no config.json)");
  config_ = read_json_file(dir / "config.json");
  if (!config_.is_object()) fail((dir / "config.json").string(), ": not a JSON object");

  if (fs::exists(dir / kIndexFile, ec)) {
    const json index = read_json_file(dir / kIndexFile);
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
      fail((dir / kIndexFile).string(), ": no weight_map object");
    for (const auto& [name, file] : index["weight_map"].items()) {
      if (!file.is_string()) fail((dir / kIndexFile).string(), ": weight_map entry '", name, "' is not a string");
      const std::string shard = file.get<std::string>();
      if (shard.find('/') != std::string::npos || shard == "." || shard == "..")
        fail((dir / kIndexFile).string(), ": shard name '", shard, "' must be a plain file name");
      if (!fs::exists(dir / shard, ec))
        fail((dir / kIndexFile).string(), ": tensor '", name, "' is in missing shard ", shard);
      shard_of_[name] = shard;
    }
  } else if (fs::exists(dir / kSingleFile, ec)) {
    const auto& file = shard(kSingleFile);
    for (const auto& t : file.tensors()) shard_of_[t.name] = kSingleFile;
  } else {
    fail(dir.string(), ": not a Hugging Face checkpoint directory (no ", kSingleFile, " or ", kIndexFile, ")");
  }
  for (const auto& [name, _] : shard_of_) names_.push_back(name);
}

std::string Checkpoint::architecture() const {
  if (config_.contains("architectures") && config_["architectures"].is_array() &&
      !config_["architectures"].empty() && config_["architectures"][0].is_string())
    return config_["architectures"][0].get<std::string>();
  return "";
}

const SafetensorsFile& Checkpoint::shard(const std::string& file_name) const {
  std::lock_guard lock(mutex_);
  auto& slot = shards_[file_name];
  if (!slot) slot = std::make_unique<SafetensorsFile>(dir_ / file_name);
  return *slot;
}

const SafetensorsFile& Checkpoint::file_of(const std::string& name) const {
  auto it = shard_of_.find(name);
  if (it == shard_of_.end()) fail(dir_.string(), ": no tensor '", name, "'");
  const auto& file = shard(it->second);
  if (!file.find(name))
    fail(file.path().string(), ": tensor '", name, "' is listed in the index but not in the shard");
  return file;
}

const TensorInfo& Checkpoint::info(const std::string& name) const { return file_of(name).info(name); }

TensorView Checkpoint::tensor(const std::string& name) const { return file_of(name).view(name); }

std::vector<std::string> Checkpoint::shard_names() const {
  std::vector<std::string> out;
  for (const auto& [_, file] : shard_of_)
    if (out.empty() || std::find(out.begin(), out.end(), file) == out.end()) out.push_back(file);
  std::sort(out.begin(), out.end());
  return out;
}

uint64_t Checkpoint::total_tensor_bytes() const {
  uint64_t total = 0;
  for (const auto& name : names_) total += info(name).bytes();
  return total;
}

}  // namespace bitdelta
