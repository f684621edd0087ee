#include "bitdelta/model.h"

#include <cmath>
#include <cstring>
#include <map>
#include <numbers>

#include "backend/cpu/fused_linear.h"
#include "backend/cuda/device_model.h"
#include "backend/cpu/ops.h"
#include "bitdelta/error.h"
#include "bitdelta/fingerprint.h"
#include "bitdelta/mapped_file.h"

namespace bitdelta {

namespace fs = std::filesystem;

namespace {

constexpr const char* kLinearNames[kLinearCount] = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};

std::string layer_prefix(size_t l) { return "model.layers." + std::to_string(l) + "."; }

Shape linear_shape(const ModelConfig& c, int kind) {
  const uint64_t q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim;
  switch (kind) {
    case kQ: return {q, c.hidden};
    case kK: case kV: return {kv, c.hidden};
    case kO: return {c.hidden, q};
    case kGate: case kUp: return {c.intermediate, c.hidden};
    default: return {c.hidden, c.intermediate};
  }
}

bool has_bias(const ModelConfig& c, int kind) {
  return (c.qkv_bias && (kind == kQ || kind == kK || kind == kV)) || (c.o_bias && kind == kO);
}

std::vector<float> floats_of(const TensorView& t) {
  std::vector<float> v(t.numel());
  to_f32(t.dtype, t.data.data(), v.data(), v.size());
  return v;
}

// Rotary frequencies as the reference computes them in float32, with the config's scaling.
std::vector<float> rotary_frequencies(const ModelConfig& c) {
  std::vector<float> inv(c.head_dim / 2);
  const auto& r = c.rope;
  for (size_t i = 0; i < inv.size(); ++i) {
    const float exponent = float(2 * i) / float(c.head_dim);
    double f = 1.0 / double(std::pow(float(r.theta), exponent));
    if (r.type == "linear") {
      f /= r.factor;
    } else if (r.type == "llama3") {
      const double low_wavelen = r.original_max_position / r.low_freq_factor;
      const double high_wavelen = r.original_max_position / r.high_freq_factor;
      const double wavelen = 2 * std::numbers::pi / f;
      if (wavelen > low_wavelen) {
        f /= r.factor;
      } else if (wavelen >= high_wavelen) {  // between the two: interpolate
        const double smooth =
            (r.original_max_position / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
        f = (1 - smooth) * f / r.factor + smooth * f;
      }
    }
    inv[i] = float(f);
  }
  return inv;
}

}  // namespace

std::vector<WeightSpec> weight_table(const ModelConfig& c) {
  std::vector<WeightSpec> t{{"model.embed_tokens.weight", {c.vocab_size, c.hidden}},
                            {"model.norm.weight", {c.hidden}}};
  if (!c.tie_embeddings) t.push_back({"lm_head.weight", {c.vocab_size, c.hidden}});
  for (size_t l = 0; l < c.layers; ++l) {
    const std::string p = layer_prefix(l);
    t.push_back({p + "input_layernorm.weight", {c.hidden}});
    t.push_back({p + "post_attention_layernorm.weight", {c.hidden}});
    for (int k = 0; k < kLinearCount; ++k) {
      const Shape s = linear_shape(c, k);
      t.push_back({p + kLinearNames[k] + ".weight", s});
      if (has_bias(c, k)) t.push_back({p + kLinearNames[k] + ".bias", {s[0]}});
    }
  }
  return t;
}

ModelOptions model_options(const std::string& device, size_t threads, uint64_t host_cache_bytes, bool cuda_graphs) {
  ModelOptions o;
  o.threads = threads;
  o.host_cache_bytes = host_cache_bytes;
  o.cuda_graphs = cuda_graphs;
  if (device == "cpu") return o;
  if (device == "cuda" || device.rfind("cuda:", 0) == 0) {
    o.device = Device::Cuda;
    if (device.size() > 5) {
      const std::string n = device.substr(5);
      if (n.empty() || n.find_first_not_of("0123456789") != std::string::npos || n.size() > 3)
        fail("--device: '", device, "' is not cpu, cuda or cuda:N");
      o.cuda_device = std::stoi(n);
    }
    return o;
  }
  fail("--device: '", device, "' is not cpu, cuda or cuda:N");
}

Model::Model(const fs::path& dir, size_t threads) : Model(dir, ModelOptions{.threads = threads}) {}

Model::~Model() = default;

Model::Model(const fs::path& dir, const ModelOptions& options)
    : base_(dir), pool_(std::make_unique<ThreadPool>(options.threads)) {
  const std::string config_path = (dir / "config.json").string();
  config_ = ModelConfig::from_json(base_.config(), config_path);
  fingerprint_ = bitdelta::fingerprint(base_);
  inv_freq_ = rotary_frequencies(config_);

  // Every tensor of the table must be there, floating, with the expected shape.
  std::map<std::string, TensorView> w;
  for (const auto& spec : weight_table(config_)) {
    if (!base_.contains(spec.name))
      fail(dir.string(), ": missing tensor '", spec.name, "' (expected ", shape_str(spec.shape), ")");
    const auto& info = base_.info(spec.name);
    if (!is_float(info.dtype))
      fail(base_.file_of(spec.name).path().string(), ": tensor '", spec.name, "': dtype ", dtype_name(info.dtype),
           ", expected BF16, F16 or F32");
    if (info.shape != spec.shape)
      fail(base_.file_of(spec.name).path().string(), ": tensor '", spec.name, "': shape ", shape_str(info.shape),
           ", expected ", shape_str(spec.shape), " from ", config_path);
    w[spec.name] = base_.tensor(spec.name);
  }
  auto v = std::make_unique<VariantWeights>();
  v->name = "base";
  v->embed = w.at("model.embed_tokens.weight");
  v->lm_head = config_.tie_embeddings ? v->embed : w.at("lm_head.weight");
  v->final_norm = floats_of(w.at("model.norm.weight"));
  v->layers.resize(config_.layers);
  for (size_t l = 0; l < config_.layers; ++l) {
    const std::string p = layer_prefix(l);
    auto& L = v->layers[l];
    L.attn_norm = floats_of(w.at(p + "input_layernorm.weight"));
    L.mlp_norm = floats_of(w.at(p + "post_attention_layernorm.weight"));
    for (int k = 0; k < kLinearCount; ++k) {
      L.linear[size_t(k)] = w.at(p + kLinearNames[k] + ".weight");
      if (has_bias(config_, k)) L.bias[size_t(k)] = floats_of(w.at(p + kLinearNames[k] + ".bias"));
    }
  }
  base_weights_ = v.get();
  variants_.push_back(std::move(v));
  if (options.device == Device::Cuda) {
    cuda::DeviceOptions d;
    d.device = options.cuda_device;
    d.host_cache_bytes = options.host_cache_bytes;
    d.graphs = options.cuda_graphs;
    device_ = std::make_unique<cuda::DeviceModel>(config_, *variants_[0], inv_freq_, d);
  }
}

int Model::add_variant(const std::string& name, const fs::path& delta_path, bool force) {
  return add_variant(name, std::make_shared<const DeltaFile>(delta_path), force);
}

int Model::add_variant(const std::string& name, std::shared_ptr<const DeltaFile> delta, bool force) {
  return install_variant(prepare_variant(name, std::move(delta), force));
}

int Model::install_variant(std::unique_ptr<PreparedVariant> prepared) {
  if (find_variant(prepared->weights->name) >= 0) fail("variant '", prepared->weights->name, "' already exists");
  variants_.push_back(std::move(prepared->weights));
  const int id = int(variants_.size() - 1);
  if (device_) device_->install(id, std::move(prepared->device));
  return id;
}

std::unique_ptr<PreparedVariant> Model::prepare_variant(const std::string& name, std::shared_ptr<const DeltaFile> delta,
                                                        bool force) const {
  if (delta->base_fingerprint() != fingerprint_ && !force)
    fail(delta->path().string(), ": made for a base with fingerprint ", delta->base_fingerprint(), ", but ",
         base_.dir().string(), " has fingerprint ", fingerprint_);
  delta->check_against(base_);
  auto v = std::make_unique<VariantWeights>(*base_weights_);  // views and small vectors: the base is not copied
  v->name = name;
  v->delta = delta;
  auto replace = [&](const std::string& tensor, auto&& assign) {
    if (const auto* whole = delta->find_whole(tensor)) assign(whole->value);
  };
  replace("model.embed_tokens.weight", [&](const TensorView& t) {
    v->embed = t;
    if (config_.tie_embeddings) v->lm_head = t;
  });
  if (!config_.tie_embeddings) replace("lm_head.weight", [&](const TensorView& t) { v->lm_head = t; });
  replace("model.norm.weight", [&](const TensorView& t) { v->final_norm = floats_of(t); });
  for (size_t l = 0; l < config_.layers; ++l) {
    const std::string p = layer_prefix(l);
    auto& L = v->layers[l];
    replace(p + "input_layernorm.weight", [&](const TensorView& t) { L.attn_norm = floats_of(t); });
    replace(p + "post_attention_layernorm.weight", [&](const TensorView& t) { L.mlp_norm = floats_of(t); });
    for (int k = 0; k < kLinearCount; ++k) {
      const std::string wname = p + kLinearNames[k] + ".weight";
      replace(wname, [&](const TensorView& t) { L.linear[size_t(k)] = t; });
      if (has_bias(config_, k))
        replace(p + kLinearNames[k] + ".bias", [&](const TensorView& t) { L.bias[size_t(k)] = floats_of(t); });
      if (const auto* c = delta->find_compressed(wname)) {
        if (delta->find_whole(wname))
          fail(delta->path().string(), ": tensor '", wname, "' is stored both whole and compressed");
        auto& d = L.delta[size_t(k)];
        d = {reinterpret_cast<const uint8_t*>(c->signs.data.data()),
             reinterpret_cast<const float*>(c->alpha.data.data()), c->alpha.shape[0] != 1};
        if (!device_) {  // the CPU kernels read the signs repacked for their lookup tables
          const Shape& s = L.linear[size_t(k)].shape;
          v->packed_signs.emplace_back(cpu::pack_signs(d.signs, s[0], s[1]));
          d.packed = v->packed_signs.back().get();
          release_pages(c->signs.data);  // only the packed copy stays resident
        }
      }
    }
  }
  // A delta must not carry tensors this model does not use: that would be a wrong base or model.
  const auto table = weight_table(config_);
  for (const auto& c : delta->compressed())
    if (std::none_of(table.begin(), table.end(), [&](const WeightSpec& s) { return s.name == c.name; }))
      fail(delta->path().string(), ": tensor '", c.name, "' is not a weight of this model");
  auto prepared = std::make_unique<PreparedVariant>();
  if (device_) prepared->device = device_->upload(*v, *delta, &prepared->upload);
  prepared->weights = std::move(v);
  return prepared;
}

int Model::find_variant(const std::string& name) const {
  for (size_t i = 0; i < variants_.size(); ++i)
    if (variants_[i] && variants_[i]->name == name) return int(i);
  return -1;
}

void Model::remove_variant(int id) {
  if (id <= 0 || size_t(id) >= variants_.size() || !variants_[size_t(id)]) fail("no variant with id ", id, " to remove");
  variants_[size_t(id)].reset();
  if (device_) device_->remove(id);
}

const VariantWeights& Model::variant(int id) const {
  if (id < 0 || size_t(id) >= variants_.size() || !variants_[size_t(id)]) fail("no variant with id ", id);
  return *variants_[size_t(id)];
}

Sequence Model::new_sequence(int variant) const {
  if (variant < 0 || size_t(variant) >= variants_.size() || !variants_[size_t(variant)])
    fail("no variant with id ", variant);
  Sequence s;
  s.variant = variant;
  s.keys.resize(config_.layers);
  s.values.resize(config_.layers);
  return s;
}

Sequence Model::fork_sequence(const Sequence& sequence, size_t length) const {
  length = std::min(length, sequence.length);
  Sequence copy;
  copy.variant = sequence.variant;
  copy.length = length;
  const size_t kv = config_.kv_heads * config_.head_dim;
  copy.keys.resize(sequence.keys.size());
  copy.values.resize(sequence.values.size());
  for (size_t l = 0; l < sequence.keys.size(); ++l) {
    const size_t n = std::min(sequence.keys[l].size(), length * kv);
    copy.keys[l].assign(sequence.keys[l].begin(), sequence.keys[l].begin() + long(n));
    copy.values[l].assign(sequence.values[l].begin(), sequence.values[l].begin() + long(n));
  }
  if (sequence.device_kv) copy.device_kv = device_->clone_kv(*sequence.device_kv, length);
  return copy;
}

uint64_t Model::sequence_bytes(const Sequence& sequence) const {
  uint64_t bytes = 0;
  for (size_t l = 0; l < sequence.keys.size(); ++l)
    bytes += (sequence.keys[l].size() + sequence.values[l].size()) * sizeof(float);
  if (sequence.device_kv) bytes += device_->kv_bytes(*sequence.device_kv);
  return bytes;
}

namespace {

// Runs one linear over rows whose variants may use different weight tensors (a variant that
// replaced the whole weight): rows are grouped by tensor, and each group is one fused call that
// reads its tensor once and each variant's sign bits once.
void grouped_linear(const std::vector<const TensorView*>& weight, const std::vector<DeltaRef>& deltas,
                    const std::vector<const std::vector<float>*>& bias, const std::vector<float>& x, size_t K,
                    std::vector<float>& y, size_t N, ThreadPool& pool) {
  const size_t rows = weight.size();
  y.resize(rows * N);
  // Biases match by value: each variant holds its own copy of the base's (usually empty) vectors.
  auto same_bias = [](const std::vector<float>* a, const std::vector<float>* b) {
    const bool ea = !a || a->empty(), eb = !b || b->empty();
    return (ea && eb) || (!ea && !eb && (a == b || *a == *b));
  };
  bool uniform = true;
  for (size_t r = 1; r < rows; ++r)
    uniform = uniform && weight[r]->data.data() == weight[0]->data.data() && same_bias(bias[r], bias[0]);
  if (uniform) {
    cpu::fused_linear(*weight[0], x, rows, deltas, bias[0] && !bias[0]->empty() ? bias[0]->data() : nullptr, y, pool);
    return;
  }
  std::vector<bool> done(rows, false);
  for (size_t r0 = 0; r0 < rows; ++r0) {
    if (done[r0]) continue;
    std::vector<size_t> group;
    for (size_t r = r0; r < rows; ++r)
      if (!done[r] && weight[r]->data.data() == weight[r0]->data.data() && same_bias(bias[r], bias[r0])) {
        group.push_back(r);
        done[r] = true;
      }
    std::vector<float> gx(group.size() * K), gy(group.size() * N);
    std::vector<DeltaRef> gd(group.size());
    for (size_t i = 0; i < group.size(); ++i) {
      std::memcpy(&gx[i * K], &x[group[i] * K], K * 4);
      gd[i] = deltas[group[i]];
    }
    cpu::fused_linear(*weight[r0], gx, group.size(), gd, bias[r0] && !bias[r0]->empty() ? bias[r0]->data() : nullptr,
                      gy, pool);
    for (size_t i = 0; i < group.size(); ++i) std::memcpy(&y[group[i] * N], &gy[i * N], N * 4);
  }
}

}  // namespace

std::vector<float> Model::forward(std::span<const ForwardRow> rows) {
  const auto& c = config_;
  const size_t R = rows.size(), H = c.hidden, hd = c.head_dim;
  const size_t qdim = c.heads * hd, kvdim = c.kv_heads * hd;
  if (R == 0) return {};

  std::vector<const VariantWeights*> vw(R);
  std::vector<size_t> pos(R);
  std::map<Sequence*, size_t> next_pos;
  for (size_t r = 0; r < R; ++r) {
    Sequence* s = rows[r].sequence;
    if (s->variant < 0 || size_t(s->variant) >= variants_.size() || !variants_[size_t(s->variant)])
      fail("sequence has unknown variant ", s->variant);
    if (rows[r].token < 0 || uint64_t(rows[r].token) >= c.vocab_size)
      fail("token id ", rows[r].token, " is outside the vocabulary (", c.vocab_size, " tokens)");
    vw[r] = variants_[size_t(s->variant)].get();
    auto [it, fresh] = next_pos.try_emplace(s, s->length);
    pos[r] = it->second++;
    if (pos[r] >= c.max_position)
      fail("sequence is longer than max_position_embeddings (", c.max_position, ")");
  }

  if (device_) {
    std::vector<cuda::DeviceRow> drows(R);
    for (size_t r = 0; r < R; ++r)
      drows[r] = {&rows[r].sequence->device_kv, rows[r].sequence->variant, rows[r].token, pos[r], rows[r].want_logits};
    auto logits = device_->forward(drows);
    for (const auto& [s, p] : next_pos) s->length = p;
    return logits;
  }

  // Embeddings, per row from its variant's table.
  std::vector<float> x(R * H), h(R * H);
  for (size_t r = 0; r < R; ++r) {
    const auto& e = vw[r]->embed;
    to_f32(e.dtype, e.data.data() + size_t(rows[r].token) * H * dtype_size(e.dtype), &x[r * H], H);
  }

  std::vector<const TensorView*> weight(R);
  std::vector<DeltaRef> deltas(R);
  std::vector<const std::vector<float>*> bias(R);
  auto linear = [&](size_t layer, int kind, const std::vector<float>& in, size_t K, std::vector<float>& out, size_t N) {
    for (size_t r = 0; r < R; ++r) {
      const auto& L = vw[r]->layers[layer];
      weight[r] = &L.linear[size_t(kind)];
      deltas[r] = L.delta[size_t(kind)];
      bias[r] = &L.bias[size_t(kind)];
    }
    grouped_linear(weight, deltas, bias, in, K, out, N, *pool_);
  };

  std::vector<float> q, k, v, attn(R * qdim), o, gate, up, down;
  const float scale = 1.0f / std::sqrt(float(hd));
  const size_t group = c.heads / c.kv_heads;
  for (size_t l = 0; l < c.layers; ++l) {
    for (size_t r = 0; r < R; ++r)
      cpu::rmsnorm(&x[r * H], vw[r]->layers[l].attn_norm.data(), H, c.rms_eps, &h[r * H]);
    linear(l, kQ, h, H, q, qdim);
    linear(l, kK, h, H, k, kvdim);
    linear(l, kV, h, H, v, kvdim);
    for (size_t r = 0; r < R; ++r) {
      cpu::rope(&q[r * qdim], c.heads, hd, pos[r], inv_freq_);
      cpu::rope(&k[r * kvdim], c.kv_heads, hd, pos[r], inv_freq_);
      Sequence* s = rows[r].sequence;
      auto& keys = s->keys[l];
      auto& values = s->values[l];
      if (keys.size() < (pos[r] + 1) * kvdim) {
        keys.resize((pos[r] + 1) * kvdim);
        values.resize((pos[r] + 1) * kvdim);
      }
      std::memcpy(&keys[pos[r] * kvdim], &k[r * kvdim], kvdim * 4);
      std::memcpy(&values[pos[r] * kvdim], &v[r * kvdim], kvdim * 4);
    }
    pool_->parallel_for(R * c.heads, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        const size_t r = i / c.heads, head = i % c.heads;
        const Sequence* s = rows[r].sequence;
        cpu::attend(&q[r * qdim + head * hd], s->keys[l].data(), s->values[l].data(), pos[r] + 1, kvdim,
                    (head / group) * hd, hd, scale, &attn[r * qdim + head * hd]);
      }
    });
    linear(l, kO, attn, qdim, o, H);
    for (size_t i = 0; i < R * H; ++i) x[i] += o[i];
    for (size_t r = 0; r < R; ++r)
      cpu::rmsnorm(&x[r * H], vw[r]->layers[l].mlp_norm.data(), H, c.rms_eps, &h[r * H]);
    linear(l, kGate, h, H, gate, c.intermediate);
    linear(l, kUp, h, H, up, c.intermediate);
    cpu::swiglu(gate.data(), up.data(), gate.size());
    linear(l, kDown, gate, c.intermediate, down, H);
    for (size_t i = 0; i < R * H; ++i) x[i] += down[i];
  }
  for (const auto& [s, p] : next_pos) s->length = p;

  // Final norm and lm_head for the rows that want logits.
  std::vector<size_t> want;
  for (size_t r = 0; r < R; ++r)
    if (rows[r].want_logits) want.push_back(r);
  std::vector<float> hn(want.size() * H), logits;
  std::vector<const TensorView*> heads(want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    cpu::rmsnorm(&x[want[i] * H], vw[want[i]]->final_norm.data(), H, c.rms_eps, &hn[i * H]);
    heads[i] = &vw[want[i]]->lm_head;
  }
  if (!want.empty()) {
    const std::vector<DeltaRef> none(want.size());
    const std::vector<const std::vector<float>*> no_bias(want.size(), nullptr);
    grouped_linear(heads, none, no_bias, hn, H, logits, c.vocab_size, *pool_);
  }
  return logits;
}

}  // namespace bitdelta
