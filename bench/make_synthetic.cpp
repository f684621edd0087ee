// Writes a synthetic Llama-shaped base checkpoint (random bf16 weights, a complete config.json), and
// either a fine-tune of it (base + small noise on every weight, for the compressor benchmark) or N
// random delta files against it (for engine benchmarks). Nothing it writes is committed.
//   make_synthetic OUT_DIR [--layers N] [--hidden H] [--inter I] [--vocab V] [--heads A]
//                  [--kv-heads B] [--tie 0|1] [--shards S] [--finetune 0|1] [--deltas N]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "bitdelta/checkpoint.h"
#include "bitdelta/delta_file.h"
#include "bitdelta/dtype.h"
#include "bitdelta/fingerprint.h"
#include "bitdelta/error.h"
#include "bitdelta/safetensors.h"
#include "bitdelta/thread_pool.h"

namespace fs = std::filesystem;
using namespace bitdelta;

namespace {

struct Spec {
  std::string name;
  Shape shape;
  float scale;
};

// SplitMix64: a fast deterministic generator; each row gets its own stream.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Roughly Gaussian (sum of two uniforms), scaled.
float noise(uint64_t& state, float scale) {
  state = mix(state);
  const float a = float(state & 0xffffff) / 16777216.0f, b = float((state >> 24) & 0xffffff) / 16777216.0f;
  return (a + b - 1.0f) * scale;
}

void write_model(const fs::path& dir, const std::string& config, const std::vector<Spec>& specs, int shards,
                 uint64_t seed, float ft_noise, ThreadPool& pool) {
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << config;
  std::string index = R"({"metadata": {}, "weight_map": {)";
  std::vector<std::vector<const Spec*>> parts(static_cast<size_t>(shards));
  for (size_t i = 0; i < specs.size(); ++i) parts[i * size_t(shards) / specs.size()].push_back(&specs[i]);
  bool first = true;
  for (int s = 0; s < shards; ++s) {
    char file[64];
    std::snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", s + 1, shards);
    SafetensorsWriter w(dir / file, {{"format", "pt"}});
    for (const auto* spec : parts[size_t(s)]) {
      w.add(spec->name, DType::BF16, spec->shape);
      index += std::string(first ? "" : ", ") + "\"" + spec->name + "\": \"" + file + "\"";
      first = false;
    }
    w.begin();
    for (const auto* spec : parts[size_t(s)]) {
      const uint64_t rows = spec->shape[0], cols = spec->shape.size() > 1 ? spec->shape[1] : 1;
      const uint64_t chunk = std::max<uint64_t>(1, (16u << 20) / (2 * cols));
      std::vector<uint16_t> buf;
      for (uint64_t r0 = 0; r0 < rows; r0 += chunk) {
        const uint64_t nr = std::min(chunk, rows - r0);
        buf.resize(nr * cols);
        pool.parallel_for(nr, [&](size_t b, size_t e) {
          for (size_t i = b; i < e; ++i) {
            const uint64_t row_id = std::hash<std::string>{}(spec->name) ^ (r0 + i) * 0x9e37ull;
            uint64_t base_state = mix(row_id), ft_state = mix(row_id ^ seed);
            for (uint64_t c = 0; c < cols; ++c) {
              float v = noise(base_state, spec->scale);
              if (ft_noise > 0) v += noise(ft_state, ft_noise * spec->scale);
              buf[i * cols + c] = f32_to_bf16(v);
            }
          }
        });
        w.write(std::as_bytes(std::span(buf)));
      }
    }
    w.finish();
  }
  std::ofstream(dir / "model.safetensors.index.json") << index << "}}";
}

// A delta file with random sign bits and small α for every block linear of the base.
void write_random_delta(const fs::path& path, const Checkpoint& base, const std::string& base_fp, uint64_t seed) {
  SafetensorsWriter w(path, {{"format", kDeltaFormat}, {"format_version", kDeltaFormatVersion},
                             {"base_fingerprint", base_fp}, {"finetuned_fingerprint", "synthetic"},
                             {"alpha_mode", "row"}, {"alpha_source", "random"},
                             {"architecture", "LlamaForCausalLM"}, {"created_by", "make_synthetic"}});
  std::vector<std::string> names;
  for (const auto& n : base.tensor_names())
    if (n.find(".layers.") != std::string::npos && base.info(n).shape.size() == 2) names.push_back(n);
  // Every α first, then the signs, as the compressor lays a delta out (src/delta/compress.cpp).
  for (const auto& n : names) w.add(n + kAlphaSuffix, DType::F32, {base.info(n).shape[0]});
  for (const auto& n : names) {
    const auto& s = base.info(n).shape;
    w.add(n + kSignSuffix, DType::U8, {s[0], sign_row_bytes(s[1])});
  }
  w.begin();
  for (const auto& n : names) {
    const std::vector<float> alpha(base.info(n).shape[0], 4e-4f);
    w.write(std::as_bytes(std::span(alpha)));
  }
  for (const auto& n : names) {
    const auto& s = base.info(n).shape;
    std::vector<uint64_t> bits((s[0] * sign_row_bytes(s[1]) + 7) / 8);
    uint64_t state = seed ^ std::hash<std::string>{}(n);
    for (auto& b : bits) b = state = mix(state);
    w.write(std::as_bytes(std::span(bits)).first(s[0] * sign_row_bytes(s[1])));
  }
  w.finish();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 2) fail("usage: make_synthetic OUT_DIR [--layers N] [--hidden H] [--inter I] [--vocab V] [--shards S]");
    const fs::path out = argv[1];
    uint64_t layers = 6, hidden = 4096, inter = 11008, vocab = 32000, heads = 32, kv_heads = 32, tie = 0;
    uint64_t finetune = 1, deltas = 0;
    int shards = 2;
    for (int i = 2; i + 1 < argc; i += 2) {
      const std::string k = argv[i];
      const uint64_t v = std::strtoull(argv[i + 1], nullptr, 10);
      if (k == "--layers") layers = v;
      else if (k == "--hidden") hidden = v;
      else if (k == "--inter") inter = v;
      else if (k == "--vocab") vocab = v;
      else if (k == "--heads") heads = v;
      else if (k == "--kv-heads") kv_heads = v;
      else if (k == "--tie") tie = v;
      else if (k == "--shards") shards = int(v);
      else if (k == "--finetune") finetune = v;
      else if (k == "--deltas") deltas = v;
      else fail("unknown option ", k);
    }
    const uint64_t hd = hidden / heads;
    const std::string config = str(
        R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": )", vocab,
        R"(, "hidden_size": )", hidden, R"(, "intermediate_size": )", inter, R"(, "num_hidden_layers": )", layers,
        R"(, "num_attention_heads": )", heads, R"(, "num_key_value_heads": )", kv_heads, R"(, "head_dim": )", hd,
        R"(, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",)",
        R"( "tie_word_embeddings": )", tie ? "true" : "false", R"(, "bos_token_id": 1, "eos_token_id": 2})");
    std::vector<Spec> specs{{"model.embed_tokens.weight", {vocab, hidden}, 0.02f}, {"model.norm.weight", {hidden}, 1.0f}};
    if (!tie) specs.push_back({"lm_head.weight", {vocab, hidden}, 0.02f});
    uint64_t linear = 0;
    for (uint64_t l = 0; l < layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      specs.push_back({p + "self_attn.q_proj.weight", {heads * hd, hidden}, 0.02f});
      specs.push_back({p + "self_attn.k_proj.weight", {kv_heads * hd, hidden}, 0.02f});
      specs.push_back({p + "self_attn.v_proj.weight", {kv_heads * hd, hidden}, 0.02f});
      specs.push_back({p + "self_attn.o_proj.weight", {hidden, heads * hd}, 0.02f});
      specs.push_back({p + "mlp.gate_proj.weight", {inter, hidden}, 0.02f});
      specs.push_back({p + "mlp.up_proj.weight", {inter, hidden}, 0.02f});
      specs.push_back({p + "mlp.down_proj.weight", {hidden, inter}, 0.02f});
      specs.push_back({p + "input_layernorm.weight", {hidden}, 1.0f});
      specs.push_back({p + "post_attention_layernorm.weight", {hidden}, 1.0f});
      linear += 2 * ((2 * heads + 2 * kv_heads) * hd * hidden + 3 * inter * hidden);
    }
    std::printf("writing %s/base: %.2f GB of bf16 block-linear weights\n", out.c_str(), double(linear) / 1e9);
    ThreadPool pool(0);
    write_model(out / "base", config, specs, shards, 1, 0.0f, pool);
    if (finetune) write_model(out / "finetuned", config, specs, shards, 2, 0.05f, pool);
    if (deltas) {
      const Checkpoint base(out / "base");
      const std::string fp = fingerprint(base);
      fs::create_directories(out / "deltas");
      for (uint64_t d = 0; d < deltas; ++d)
        write_random_delta(out / "deltas" / ("v" + std::to_string(d) + ".bitdelta"), base, fp, 1000 + d);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_synthetic: error: %s\n", e.what());
    return 1;
  }
}
