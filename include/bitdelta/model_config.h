// The hyper-parameters of a Llama-family model, read from a Hugging Face config.json.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace bitdelta {

struct RopeConfig {
  std::string type = "default";  // default | linear | llama3
  double theta = 10000.0;
  double factor = 1.0;                   // linear, llama3
  double low_freq_factor = 1.0;          // llama3
  double high_freq_factor = 4.0;         // llama3
  double original_max_position = 8192;   // llama3
};

struct ModelConfig {
  std::string architecture;  // LlamaForCausalLM | MistralForCausalLM | Qwen2ForCausalLM
  uint64_t vocab_size = 0, hidden = 0, intermediate = 0, layers = 0;
  uint64_t heads = 0, kv_heads = 0, head_dim = 0;
  uint64_t max_position = 0;
  double rms_eps = 1e-6;
  RopeConfig rope;
  bool tie_embeddings = false;
  bool qkv_bias = false;  // Qwen2, or Llama with attention_bias
  bool o_bias = false;    // Llama with attention_bias
  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;

  // Throws Error naming the field (and `source`, e.g. the config path) when something is
  // missing, malformed or unsupported.
  static ModelConfig from_json(const nlohmann::json& config, const std::string& source);
};

}  // namespace bitdelta
