// The CPU forward pass: config parsing, the weight table, a naive float64 reference written here,
// and the batching contract (a mixed batch equals each sequence alone).
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "bitdelta/compress.h"
#include "bitdelta/error.h"
#include "bitdelta/model.h"
#include "test_util.h"

namespace bitdelta {
namespace {

using nlohmann::json;
using test::TempDir;

json tiny_config() {
  return {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"vocab_size", 37},
          {"hidden_size", 24}, {"intermediate_size", 40}, {"num_hidden_layers", 2},
          {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 6},
          {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-5}, {"rope_theta", 500.0},
          {"tie_word_embeddings", false}, {"hidden_act", "silu"}, {"bos_token_id", 1}, {"eos_token_id", 2}};
}

test::TensorMap tiny_weights(const ModelConfig& c, uint64_t seed, DType dtype = DType::BF16) {
  test::TensorMap m;
  uint64_t s = seed;
  for (const auto& spec : weight_table(c)) {
    const bool norm = spec.shape.size() == 1 && spec.name.find("bias") == std::string::npos;
    auto v = test::random_floats(numel(spec.shape), s++, norm ? 0.1f : 0.3f);
    if (norm)
      for (auto& x : v) x += 1.0f;
    m[spec.name] = test::HostTensor::from_floats(dtype, spec.shape, v);
  }
  return m;
}

void write_model(const std::filesystem::path& dir, const json& config, const test::TensorMap& weights) {
  test::write_checkpoint(dir, weights);
  test::write_text(dir / "config.json", config.dump());
}

// ---------------------------------------------------------------------------------------------
// A naive forward pass in float64, straight from the definitions, for one sequence.
struct NaiveModel {
  ModelConfig c;
  std::map<std::string, std::vector<double>> w;

  const std::vector<double>& get(const std::string& n) const { return w.at(n); }

  std::vector<double> matvec(const std::string& n, const std::vector<double>& x, size_t N) const {
    const auto& m = get(n);
    std::vector<double> y(N, 0.0);
    for (size_t i = 0; i < N; ++i)
      for (size_t k = 0; k < x.size(); ++k) y[i] += m[i * x.size() + k] * x[k];
    if (auto it = w.find(n.substr(0, n.size() - 6) + "bias"); it != w.end())
      for (size_t i = 0; i < N; ++i) y[i] += it->second[i];
    return y;
  }
  std::vector<double> norm(const std::vector<double>& x, const std::string& n) const {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double inv = 1 / std::sqrt(ss / double(x.size()) + c.rms_eps);
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = get(n)[i] * x[i] * inv;
    return y;
  }
  void rope(std::vector<double>& v, size_t heads, size_t pos) const {
    const size_t hd = c.head_dim, half = hd / 2;
    for (size_t h = 0; h < heads; ++h)
      for (size_t i = 0; i < half; ++i) {
        const double f = std::pow(c.rope.theta, -double(2 * i) / double(hd)), a = double(pos) * f;
        const double x0 = v[h * hd + i], x1 = v[h * hd + i + half];
        v[h * hd + i] = x0 * std::cos(a) - x1 * std::sin(a);
        v[h * hd + i + half] = x1 * std::cos(a) + x0 * std::sin(a);
      }
  }
  // Logits at every position of `tokens`.
  std::vector<std::vector<double>> run(const std::vector<int32_t>& tokens) const {
    const size_t H = c.hidden, hd = c.head_dim, L = c.layers;
    std::vector<std::vector<std::vector<double>>> K(L), V(L);
    std::vector<std::vector<double>> out;
    for (size_t t = 0; t < tokens.size(); ++t) {
      std::vector<double> x(get("model.embed_tokens.weight").begin() + long(tokens[t] * H),
                            get("model.embed_tokens.weight").begin() + long((tokens[t] + 1) * H));
      for (size_t l = 0; l < L; ++l) {
        const std::string p = "model.layers." + std::to_string(l) + ".";
        auto h = norm(x, p + "input_layernorm.weight");
        auto q = matvec(p + "self_attn.q_proj.weight", h, c.heads * hd);
        auto k = matvec(p + "self_attn.k_proj.weight", h, c.kv_heads * hd);
        auto v = matvec(p + "self_attn.v_proj.weight", h, c.kv_heads * hd);
        rope(q, c.heads, t);
        rope(k, c.kv_heads, t);
        K[l].push_back(k);
        V[l].push_back(v);
        std::vector<double> att(c.heads * hd, 0.0);
        for (size_t head = 0; head < c.heads; ++head) {
          const size_t kvh = head / (c.heads / c.kv_heads);
          std::vector<double> sc(t + 1);
          double mx = -1e300, tot = 0;
          for (size_t j = 0; j <= t; ++j) {
            double d = 0;
            for (size_t e = 0; e < hd; ++e) d += q[head * hd + e] * K[l][j][kvh * hd + e];
            sc[j] = d / std::sqrt(double(hd));
            mx = std::max(mx, sc[j]);
          }
          for (auto& s : sc) tot += (s = std::exp(s - mx));
          for (size_t j = 0; j <= t; ++j)
            for (size_t e = 0; e < hd; ++e) att[head * hd + e] += sc[j] / tot * V[l][j][kvh * hd + e];
        }
        auto o = matvec(p + "self_attn.o_proj.weight", att, H);
        for (size_t i = 0; i < H; ++i) x[i] += o[i];
        h = norm(x, p + "post_attention_layernorm.weight");
        auto g = matvec(p + "mlp.gate_proj.weight", h, c.intermediate);
        auto u = matvec(p + "mlp.up_proj.weight", h, c.intermediate);
        for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
        auto d = matvec(p + "mlp.down_proj.weight", g, H);
        for (size_t i = 0; i < H; ++i) x[i] += d[i];
      }
      out.push_back(matvec(c.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight",
                           norm(x, "model.norm.weight"), c.vocab_size));
    }
    return out;
  }
};

// The naive model of a variant: the fine-tune's whole tensors, and W_base + α·S for compressed ones.
NaiveModel naive_of(const ModelConfig& c, const test::TensorMap& base, const DeltaFile* delta) {
  NaiveModel m{c, {}};
  for (const auto& [name, t] : base) {
    const auto f = t.floats();
    m.w[name].assign(f.begin(), f.end());
  }
  if (!delta) return m;
  for (const auto& p : delta->whole()) {
    std::vector<float> f(p.value.numel());
    to_f32(p.value.dtype, p.value.data.data(), f.data(), f.size());
    m.w[p.name].assign(f.begin(), f.end());
  }
  for (const auto& cw : delta->compressed()) {
    auto& w = m.w[cw.name];
    const size_t K = base.at(cw.name).shape[1];
    for (size_t r = 0; r < cw.out(); ++r)
      for (size_t k = 0; k < K; ++k) w[r * K + k] += (cw.sign_row(r)[k / 8] >> (k % 8)) & 1 ? cw.alpha_of(r) : -cw.alpha_of(r);
  }
  return m;
}

// Runs a whole prompt through the model in one step and returns every position's logits.
std::vector<float> prefill(Model& model, Sequence& seq, const std::vector<int32_t>& tokens) {
  std::vector<ForwardRow> rows;
  for (int32_t t : tokens) rows.push_back({&seq, t, true});
  return model.forward(rows);
}

class ModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = ModelConfig::from_json(tiny_config(), "tiny");
    base_ = tiny_weights(config_, 100);
    write_model(dir_ / "base", tiny_config(), base_);
    for (int i = 0; i < 2; ++i) {
      const auto name = "ft" + std::to_string(i);
      write_model(dir_ / name, tiny_config(), test::fine_tune_of(base_, 200 + uint64_t(i)));
      CompressOptions o;
      o.alpha_mode = i == 0 ? AlphaMode::Row : AlphaMode::Tensor;
      compress(Checkpoint(dir_ / "base"), Checkpoint(dir_ / name), dir_ / (name + ".bitdelta"), o);
    }
  }
  TempDir dir_;
  ModelConfig config_;
  test::TensorMap base_;
};

TEST_F(ModelTest, MatchesNaiveFloat64ForwardForBaseAndVariants) {
  Model model(dir_ / "base", 2);
  const int v0 = model.add_variant("ft0", dir_ / "ft0.bitdelta");
  const int v1 = model.add_variant("ft1", dir_ / "ft1.bitdelta");
  const std::vector<int32_t> tokens{1, 5, 9, 36, 0, 17, 17, 3, 22, 11};
  for (int id : {0, v0, v1}) {
    const DeltaFile* delta = id == 0 ? nullptr : model.variant(id).delta.get();
    const auto ref = naive_of(config_, base_, delta).run(tokens);
    auto seq = model.new_sequence(id);
    const auto got = prefill(model, seq, tokens);
    for (size_t t = 0; t < tokens.size(); ++t)
      for (size_t i = 0; i < config_.vocab_size; ++i)
        ASSERT_NEAR(got[t * config_.vocab_size + i], ref[t][i], 2e-4 * (1 + std::fabs(ref[t][i])))
            << "variant " << id << " position " << t << " logit " << i;
  }
}

// Alone, a decode row goes through the GEMV kernel and a prompt through the GEMM path; in a batch the
// same row may take the other path, which sums the K products in another order: equal up to float32
// rounding (~K·2⁻²⁴ relative per layer), far below any difference a wrong variant or position makes.
TEST_F(ModelTest, MixedBatchEqualsEachSequenceAlone) {
  Model model(dir_ / "base", 2);
  model.add_variant("ft0", dir_ / "ft0.bitdelta");
  model.add_variant("ft1", dir_ / "ft1.bitdelta");
  const std::vector<std::vector<int32_t>> prompts{{1, 4, 4, 8, 15, 16, 23, 42 % 37}, {1, 2}, {1, 30, 29, 28, 27}};
  const std::vector<int> variant_of{1, 0, 2};
  const size_t V = config_.vocab_size, decode_steps = 4;

  // Alone: prefill, then decode the same fixed tokens one at a time.
  std::vector<std::vector<float>> alone(prompts.size());
  for (size_t s = 0; s < prompts.size(); ++s) {
    auto seq = model.new_sequence(variant_of[s]);
    alone[s] = prefill(model, seq, prompts[s]);
    for (size_t d = 0; d < decode_steps; ++d) {
      const ForwardRow row{&seq, int32_t((s * 7 + d * 3) % V), true};
      const auto l = model.forward({&row, 1});
      alone[s].insert(alone[s].end(), l.begin(), l.end());
    }
  }
  // Together: one step prefills all three, then every step decodes one row of each.
  std::vector<Sequence> seqs;
  for (size_t s = 0; s < prompts.size(); ++s) seqs.push_back(model.new_sequence(variant_of[s]));
  std::vector<ForwardRow> rows;
  for (size_t s = 0; s < prompts.size(); ++s)
    for (int32_t t : prompts[s]) rows.push_back({&seqs[s], t, true});
  std::vector<std::vector<float>> together(prompts.size());
  auto logits = model.forward(rows);
  size_t at = 0;
  for (size_t s = 0; s < prompts.size(); ++s)
    for (size_t i = 0; i < prompts[s].size(); ++i, ++at)
      together[s].insert(together[s].end(), logits.begin() + long(at * V), logits.begin() + long((at + 1) * V));
  for (size_t d = 0; d < decode_steps; ++d) {
    rows.clear();
    for (size_t s = 0; s < prompts.size(); ++s) rows.push_back({&seqs[s], int32_t((s * 7 + d * 3) % V), true});
    logits = model.forward(rows);
    for (size_t s = 0; s < prompts.size(); ++s)
      together[s].insert(together[s].end(), logits.begin() + long(s * V), logits.begin() + long((s + 1) * V));
  }
  for (size_t s = 0; s < prompts.size(); ++s) {
    ASSERT_EQ(alone[s].size(), together[s].size());
    for (size_t i = 0; i < alone[s].size(); ++i)
      ASSERT_NEAR(alone[s][i], together[s][i], 2e-5 * (1 + std::fabs(alone[s][i]))) << "sequence " << s << " value " << i;
  }
}

TEST_F(ModelTest, RefusesDeltaOfAnotherBaseAndBadTokens) {
  write_model(dir_ / "other", tiny_config(), tiny_weights(config_, 999));
  Model other(dir_ / "other", 1);
  try {
    other.add_variant("ft0", dir_ / "ft0.bitdelta");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(other.fingerprint()), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(other.add_variant("forced", dir_ / "ft0.bitdelta", true));
  Model model(dir_ / "base", 1);
  auto seq = model.new_sequence(0);
  const ForwardRow bad{&seq, 37, true};
  EXPECT_THROW(model.forward({&bad, 1}), Error);
  EXPECT_EQ(seq.length, 0u);
}

TEST_F(ModelTest, WeightTableNamesExpectedAndActualShape) {
  auto w = base_;
  w["model.layers.1.self_attn.k_proj.weight"] = test::HostTensor::from_floats(DType::BF16, {24, 24}, test::random_floats(576, 1));
  write_model(dir_ / "bad", tiny_config(), w);
  try {
    Model m(dir_ / "bad", 1);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'model.layers.1.self_attn.k_proj.weight': shape [24, 24], expected [12, 24]"),
              std::string::npos)
        << e.what();
  }
  w = base_;
  w.erase("lm_head.weight");
  write_model(dir_ / "missing", tiny_config(), w);
  EXPECT_THROW(Model(dir_ / "missing", 1), Error);
  auto tied = tiny_config();
  tied["tie_word_embeddings"] = true;
  write_model(dir_ / "tied", tied, w);
  EXPECT_NO_THROW(Model(dir_ / "tied", 1));
}

std::string config_error(json j) {
  try {
    ModelConfig::from_json(j, "cfg.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ModelConfig, ReadsEachArchitectureAndBothRopeStyles) {
  auto llama3 = tiny_config();
  llama3["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 32.0}, {"low_freq_factor", 1.0},
                            {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  llama3["tie_word_embeddings"] = true;
  auto c = ModelConfig::from_json(llama3, "x");
  EXPECT_EQ(c.rope.type, "llama3");
  EXPECT_EQ(c.rope.factor, 32.0);
  EXPECT_EQ(c.rope.theta, 500.0);
  EXPECT_TRUE(c.tie_embeddings);

  auto v5 = tiny_config();
  v5.erase("rope_theta");
  v5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}};
  c = ModelConfig::from_json(v5, "x");
  EXPECT_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.rope.type, "default");

  auto qwen = tiny_config();
  qwen["architectures"] = {"Qwen2ForCausalLM"};
  qwen["use_sliding_window"] = false;
  qwen["sliding_window"] = 4096;
  c = ModelConfig::from_json(qwen, "x");
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  const auto table = weight_table(c);
  EXPECT_TRUE(std::any_of(table.begin(), table.end(), [](const auto& s) { return s.name == "model.layers.0.self_attn.q_proj.bias"; }));

  auto mistral = tiny_config();
  mistral["architectures"] = {"MistralForCausalLM"};
  mistral["sliding_window"] = nullptr;
  c = ModelConfig::from_json(mistral, "x");
  EXPECT_EQ(c.architecture, "MistralForCausalLM");
  EXPECT_EQ(c.kv_heads, 2u);
  auto no_head_dim = tiny_config();
  no_head_dim.erase("head_dim");
  EXPECT_EQ(ModelConfig::from_json(no_head_dim, "x").head_dim, 6u);  // 24 / 4
}

TEST(ModelConfig, ErrorsNameTheField) {
  auto j = tiny_config();
  j["architectures"] = {"GPT2LMHeadModel"};
  EXPECT_NE(config_error(j).find("cfg.json: unsupported architecture 'GPT2LMHeadModel'"), std::string::npos);
  j = tiny_config();
  j.erase("hidden_size");
  EXPECT_NE(config_error(j).find("missing field 'hidden_size'"), std::string::npos);
  j = tiny_config();
  j["num_key_value_heads"] = 3;
  EXPECT_NE(config_error(j).find("num_key_value_heads"), std::string::npos);
  j = tiny_config();
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}};
  EXPECT_NE(config_error(j).find("unsupported rope type 'yarn'"), std::string::npos);
  j = tiny_config();
  j["architectures"] = {"MistralForCausalLM"};
  j["sliding_window"] = 16;
  EXPECT_NE(config_error(j).find("sliding-window"), std::string::npos);
  j["sliding_window"] = -1;  // read as unsigned it was 2^64 - 1, which passed as no window
  EXPECT_NE(config_error(j).find("field 'sliding_window' must be a positive integer"), std::string::npos);
  j = tiny_config();
  j["vocab_size"] = "many";
  EXPECT_NE(config_error(j).find("field 'vocab_size' must be a positive integer"), std::string::npos);
}

}  // namespace
}  // namespace bitdelta
