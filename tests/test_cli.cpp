// The CLI end to end: the happy path, and every bad input giving one line on stderr that names
// the file (and tensor), a non-zero exit, and no output left behind.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "backend/cuda/device_model.h"
#include "bitdelta/fingerprint.h"
#include "test_util.h"

namespace bitdelta {
namespace {

using test::TempDir;
namespace fs = std::filesystem;

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = test::tiny_llama(DType::BF16, 40);
    test::write_checkpoint(dir_ / "base", base_);
    test::write_checkpoint(dir_ / "ft", test::fine_tune_of(base_, 41));
    fs::create_directories(dir_ / "out");
    fs::create_directories(dir_ / "scratch");
  }
  test::CommandResult run(const std::string& args) { return test::run_cli(args, dir_ / "scratch"); }
  std::string p(const std::string& rel) { return (dir_ / rel).string(); }

  // A failing command: non-zero exit, exactly one line on stderr containing every `needle`,
  // and the output directory left empty (no file, no temp file).
  void expect_failure(const std::string& args, const std::vector<std::string>& needles) {
    const auto r = run(args);
    EXPECT_NE(r.exit_code, 0) << args;
    ASSERT_FALSE(r.err.empty()) << args;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    for (const auto& n : needles) EXPECT_NE(r.err.find(n), std::string::npos) << "missing '" << n << "' in: " << r.err;
    EXPECT_TRUE(fs::is_empty(dir_ / "out")) << args;
  }

  TempDir dir_;
  test::TensorMap base_;
};

TEST_F(Cli, CompressInspectApply) {
  auto r = run("compress " + p("base") + " " + p("ft") + " -o " + p("out/v.bitdelta") + " --threads 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("14 weights compressed to 1 bit"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("median"), std::string::npos);
  EXPECT_NE(r.out.find("worst"), std::string::npos);
  EXPECT_TRUE(r.err.empty()) << r.err;  // not a terminal: no progress bar

  r = run("inspect --json " + p("out/v.bitdelta"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["kind"], "bitdelta");
  EXPECT_EQ(j["format_version"], "1");
  EXPECT_EQ(j["alpha_mode"], "row");
  EXPECT_EQ(j["base_fingerprint"], fingerprint(Checkpoint(dir_ / "base")));
  EXPECT_EQ(j["compressed"].size(), 14u);
  EXPECT_EQ(j["whole"].size(), 1u);
  EXPECT_GT(j["alpha"]["max"].get<double>(), 0.0);

  r = run("inspect " + p("out/v.bitdelta"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("model.layers.1.mlp.down_proj.weight"), std::string::npos);

  r = run("inspect --json " + p("base"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto c = nlohmann::json::parse(r.out);
  EXPECT_EQ(c["kind"], "checkpoint");
  EXPECT_EQ(c["architecture"], "LlamaForCausalLM");
  EXPECT_EQ(c["tensors"].size(), base_.size());

  r = run("apply " + p("base") + " " + p("out/v.bitdelta") + " -o " + p("out/variant"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(is_checkpoint_dir(dir_ / "out/variant"));
  EXPECT_TRUE(fs::exists(dir_ / "out/variant/tokenizer_config.json"));
}

TEST_F(Cli, BadSafetensorsFiles) {
  const auto st = dir_ / "base" / "model.safetensors";
  const std::string good = test::read_file(st);
  auto corrupt = [&](const std::string& bytes) { test::write_text(st, bytes); };
  const std::string cmd = "compress " + p("base") + " " + p("ft") + " -o " + p("out/v.bitdelta");

  corrupt(good.substr(0, good.size() - 100));  // truncated data
  expect_failure(cmd, {st.string(), "tensor '", "lie outside the data section"});
  corrupt(good.substr(0, 5));
  expect_failure(cmd, {st.string(), "truncated"});

  std::string big = good;
  big[0] = char(0xff), big[1] = char(0xff), big[2] = char(0x0f);
  corrupt(big);
  expect_failure(cmd, {st.string(), "header length", "exceeds file size"});

  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | uint8_t(good[size_t(i)]);
  std::string header = good.substr(8, hlen);
  // The same data section under another header (offsets are relative to the data section).
  auto with_header = [&](std::string h) {
    h.append((8 - h.size() % 8) % 8, ' ');
    std::string len(8, '\0');
    for (int i = 0; i < 8; ++i) len[size_t(i)] = char((h.size() >> (8 * i)) & 0xff);
    return len + h + good.substr(8 + hlen);
  };
  // Lying offsets: point the embedding at bytes past the end of the data.
  {
    auto j = nlohmann::json::parse(header);
    auto& e = j["model.embed_tokens.weight"]["data_offsets"];
    const uint64_t size = good.size() - 8 - hlen;
    e = {size - 4, size - 4 + (e[1].get<uint64_t>() - e[0].get<uint64_t>())};
    corrupt(with_header(j.dump()));
    expect_failure(cmd, {st.string(), "tensor 'model.embed_tokens.weight'", "outside the data section"});
  }
  // Overlap: q_proj of layer 0 moved onto k_proj's bytes.
  {
    auto j = nlohmann::json::parse(header);
    j["model.layers.0.self_attn.q_proj.weight"]["data_offsets"] = j["model.layers.0.self_attn.k_proj.weight"]["data_offsets"];
    corrupt(with_header(j.dump()));
    expect_failure(cmd, {st.string(), "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight", "overlap"});
  }
  // Unknown dtype.
  {
    auto j = nlohmann::json::parse(header);
    j["model.norm.weight"]["dtype"] = "BF17";
    corrupt(with_header(j.dump()));
    expect_failure(cmd, {st.string(), "tensor 'model.norm.weight'", "unknown dtype 'BF17'"});
  }
  corrupt(with_header("{\"a\": "));
  expect_failure(cmd, {st.string(), "not valid JSON"});
}

TEST_F(Cli, BaseAndFineTuneDoNotMatch) {
  const std::string out = " -o " + p("out/v.bitdelta");
  // Shape mismatch (a resized embedding).
  auto ft = test::fine_tune_of(base_, 42);
  ft["model.embed_tokens.weight"] = test::HostTensor::from_floats(DType::BF16, {18, 13}, test::random_floats(18 * 13, 1));
  test::write_checkpoint(dir_ / "ft_shape", ft);
  expect_failure("compress " + p("base") + " " + p("ft_shape") + out,
                 {p("ft_shape/model.safetensors"), "tensor 'model.embed_tokens.weight'", "shape [18, 13]", "[17, 13]"});
  // Dtype mismatch.
  ft = test::fine_tune_of(base_, 43);
  ft["model.layers.1.mlp.up_proj.weight"] =
      test::HostTensor::from_floats(DType::F32, {21, 13}, ft["model.layers.1.mlp.up_proj.weight"].floats());
  test::write_checkpoint(dir_ / "ft_dtype", ft);
  expect_failure("compress " + p("base") + " " + p("ft_dtype") + out,
                 {"ft_dtype", "tensor 'model.layers.1.mlp.up_proj.weight'", "dtype F32", "BF16"});
  // Missing tensor.
  ft = test::fine_tune_of(base_, 44);
  ft.erase("lm_head.weight");
  test::write_checkpoint(dir_ / "ft_missing", ft);
  expect_failure("compress " + p("base") + " " + p("ft_missing") + out, {p("ft_missing"), "tensor 'lm_head.weight'", "missing"});
  // Not a checkpoint.
  fs::create_directories(dir_ / "empty");
  expect_failure("compress " + p("base") + " " + p("empty") + out, {p("empty"), "no config.json"});
  expect_failure("compress " + p("nowhere") + " " + p("ft") + out, {p("nowhere"), "not a directory"});
}

TEST_F(Cli, UnwritableOutputAndWrongBase) {
  test::write_text(dir_ / "scratch" / "a_file", "x");
  expect_failure("compress " + p("base") + " " + p("ft") + " -o " + p("scratch/a_file/v.bitdelta"),
                 {p("scratch/a_file/v.bitdelta"), "cannot create"});
  ASSERT_EQ(run("compress " + p("base") + " " + p("ft") + " -o " + p("scratch/v.bitdelta")).exit_code, 0);

  test::write_checkpoint(dir_ / "other", test::tiny_llama(DType::BF16, 99));
  const std::string right = fingerprint(Checkpoint(dir_ / "base"));
  const std::string wrong = fingerprint(Checkpoint(dir_ / "other"));
  expect_failure("apply " + p("other") + " " + p("scratch/v.bitdelta") + " -o " + p("out/variant"),
                 {p("scratch/v.bitdelta"), right, wrong, "--force"});
  expect_failure("apply " + p("base") + " " + p("scratch/v.bitdelta") + " -o " + p("scratch/a_file/variant"),
                 {"scratch/a_file/variant"});
  expect_failure("apply " + p("base") + " " + p("base/model.safetensors") + " -o " + p("out/variant"),
                 {p("base/model.safetensors"), "not a bitdelta delta file"});
  expect_failure("inspect " + p("missing.bitdelta"), {p("missing.bitdelta"), "cannot open"});
  const auto r = run("apply " + p("other") + " " + p("scratch/v.bitdelta") + " -o " + p("out/forced") + " --force");
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

// Bad arguments are refused in one line naming the option (or the unknown subcommand), before
// anything is loaded. Among them counts below their least value and a port above its greatest:
// the argument parser read -1 as 2^64 - 1 (a pool of that many threads never started;
// --max-tokens -1 had no limit), and a JSON config's -1 or 2.5 converted the same way.
TEST_F(Cli, BadArgumentsAreRefusedInOneLine) {
  const std::string gen = "generate " + p("base") + " --prompt-tokens 1,2 ";
  expect_failure(gen + "--threads -1", {"--threads", "must not be negative", "-1"});
  expect_failure(gen + "--max-tokens -3", {"--max-tokens", "must not be negative", "-3"});
  expect_failure(gen + "--max-tokens 0", {"--max-tokens must be at least 1"});
  expect_failure(
      "compress " + p("base") + " " + p("ft") + " -o " + p("out/v.bitdelta") + " --threads -2",
      {"--threads", "must not be negative"});
  expect_failure("serve " + p("base") + " --max-running -1",
                 {"--max-running", "must not be negative"});
  expect_failure("serve " + p("base") + " --port 70000", {"--port", "70000", "65535"});
  expect_failure("serve " + p("base") + " --prefix-cache-bytes 5X",
                 {"--prefix-cache-bytes", "unknown unit in '5X'"});
  expect_failure("bench serve --output-len 0 --url http://127.0.0.1:1",
                 {"--output-len must be >= 1"});
  expect_failure("compres " + p("base"), {"unknown subcommand 'compres'", "compress, inspect"});
  // A config file's counts, with a missing base: a count let through would fail on that instead.
  const std::pair<const char*, nlohmann::json> bad[] = {
      {"threads", -1},      {"max_running", 2.5}, {"max_queue", "8"},
      {"http_threads", -4}, {"port", 70000},      {"allowed_origins", "http://a.example"}};
  for (const auto& [field, value] : bad) {
    const fs::path config = dir_ / "scratch" / "serve.json";
    test::write_text(config, nlohmann::json{{"base", p("missing")}, {field, value}}.dump());
    expect_failure("serve --config " + config.string(), {config.string(), field});
  }
  const fs::path demo = fs::path(BITDELTA_SOURCE_DIR) / "models" / "demo" / "base";
  if (!fs::exists(demo)) GTEST_SKIP() << "models/demo is missing";
  // Past the pool's limit (every parallel loop wakes every thread: 100000 never finished a step).
  expect_failure("generate " + demo.string() + " --prompt-tokens 1,2 --threads 5000",
                 {"5000 compute threads asked for; at most 1024"});
  expect_failure("serve " + demo.string() + " --http-threads 5000",
                 {"http_threads is 5000; at most 4096"});
  // The least values are taken.
  const auto ok =
      run("generate " + demo.string() + " --prompt-tokens 1,2 --max-tokens 1 --threads 1 --json");
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_EQ(nlohmann::json::parse(ok.out)["tokens"].size(), 1u) << ok.out;
}

// Where no CUDA device can be used (this build without CUDA, or no GPU), --device cuda is one line
// naming the reason; a malformed --device names what it accepts.
TEST_F(Cli, DeviceOptionWithoutAGpu) {
  const std::string base = (fs::path(BITDELTA_SOURCE_DIR) / "models" / "demo" / "base").string();
  if (!fs::exists(base)) GTEST_SKIP() << "models/demo is missing";
  if (cuda::unavailable_reason().empty())
    GTEST_SKIP() << "a CUDA device is usable here (tests/gpu cover it)";
  for (const char* cmd :
       {"score BASE --tokens 1,2,3", "generate BASE --prompt-tokens 1,2 --max-tokens 2"}) {
    std::string args = cmd;
    args.replace(args.find("BASE"), 4, base);
    expect_failure(args + " --device cuda", {"--device cuda", cuda::unavailable_reason()});
    expect_failure(args + " --device tpu", {"--device", "'tpu'", "cpu, cuda or cuda:N"});
    // --cuda-graphs is on or off (on the CPU it changes nothing); anything else is refused naming
    // it (as the argument parser refuses a bad value of any option: the message, then where help
    // is).
    const auto off = run(args + " --cuda-graphs off");
    EXPECT_EQ(off.exit_code, 0) << off.err;
    const auto bad = run(args + " --cuda-graphs maybe");
    EXPECT_NE(bad.exit_code, 0);
    EXPECT_NE(bad.err.find("--cuda-graphs = maybe"), std::string::npos) << bad.err;
  }
}

}  // namespace
}  // namespace bitdelta
