#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "bitdelta/apply.h"
#include "bitdelta/compress.h"
#include "bitdelta/error.h"
#include "bitdelta/fingerprint.h"
#include "delta/compress_kernel.h"
#include "test_util.h"

namespace bitdelta {
namespace {

using test::TempDir;
namespace fs = std::filesystem;

// The float64 reference of one weight: signs (one bool per element) and α per row or tensor.
struct Reference {
  std::vector<bool> sign;  // Δ >= 0
  std::vector<float> alpha;
  double rel_error;
};

Reference reference(const test::HostTensor& base, const test::HostTensor& ft, AlphaMode mode) {
  const auto b = base.floats(), f = ft.floats();
  const uint64_t rows = base.shape[0], cols = base.shape[1];
  Reference r;
  std::vector<double> delta(b.size());
  for (size_t i = 0; i < b.size(); ++i) {
    delta[i] = double(f[i] - b[i]);  // Δ = float32(W_ft) − float32(W_base), as the format defines
    r.sign.push_back(delta[i] >= 0);
  }
  auto mean_abs = [&](size_t from, size_t n) {
    double s = 0;
    for (size_t i = from; i < from + n; ++i) s += std::fabs(delta[i]);
    return n ? s / double(n) : 0.0;
  };
  if (mode == AlphaMode::Row)
    for (uint64_t row = 0; row < rows; ++row) r.alpha.push_back(float(mean_abs(row * cols, cols)));
  else
    r.alpha.push_back(float(mean_abs(0, delta.size())));
  double err = 0, norm = 0;
  for (size_t i = 0; i < delta.size(); ++i) {
    const double a = r.alpha[mode == AlphaMode::Row ? i / cols : 0];
    const double e = delta[i] - (r.sign[i] ? a : -a);
    err += e * e;
    norm += delta[i] * delta[i];
  }
  r.rel_error = norm > 0 ? std::sqrt(err / norm) : 0;
  return r;
}

TEST(CompressKernel, MatchesFloat64ReferenceIncludingOddLengthsAndZeros) {
  for (size_t n : {1, 7, 8, 9, 13, 15, 16, 17, 31, 100, 4096, 4099}) {
    auto base = test::random_floats(n, n);
    auto ft = test::random_floats(n, n + 1000, 0.01f);
    for (size_t i = 0; i < n; ++i) ft[i] = i % 5 == 2 ? base[i] : base[i] + ft[i];  // Δ = 0 at every 5th
    std::vector<uint8_t> fast((n + 7) / 8, 0xAA), plain((n + 7) / 8, 0x55);
    const RowSums s_fast = compress_row(base.data(), ft.data(), n, fast.data());
    const RowSums s_plain = compress_row_scalar(base.data(), ft.data(), n, plain.data());
    EXPECT_EQ(fast, plain) << n;
    double ref_abs = 0, ref_sq = 0;
    for (size_t i = 0; i < n; ++i) {
      const double d = double(ft[i] - base[i]);
      ref_abs += std::fabs(d);
      ref_sq += d * d;
      const bool bit = (fast[i / 8] >> (i % 8)) & 1;
      ASSERT_EQ(bit, d >= 0) << "n=" << n << " i=" << i;  // Δ = 0 maps to +1
    }
    for (size_t i = n; i < fast.size() * 8; ++i) EXPECT_EQ((fast[i / 8] >> (i % 8)) & 1, 0) << "padding bit " << i;
    EXPECT_NEAR(s_fast.abs, ref_abs, 1e-12 * ref_abs);
    EXPECT_NEAR(s_fast.sq, ref_sq, 1e-12 * ref_sq);
    EXPECT_NEAR(s_plain.abs, ref_abs, 1e-12 * ref_abs);
  }
}

TEST(CompressKernel, SignPackingRoundTrip) {
  // Every byte value: build a Δ whose signs spell the byte, pack, and read it back.
  for (int v = 0; v < 256; ++v) {
    float base[8], ft[8];
    for (int j = 0; j < 8; ++j) {
      base[j] = 1.0f;
      ft[j] = (v >> j) & 1 ? 1.5f : 0.5f;
    }
    uint8_t packed = 0;
    compress_row(base, ft, 8, &packed);
    EXPECT_EQ(packed, v);
  }
}

struct CompressCase {
  DType dtype;
  AlphaMode mode;
  int shards;
};

class CompressEndToEnd : public ::testing::TestWithParam<CompressCase> {};

TEST_P(CompressEndToEnd, MatchesReferenceAndApplyReconstructsBitForBit) {
  const auto [dtype, mode, shards] = GetParam();
  TempDir dir;
  const auto base = test::tiny_llama(dtype, 10);
  const auto ft = test::fine_tune_of(base, 20);
  test::write_checkpoint(dir / "base", base, shards);
  test::write_checkpoint(dir / "ft", ft, 1);
  const Checkpoint cb(dir / "base"), cf(dir / "ft");

  CompressOptions opt;
  opt.alpha_mode = mode;
  opt.threads = 2;
  const auto report = compress(cb, cf, dir / "out.bitdelta", opt);
  EXPECT_EQ(report.compressed, 14u);  // 2 layers x 7 linears
  EXPECT_EQ(report.whole, 1u);        // model.norm.weight
  EXPECT_EQ(report.omitted, 6u);      // embeddings, lm_head, 4 layer norms

  const DeltaFile delta(dir / "out.bitdelta");
  EXPECT_EQ(delta.meta("format"), "bitdelta");
  EXPECT_EQ(delta.meta("format_version"), "1");
  EXPECT_EQ(delta.base_fingerprint(), fingerprint(cb));
  EXPECT_EQ(delta.meta("finetuned_fingerprint"), fingerprint(cf));
  EXPECT_EQ(delta.meta("alpha_source"), "mean_abs");
  EXPECT_EQ(delta.alpha_mode(), mode);
  EXPECT_EQ(delta.meta("architecture"), "LlamaForCausalLM");
  ASSERT_EQ(delta.compressed().size(), 14u);
  ASSERT_EQ(delta.whole().size(), 1u);
  EXPECT_EQ(delta.whole()[0].name, "model.norm.weight");
  EXPECT_NO_THROW(delta.check_against(cb));
  // The layout (docs/FORMAT.md): every α first, then the signs and whole tensors, back to back.
  {
    uint64_t alpha_end = 0, rest_begin = UINT64_MAX;
    for (const auto& t : delta.file().tensors()) {
      if (t.name.ends_with(kAlphaSuffix)) alpha_end = std::max(alpha_end, t.end);
      else rest_begin = std::min(rest_begin, t.begin);
    }
    EXPECT_GT(alpha_end, 0u);
    EXPECT_EQ(alpha_end, rest_begin);
  }

  std::map<std::string, Reference> refs;
  for (size_t i = 0; i < delta.compressed().size(); ++i) {
    const auto& w = delta.compressed()[i];
    const auto ref = reference(base.at(w.name), ft.at(w.name), mode);
    const uint64_t cols = base.at(w.name).shape[1];
    ASSERT_EQ(w.signs.shape, (Shape{base.at(w.name).shape[0], (cols + 7) / 8})) << w.name;
    for (uint64_t r = 0; r < w.out(); ++r) {
      for (uint64_t c = 0; c < w.row_bytes() * 8; ++c) {
        const bool bit = (w.sign_row(r)[c / 8] >> (c % 8)) & 1;
        ASSERT_EQ(bit, c < cols && ref.sign[r * cols + c]) << w.name << " " << r << "," << c;
      }
      EXPECT_FLOAT_EQ(w.alpha_of(r), ref.alpha[mode == AlphaMode::Row ? r : 0]) << w.name << " row " << r;
    }
    EXPECT_EQ(report.errors[i].name, w.name);
    EXPECT_NEAR(report.errors[i].rel_error, ref.rel_error, 1e-6) << w.name;
    refs[w.name] = ref;
  }

  ApplyOptions aopt;
  aopt.threads = 2;
  apply_delta(cb, delta, dir / "variant", aopt);
  const Checkpoint variant(dir / "variant");
  EXPECT_EQ(variant.shard_names(), cb.shard_names());
  EXPECT_EQ(test::read_file(dir / "variant" / "tokenizer_config.json"), test::read_file(dir / "base" / "tokenizer_config.json"));
  EXPECT_EQ(variant.tensor_names(), cb.tensor_names());
  for (const auto& name : cb.tensor_names()) {
    const auto got = variant.tensor(name);
    EXPECT_EQ(got.dtype, dtype);
    std::vector<std::byte> expect;
    if (auto it = refs.find(name); it != refs.end()) {
      // W_eff = round(float32(W_base) + α·S), written out by the test itself.
      const auto b = base.at(name).floats();
      const uint64_t cols = base.at(name).shape[1];
      std::vector<float> w(b.size());
      for (size_t i = 0; i < b.size(); ++i) {
        const float a = it->second.alpha[mode == AlphaMode::Row ? i / cols : 0];
        w[i] = b[i] + (it->second.sign[i] ? a : -a);
      }
      expect = test::HostTensor::from_floats(dtype, base.at(name).shape, w).bytes;
    } else {
      expect = ft.at(name).bytes;  // whole or unchanged parameters: the fine-tune's exact bytes
    }
    ASSERT_EQ(got.data.size(), expect.size()) << name;
    EXPECT_EQ(std::memcmp(got.data.data(), expect.data(), expect.size()), 0) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CompressEndToEnd,
                         ::testing::Values(CompressCase{DType::BF16, AlphaMode::Row, 1},
                                           CompressCase{DType::BF16, AlphaMode::Tensor, 2},
                                           CompressCase{DType::F16, AlphaMode::Row, 3},
                                           CompressCase{DType::F32, AlphaMode::Tensor, 1}),
                         [](const auto& info) {
                           return std::string(dtype_name(info.param.dtype)) + "_" +
                                  std::string(alpha_mode_name(info.param.mode)) + "_" +
                                  std::to_string(info.param.shards) + "shards";
                         });

TEST(Compress, IsBlockLinearRule) {
  TensorInfo two_d{"", DType::BF16, {4, 4}}, one_d{"", DType::BF16, {4}}, ints{"", DType::I32, {4, 4}};
  EXPECT_TRUE(is_block_linear("model.layers.0.self_attn.q_proj.weight", two_d));
  EXPECT_TRUE(is_block_linear("model.layers.31.mlp.down_proj.weight", two_d));
  EXPECT_TRUE(is_block_linear("transformer.h.3.attn.c_attn.weight", two_d));
  EXPECT_FALSE(is_block_linear("model.layers.0.input_layernorm.weight", one_d));
  EXPECT_FALSE(is_block_linear("model.embed_tokens.weight", two_d));
  EXPECT_FALSE(is_block_linear("lm_head.weight", two_d));
  EXPECT_FALSE(is_block_linear("model.layers.0.self_attn.q_proj.bias", one_d));
  EXPECT_FALSE(is_block_linear("model.layers.0.mlp.up_proj.weight", ints));
}

TEST(Compress, IdenticalCheckpointsGiveZeroAlphaAndNoWholeTensors) {
  TempDir dir;
  const auto m = test::tiny_llama(DType::BF16, 5, 1);
  test::write_checkpoint(dir / "a", m);
  test::write_checkpoint(dir / "b", m);
  const auto report = compress(Checkpoint(dir / "a"), Checkpoint(dir / "b"), dir / "d.bitdelta");
  EXPECT_EQ(report.whole, 0u);
  const DeltaFile d(dir / "d.bitdelta");
  for (const auto& w : d.compressed())
    for (uint64_t r = 0; r < w.out(); ++r) EXPECT_EQ(w.alpha_of(r), 0.0f);
  for (const auto& e : report.errors) EXPECT_EQ(e.rel_error, 0.0);
}

TEST(Compress, RefusesNaN) {
  TempDir dir;
  auto m = test::tiny_llama(DType::F32, 6, 1);
  test::write_checkpoint(dir / "a", m);
  auto v = m["model.layers.0.mlp.up_proj.weight"].floats();
  v[3] = NAN;
  m["model.layers.0.mlp.up_proj.weight"] = test::HostTensor::from_floats(DType::F32, {21, 13}, v);
  test::write_checkpoint(dir / "b", m);
  try {
    compress(Checkpoint(dir / "a"), Checkpoint(dir / "b"), dir / "d.bitdelta");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'model.layers.0.mlp.up_proj.weight': base or fine-tune holds NaN"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(dir / "d.bitdelta"));
}

// A delta file written by hand (not by the compressor) for format validation.
std::string delta_error(const fs::path& path, const test::TensorMap& tensors, Metadata md) {
  test::write_safetensors(path, tensors, md);
  try {
    DeltaFile d(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(DeltaFile, ValidatesStructure) {
  TempDir dir;
  const Metadata md{{"format", "bitdelta"}, {"format_version", "1"}, {"base_fingerprint", "x"}, {"alpha_mode", "row"}};
  const test::HostTensor sign{DType::U8, {4, 2}, std::vector<std::byte>(8)};
  const auto alpha4 = test::HostTensor::from_floats(DType::F32, {4}, {1, 2, 3, 4});
  const auto alpha1 = test::HostTensor::from_floats(DType::F32, {1}, {1});
  const auto path = dir / "d.bitdelta";
  EXPECT_EQ(delta_error(path, {{"w.sign", sign}, {"w.alpha", alpha4}}, md), "");
  EXPECT_NE(delta_error(path, {{"w.sign", sign}}, md).find("tensor 'w.sign': has no matching 'w.alpha'"), std::string::npos);
  EXPECT_NE(delta_error(path, {{"w.alpha", alpha4}}, md).find("tensor 'w.alpha': has no matching 'w.sign'"), std::string::npos);
  EXPECT_NE(delta_error(path, {{"w.sign", sign}, {"w.alpha", alpha1}}, md).find("alpha must be F32 [4]"), std::string::npos);
  auto bad_sign = sign;
  bad_sign.dtype = DType::I8;
  EXPECT_NE(delta_error(path, {{"w.sign", bad_sign}, {"w.alpha", alpha4}}, md).find("sign bits must be U8"), std::string::npos);
  auto md_tensor = md;
  md_tensor["alpha_mode"] = "tensor";
  EXPECT_EQ(delta_error(path, {{"w.sign", sign}, {"w.alpha", alpha1}}, md_tensor), "");
  md_tensor["alpha_mode"] = "column";
  EXPECT_NE(delta_error(path, {{"w.sign", sign}, {"w.alpha", alpha1}}, md_tensor).find("unknown alpha mode 'column'"), std::string::npos);
  auto md_v2 = md;
  md_v2["format_version"] = "2";
  EXPECT_NE(delta_error(path, {}, md_v2).find("unsupported bitdelta format_version '2'"), std::string::npos);
  EXPECT_NE(delta_error(path, {}, {{"format", "pt"}}).find("not a bitdelta delta file"), std::string::npos);
  const auto nan_alpha = test::HostTensor::from_floats(DType::F32, {4}, {1, NAN, 3, 4});
  EXPECT_NE(delta_error(path, {{"w.sign", sign}, {"w.alpha", nan_alpha}}, md).find("alpha[1] is not finite"), std::string::npos);
}

TEST(Apply, RefusesAnotherBaseUnlessForced) {
  TempDir dir;
  const auto base = test::tiny_llama(DType::BF16, 30, 1);
  const auto other = test::tiny_llama(DType::BF16, 31, 1);  // same shapes, other weights
  test::write_checkpoint(dir / "base", base);
  test::write_checkpoint(dir / "other", other);
  test::write_checkpoint(dir / "ft", test::fine_tune_of(base, 32));
  compress(Checkpoint(dir / "base"), Checkpoint(dir / "ft"), dir / "d.bitdelta");
  const DeltaFile d(dir / "d.bitdelta");
  const Checkpoint wrong(dir / "other");
  try {
    apply_delta(wrong, d, dir / "out");
    FAIL();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(d.base_fingerprint()), std::string::npos) << msg;
    EXPECT_NE(msg.find(fingerprint(wrong)), std::string::npos) << msg;
  }
  EXPECT_FALSE(fs::exists(dir / "out"));
  ApplyOptions force;
  force.force = true;
  apply_delta(wrong, d, dir / "out", force);
  EXPECT_TRUE(is_checkpoint_dir(dir / "out"));
  // A non-empty output directory is never overwritten.
  EXPECT_THROW(apply_delta(Checkpoint(dir / "base"), d, dir / "out"), Error);
}

}  // namespace
}  // namespace bitdelta
