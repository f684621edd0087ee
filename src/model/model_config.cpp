#include "bitdelta/model_config.h"

#include "bitdelta/error.h"

namespace bitdelta {

using nlohmann::json;

namespace {

struct Reader {
  const json& j;
  const std::string& source;

  bool has(const char* key) const { return j.contains(key) && !j[key].is_null(); }

  uint64_t positive(const char* key) const {
    if (!has(key)) fail(source, ": missing field '", key, "'");
    if (!j[key].is_number_integer() || j[key].get<int64_t>() <= 0)
      fail(source, ": field '", key, "' must be a positive integer, got ", j[key].dump());
    return j[key].get<uint64_t>();
  }
  uint64_t positive_or(const char* key, uint64_t fallback) const { return has(key) ? positive(key) : fallback; }

  double number_or(const json& obj, const char* key, double fallback) const {
    if (!obj.contains(key) || obj[key].is_null()) return fallback;
    if (!obj[key].is_number()) fail(source, ": field '", key, "' must be a number, got ", obj[key].dump());
    return obj[key].get<double>();
  }
};

RopeConfig read_rope(const Reader& r) {
  RopeConfig rope;
  rope.theta = r.number_or(r.j, "rope_theta", 10000.0);
  // Newer configs put everything under rope_parameters; older ones use rope_theta + rope_scaling.
  const json* params = nullptr;
  if (r.has("rope_parameters")) params = &r.j["rope_parameters"];
  else if (r.has("rope_scaling")) params = &r.j["rope_scaling"];
  if (!params) return rope;
  if (!params->is_object()) fail(r.source, ": rope parameters must be an object, got ", params->dump());
  const json& p = *params;
  rope.theta = r.number_or(p, "rope_theta", rope.theta);
  std::string type = "default";
  for (const char* key : {"rope_type", "type"})
    if (p.contains(key) && p[key].is_string()) {
      type = p[key].get<std::string>();
      break;
    }
  if (type != "default" && type != "linear" && type != "llama3")
    fail(r.source, ": unsupported rope type '", type, "' (supported: default, linear, llama3)");
  rope.type = type;
  rope.factor = r.number_or(p, "factor", 1.0);
  rope.low_freq_factor = r.number_or(p, "low_freq_factor", 1.0);
  rope.high_freq_factor = r.number_or(p, "high_freq_factor", 4.0);
  rope.original_max_position = r.number_or(p, "original_max_position_embeddings", 8192);
  if (rope.factor <= 0) fail(r.source, ": rope factor must be positive");
  if (type == "llama3" && rope.high_freq_factor <= rope.low_freq_factor)
    fail(r.source, ": llama3 rope needs high_freq_factor > low_freq_factor");
  return rope;
}

std::vector<int64_t> ids_of(const json& v, const std::string& source, const char* key) {
  std::vector<int64_t> out;
  if (v.is_number_integer()) {
    out.push_back(v.get<int64_t>());
  } else if (v.is_array()) {
    for (const auto& e : v) {
      if (!e.is_number_integer()) fail(source, ": field '", key, "' must hold integers");
      out.push_back(e.get<int64_t>());
    }
  } else if (!v.is_null()) {
    fail(source, ": field '", key, "' must be an integer or a list of integers");
  }
  return out;
}

}  // namespace

ModelConfig ModelConfig::from_json(const json& j, const std::string& source) {
  if (!j.is_object()) fail(source, ": config is not a JSON object");
  const Reader r{j, source};
  ModelConfig c;
  if (!r.has("architectures") || !j["architectures"].is_array() || j["architectures"].empty() ||
      !j["architectures"][0].is_string())
    fail(source, ": missing field 'architectures'");
  c.architecture = j["architectures"][0].get<std::string>();
  if (c.architecture != "LlamaForCausalLM" && c.architecture != "MistralForCausalLM" &&
      c.architecture != "Qwen2ForCausalLM")
    fail(source, ": unsupported architecture '", c.architecture,
         "' (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)");
  c.vocab_size = r.positive("vocab_size");
  c.hidden = r.positive("hidden_size");
  c.intermediate = r.positive("intermediate_size");
  c.layers = r.positive("num_hidden_layers");
  c.heads = r.positive("num_attention_heads");
  c.kv_heads = r.positive_or("num_key_value_heads", c.heads);
  c.head_dim = r.positive_or("head_dim", c.hidden / c.heads);
  c.max_position = r.positive_or("max_position_embeddings", 2048);
  if (c.heads % c.kv_heads != 0)
    fail(source, ": num_attention_heads (", c.heads, ") is not a multiple of num_key_value_heads (", c.kv_heads, ")");
  if (c.head_dim % 2 != 0) fail(source, ": head_dim (", c.head_dim, ") must be even for rotary embeddings");
  c.rms_eps = r.number_or(j, "rms_norm_eps", 1e-6);
  c.rope = read_rope(r);
  c.tie_embeddings = j.value("tie_word_embeddings", false);
  if (r.has("hidden_act") && j["hidden_act"] != "silu")
    fail(source, ": unsupported hidden_act ", j["hidden_act"].dump(), " (supported: silu)");
  if (c.architecture == "Qwen2ForCausalLM") {
    c.qkv_bias = true;
    if (j.value("use_sliding_window", false))
      fail(source, ": sliding-window attention (use_sliding_window) is not supported");
  } else if (j.value("attention_bias", false)) {
    c.qkv_bias = c.o_bias = true;
  }
  if (j.value("mlp_bias", false)) fail(source, ": field 'mlp_bias' = true is not supported");
  if (c.architecture == "MistralForCausalLM" && r.has("sliding_window")) {
    const uint64_t window = r.positive("sliding_window");  // a negative one read as unsigned passed
    if (window < c.max_position)
      fail(source, ": sliding-window attention (sliding_window ", window,
           " < max_position_embeddings ", c.max_position, ") is not supported");
  }
  if (r.has("bos_token_id")) {
    const auto b = ids_of(j["bos_token_id"], source, "bos_token_id");
    if (!b.empty()) c.bos_token_id = b[0];
  }
  if (j.contains("eos_token_id")) c.eos_token_ids = ids_of(j["eos_token_id"], source, "eos_token_id");
  return c;
}

}  // namespace bitdelta
