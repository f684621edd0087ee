// Helpers for tests: temporary directories, deterministic random tensors, tiny checkpoints.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "bitdelta/dtype.h"
#include "bitdelta/safetensors.h"

namespace bitdelta::test {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "bitdelta-test-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) std::abort();
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

// A tensor held in memory by tests: dtype, shape and raw little-endian bytes.
struct HostTensor {
  DType dtype = DType::F32;
  Shape shape;
  std::vector<std::byte> bytes;

  static HostTensor from_floats(DType dtype, Shape shape, const std::vector<float>& values) {
    HostTensor t{dtype, std::move(shape), std::vector<std::byte>(values.size() * dtype_size(dtype))};
    from_f32(dtype, values.data(), t.bytes.data(), values.size());
    return t;
  }
  std::vector<float> floats() const {
    std::vector<float> v(numel(shape));
    to_f32(dtype, bytes.data(), v.data(), v.size());
    return v;
  }
};

using TensorMap = std::map<std::string, HostTensor>;

inline std::vector<float> random_floats(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

inline void write_safetensors(const fs::path& path, const TensorMap& tensors, const Metadata& md = {}) {
  SafetensorsWriter w(path, md);
  for (const auto& [name, t] : tensors) w.add(name, t.dtype, t.shape);
  w.begin();
  for (const auto& [name, t] : tensors) w.write(t.bytes);
  w.finish();
}

inline void write_text(const fs::path& path, const std::string& text) {
  std::ofstream(path) << text;
}

// A checkpoint directory; with shards > 1 the tensors are spread round-robin over shard files
// listed in model.safetensors.index.json.
inline void write_checkpoint(const fs::path& dir, const TensorMap& tensors, int shards = 1) {
  fs::create_directories(dir);
  write_text(dir / "config.json", R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})");
  write_text(dir / "tokenizer_config.json", R"({"bos_token": "<s>"})");
  if (shards == 1) {
    write_safetensors(dir / "model.safetensors", tensors, {{"format", "pt"}});
    return;
  }
  std::vector<TensorMap> parts(static_cast<size_t>(shards));
  std::string index = R"({"metadata": {}, "weight_map": {)";
  int i = 0;
  for (const auto& [name, t] : tensors) {
    const int s = i++ % shards;
    parts[size_t(s)][name] = t;
    char file[64];
    std::snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", s + 1, shards);
    index += (i > 1 ? ", \"" : "\"") + name + "\": \"" + file + "\"";
  }
  index += "}}";
  write_text(dir / "model.safetensors.index.json", index);
  for (int s = 0; s < shards; ++s) {
    char file[64];
    std::snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", s + 1, shards);
    write_safetensors(dir / file, parts[size_t(s)], {{"format", "pt"}});
  }
}

// A tiny Llama-shaped model with awkward sizes (in = 13 and 21 are not multiples of 8).
inline TensorMap tiny_llama(DType dtype, uint64_t seed, int layers = 2, uint64_t hidden = 13,
                            uint64_t inter = 21, uint64_t vocab = 17) {
  TensorMap m;
  uint64_t s = seed;
  auto add = [&](const std::string& name, Shape shape, float scale) {
    m[name] = HostTensor::from_floats(dtype, shape, random_floats(numel(shape), s++, scale));
  };
  add("model.embed_tokens.weight", {vocab, hidden}, 1.0f);
  for (int l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char* n : {"q_proj", "k_proj", "v_proj", "o_proj"}) add(p + "self_attn." + n + ".weight", {hidden, hidden}, 0.1f);
    add(p + "mlp.gate_proj.weight", {inter, hidden}, 0.1f);
    add(p + "mlp.up_proj.weight", {inter, hidden}, 0.1f);
    add(p + "mlp.down_proj.weight", {hidden, inter}, 0.1f);
    add(p + "input_layernorm.weight", {hidden}, 1.0f);
    add(p + "post_attention_layernorm.weight", {hidden}, 1.0f);
  }
  add("model.norm.weight", {hidden}, 1.0f);
  add("lm_head.weight", {vocab, hidden}, 1.0f);
  return m;
}

// A fine-tune of `base`: small noise on every block linear (with some entries left equal, so
// Δ = 0 occurs), a changed final norm, everything else identical.
inline TensorMap fine_tune_of(const TensorMap& base, uint64_t seed) {
  TensorMap ft = base;
  uint64_t s = seed;
  for (auto& [name, t] : ft) {
    const bool linear = t.shape.size() == 2 && name.find(".layers.") != std::string::npos;
    if (!linear && name != "model.norm.weight") continue;
    auto v = t.floats();
    const auto noise = random_floats(v.size(), s++, 0.01f);
    for (size_t i = 0; i < v.size(); ++i)
      if (i % 7 != 3) v[i] += noise[i];
    t = HostTensor::from_floats(t.dtype, t.shape, v);
  }
  return ft;
}

struct CommandResult {
  int exit_code;
  std::string out, err;
};

inline std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

inline CommandResult run_cli(const std::string& args, const fs::path& scratch) {
  const auto out = scratch / "cli.out", err = scratch / "cli.err";
  // BITDELTA_CLI_PATH overrides the build's path (binaries run from another directory, e.g. on the
  // GPU machine).
  const char* cli = std::getenv("BITDELTA_CLI_PATH");
  const std::string cmd = std::string(cli ? cli : BITDELTA_CLI) + " " + args + " >" + out.string() + " 2>" + err.string();
  const int status = std::system(cmd.c_str());
  CommandResult r{WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_file(out), read_file(err)};
  fs::remove(out);
  fs::remove(err);
  return r;
}

}  // namespace bitdelta::test
