// The whole forward pass on the device (Model with Device::Cuda) against the demo family's fixtures
// and against the CPU backend; the engine on the device with deltas moving between the GPU tier,
// the pinned host tier and disk.
//
// Bound: the device rounds the input of every linear layer to bf16 (2⁻⁹ relative, ~0.1% rms) and
// keeps the KV cache in bf16; the rest is float32. A variant's run of ≥ 17 rows, or ≥ 2 where they
// are all the step's rows (on sm_90a W_eff formed in the streaming kernel up to 32 rows, else the
// fused GEMM; 48 on a GPU without it), also rounds W_eff = W + α·S to bf16 (as an applied bf16
// checkpoint is rounded): the prompts below go that way. Every logit is a dot product of
// the final hidden state (29 rounded linear inputs upstream of it on the demo model) with a row of the
// embedding, so its error scales with the size of the logits, not its own value: measured up to
// 0.078 through the fused kernels and 0.195 (on a log-prob of −7.8) with W_eff in bf16. The bound is
// tolerance(ref) = 0.1 + 0.02·|ref| (the CPU's own bound against PyTorch is 2e-4); a wrong or missing
// delta moves these values by whole units (the mixed step checks that of its variants' rows).
// Greedy continuations are compared until a step whose top-2 margin is under 0.25, where either
// token is right.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>

#include "backend/cuda/device_model.h"
#include "bitdelta/compress.h"
#include "bitdelta/engine.h"
#include "bitdelta/error.h"
#include "bitdelta/generate.h"
#include "bitdelta/model.h"
#include "bitdelta/tokenizer.h"
#include "test_util.h"

namespace bitdelta {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// BITDELTA_SOURCE_DIR in the environment overrides the build's (binaries run from another checkout).
const fs::path kRoot = std::getenv("BITDELTA_SOURCE_DIR") ? std::getenv("BITDELTA_SOURCE_DIR") : BITDELTA_SOURCE_DIR;
const fs::path kDemo = kRoot / "models" / "demo";
const fs::path kFixtures = kRoot / "tests" / "fixtures" / "reference";
double tolerance(double ref) { return 0.1 + 0.02 * std::abs(ref); }
constexpr double kGpuTieMargin = 0.25;

json load(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

ModelOptions on_cuda() {
  ModelOptions o;
  o.device = Device::Cuda;
  o.threads = 4;
  return o;
}

class GpuModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!cuda::unavailable_reason().empty() || !fs::exists(kDemo / "base" / "config.json")) return;
    deltas_ = new test::TempDir();
    for (const char* v : {"coder", "math", "writer", "legal"})
      for (AlphaMode mode : {AlphaMode::Row, AlphaMode::Tensor}) {
        CompressOptions o;
        o.alpha_mode = mode;
        compress(Checkpoint(kDemo / "base"), Checkpoint(kDemo / v), delta(v, mode), o);
      }
  }
  static void TearDownTestSuite() {
    delete deltas_;
    deltas_ = nullptr;
  }
  void SetUp() override {
    if (const auto why = cuda::unavailable_reason(); !why.empty()) GTEST_SKIP() << why;
    if (!deltas_) GTEST_SKIP() << "models/demo is missing";
  }
  static fs::path delta(const std::string& v, AlphaMode mode) {
    return (*deltas_) / (v + "_" + std::string(alpha_mode_name(mode)) + ".bitdelta");
  }
  static test::TempDir* deltas_;
};
test::TempDir* GpuModel::deltas_ = nullptr;

TEST_F(GpuModel, FixturesOfEveryModelOfTheDemoFamily) {
  const json prompts = load(kFixtures / "prompts.json")["prompts"];
  const Tokenizer tokenizer(kDemo / "base");
  double worst = 0;
  size_t compared_greedy = 0, greedy_total = 0;
  for (const std::string name : {"base", "coder", "math", "writer", "legal", "coder_bitdelta_row",
                                 "coder_bitdelta_tensor", "math_bitdelta_row", "math_bitdelta_tensor",
                                 "writer_bitdelta_row", "writer_bitdelta_tensor", "legal_bitdelta_row",
                                 "legal_bitdelta_tensor"}) {
    const json fx = load(kFixtures / ("model_" + name + ".json"));
    const std::string kind = fx["kind"];
    std::unique_ptr<Model> model;
    int id = 0;
    if (kind == "full") {
      model = std::make_unique<Model>(kDemo / fx["variant"].get<std::string>(), on_cuda());
    } else {
      model = std::make_unique<Model>(kDemo / "base", on_cuda());
      if (kind == "bitdelta")
        id = model->add_variant("v", delta(fx["variant"].get<std::string>(),
                                           fx["alpha_mode"] == "row" ? AlphaMode::Row : AlphaMode::Tensor));
    }
    for (size_t p = 0; p < prompts.size(); ++p) {
      const auto& res = fx["results"][p];
      const auto ids = prompts[p]["ids"].get<std::vector<int32_t>>();
      const std::string where = name + " / " + prompts[p]["name"].get<std::string>();
      const auto scored = score(*model, id, ids);
      const auto want_lp = res["prompt_logprobs"].get<std::vector<double>>();
      ASSERT_EQ(scored.prompt_logprobs.size(), want_lp.size()) << where;
      for (size_t i = 0; i < want_lp.size(); ++i) {
        worst = std::max(worst, std::abs(scored.prompt_logprobs[i] - want_lp[i]));
        EXPECT_NEAR(scored.prompt_logprobs[i], want_lp[i], tolerance(want_lp[i])) << where << " logprob " << i;
      }
      const auto top_ids = res["top20"]["ids"].get<std::vector<int32_t>>();
      const auto top_logits = res["top20"]["logits"].get<std::vector<double>>();
      for (size_t i = 0; i < top_ids.size(); ++i) {
        worst = std::max(worst, std::abs(scored.last_logits[size_t(top_ids[i])] - top_logits[i]));
        EXPECT_NEAR(scored.last_logits[size_t(top_ids[i])], top_logits[i], tolerance(top_logits[i]))
            << where << " top " << i;
      }
      SamplingParams greedy;
      greedy.temperature = 0;
      StopConditions stop;
      stop.max_tokens = 16;
      const auto gen = generate(*model, tokenizer, id, ids, greedy, stop);
      const auto want = res["greedy"]["ids"].get<std::vector<int32_t>>();
      const auto margins = res["greedy"]["margins"].get<std::vector<double>>();
      greedy_total += want.size();
      for (size_t k = 0; k < want.size(); ++k) {
        if (margins[k] < kGpuTieMargin) break;  // a near-tie: either token is right, and the rest differs
        ASSERT_LT(k, gen.tokens.size()) << where;
        EXPECT_EQ(gen.tokens[k], want[k]) << where << " greedy step " << k;
        if (gen.tokens[k] != want[k]) break;
        ++compared_greedy;
      }
    }
  }
  std::printf("  13 models: worst |gpu - fixture| %.2e over log-probs and top-20 logits; %zu of %zu greedy steps "
              "compared\n",
              worst, compared_greedy, greedy_total);
  EXPECT_GT(compared_greedy, greedy_total / 5);  // 633 of 2288 steps precede the first margin < 0.25
}

// One mixed step on the device of every plan's rows (each sequence fed its prompt before, alone),
// each sequence's logits against the CPU's of that sequence alone; and that the bound would catch a
// missing delta: the CPU's logits of each variant's row with the base's weights instead pass it at
// some logit.
struct MixedPlan {
  int variant;
  size_t prompt, step;  // prompt tokens fed before; tokens fed in the mixed step
};
void check_mixed_step(Model& gpu, Model& cpu, const std::vector<MixedPlan>& plans) {
  auto token = [](size_t seq, size_t pos) { return int32_t(5 + (seq * 131 + pos * 17) % 4000); };
  std::vector<Sequence> gs, cs;
  for (size_t s = 0; s < plans.size(); ++s) {
    gs.push_back(gpu.new_sequence(plans[s].variant));
    cs.push_back(cpu.new_sequence(plans[s].variant));
  }
  // Prompts first (on the GPU one step each, alone), then the mixed step.
  for (size_t s = 0; s < plans.size(); ++s) {
    std::vector<ForwardRow> g, c;
    for (size_t p = 0; p < plans[s].prompt; ++p) {
      g.push_back({&gs[s], token(s, p), false});
      c.push_back({&cs[s], token(s, p), false});
    }
    gpu.forward(g);
    cpu.forward(c);
  }
  std::vector<ForwardRow> mixed;
  for (size_t s = 0; s < plans.size(); ++s)
    for (size_t p = 0; p < plans[s].step; ++p)
      mixed.push_back({&gs[s], token(s, plans[s].prompt + p), p + 1 == plans[s].step});
  const auto got = gpu.forward(mixed);
  const size_t V = gpu.config().vocab_size;
  ASSERT_EQ(got.size(), plans.size() * V);
  double worst = 0, nearest_without_delta = 1e30;
  for (size_t s = 0; s < plans.size(); ++s) {
    std::vector<ForwardRow> alone;
    for (size_t p = 0; p < plans[s].step; ++p)
      alone.push_back({&cs[s], token(s, plans[s].prompt + p), p + 1 == plans[s].step});
    const auto want = cpu.forward(alone);
    ASSERT_EQ(want.size(), V);
    for (size_t i = 0; i < V; ++i) {
      worst = std::max(worst, double(std::abs(got[s * V + i] - want[i])));
      ASSERT_NEAR(got[s * V + i], want[i], tolerance(want[i])) << "sequence " << s << " (variant " << plans[s].variant
                                                          << ") logit " << i;
    }
    if (plans[s].variant == 0) continue;
    Sequence base = cpu.new_sequence(0);
    std::vector<ForwardRow> rows;
    for (size_t p = 0; p < plans[s].prompt + plans[s].step; ++p)
      rows.push_back({&base, token(s, p), p + 1 == plans[s].prompt + plans[s].step});
    const auto without = cpu.forward(rows);
    double apart = 0;  // in bounds
    for (size_t i = 0; i < V; ++i) apart = std::max(apart, std::abs(without[i] - want[i]) / tolerance(want[i]));
    nearest_without_delta = std::min(nearest_without_delta, apart);
    EXPECT_GT(apart, 1.0) << "sequence " << s << ": the base's logits within the bound of the variant's";
  }
  std::printf("  mixed step of %zu rows: worst |gpu - cpu| logit %.2e; a variant's row without its delta at least "
              "%.1f bounds away\n",
              mixed.size(), worst, nearest_without_delta);
}

// One device step with rows of four variants at different lengths — 20 decode rows, chunks of 11-12
// rows of three variants (with their decode rows 48 rows of variants with fewer than a GEMM's rows:
// more than one fused launch's 32, so the base of them goes through one GEMM and their delta terms
// through two launches), a 70-row prefill of one variant (a GEMM on W_eff) and a base prefill
// (cuBLAS) — gives each sequence the logits the CPU computes for it alone (so do the prompts before
// it, alone, through the caches they leave).
TEST_F(GpuModel, MixedStepMatchesEachSequenceAloneOnTheCpu) {
  Model gpu(kDemo / "base", on_cuda());
  Model cpu(kDemo / "base", 4);
  for (const char* n : {"coder", "math", "writer", "legal"}) {
    gpu.add_variant(n, delta(n, AlphaMode::Row));
    cpu.add_variant(n, delta(n, AlphaMode::Row));
  }
  std::vector<MixedPlan> plans;
  for (int i = 0; i < 20; ++i) plans.push_back({i % 5, size_t(3 + i), 1});  // decode rows
  // Chunks of prompts, 16 rows of each of these variants with their decode rows (and below): under
  // a GEMM's 17 rows.
  plans.push_back({1, 6, 12});
  plans.push_back({3, 7, 12});
  plans.push_back({4, 8, 11});
  plans.push_back({2, 0, 70});  // prefill of a variant (a run of 64 or more rows: attention on GEMMs)
  plans.push_back({0, 5, 35});                                               // prefill of the base
  // A decode row after a 28-row prompt of one variant alone: W_eff formed (the streaming or the
  // register kernel), or where the sm_90a kernels do not run the portable GEMM (from 25 rows).
  plans.push_back({4, 28, 1});
  check_mixed_step(gpu, cpu, plans);
}

// Decode steps of 3 to 32 rows of several variants, which take the base (the streaming kernel with no
// delta on sm_90a, else cuBLAS) beside the delta terms (a second stream) for all their rows; the
// consumers of each linear add its terms as they read it. With the base's rows among them and
// without, α per row and per tensor.
TEST_F(GpuModel, MixedDecodeStepsOfFewRowsMatchTheCpu) {
  for (AlphaMode mode : {AlphaMode::Row, AlphaMode::Tensor}) {
    Model gpu(kDemo / "base", on_cuda());
    Model cpu(kDemo / "base", 4);
    for (const char* n : {"coder", "math", "writer", "legal"}) {
      gpu.add_variant(n, delta(n, mode));
      cpu.add_variant(n, delta(n, mode));
    }
    for (const int rows : {3, 5, 16, 32}) {
      SCOPED_TRACE(testing::Message() << rows << " rows, alpha " << alpha_mode_name(mode));
      std::vector<MixedPlan> plans;
      for (int i = 0; i < rows; ++i) plans.push_back({rows == 3 ? 1 + i : i % 5, size_t(2 + i % 7), 1});
      check_mixed_step(gpu, cpu, plans);
    }
  }
}

// Decode steps replayed as CUDA graphs (a batch that stays is captured on its second step) give the
// logits of the same steps launched kernel by kernel, for every kind of step: one row (the one-row
// kernel), many rows of many variants (the base beside the delta terms on a second stream), a few and
// many rows of one variant (W_eff formed in the streaming kernel up to 32 rows, the fused GEMM past
// them) and of the base (the streaming kernel, cuBLAS past 32 rows); and after a variant is dropped
// and another installed (the graphs captured before address the old buffers and must not run).
TEST_F(GpuModel, DecodeStepsReplayedAsGraphsMatchStepsLaunchedOneByOne) {
  ModelOptions no = on_cuda();
  no.cuda_graphs = false;
  Model graphs(kDemo / "base", on_cuda());
  Model plain(kDemo / "base", no);
  std::vector<int> ids{0};
  for (const char* n : {"coder", "math", "writer", "legal"}) {
    ids.push_back(graphs.add_variant(n, delta(n, AlphaMode::Row)));
    ASSERT_EQ(plain.add_variant(n, delta(n, AlphaMode::Row)), ids.back());
  }
  const size_t V = graphs.config().vocab_size;
  double worst = 0;
  // The same kernels with the same inputs: equal up to the order of a sum split over blocks.
  auto expect_close = [&](const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < got.size(); ++i) {
      worst = std::max(worst, double(std::abs(got[i] - want[i])));
      ASSERT_NEAR(got[i], want[i], 1e-3 * (1 + std::abs(want[i]))) << what << ", row " << i / V << ", logit " << i % V;
    }
  };
  // Sequence s of `variants` gets a prompt of 3 + s tokens; then `steps` decode steps of all of them.
  auto run = [&](const std::string& name, const std::vector<int>& variants, size_t steps) {
    const cuda::GraphStats before = graphs.device_model()->graph_stats();
    std::vector<Sequence> gs, ps;
    for (int v : variants) {
      gs.push_back(graphs.new_sequence(v));
      ps.push_back(plain.new_sequence(v));
    }
    auto token = [](size_t seq, size_t pos) { return int32_t(7 + (seq * 389 + pos * 61) % 3000); };
    std::vector<size_t> pos(variants.size(), 0);
    for (size_t s = 0; s < variants.size(); ++s) {
      std::vector<ForwardRow> g, p;
      for (; pos[s] < 3 + s; ++pos[s]) {
        g.push_back({&gs[s], token(s, pos[s]), pos[s] == 2 + s});
        p.push_back({&ps[s], token(s, pos[s]), pos[s] == 2 + s});
      }
      expect_close(graphs.forward(g), plain.forward(p), name + ": prompt of sequence " + std::to_string(s));
    }
    for (size_t step = 0; step < steps; ++step) {
      std::vector<ForwardRow> g, p;
      for (size_t s = 0; s < variants.size(); ++s) {
        g.push_back({&gs[s], token(s, pos[s]), true});
        p.push_back({&ps[s], token(s, pos[s]), true});
        ++pos[s];
      }
      const auto got = graphs.forward(g);
      ASSERT_EQ(got.size(), variants.size() * V);
      expect_close(got, plain.forward(p), name + ": step " + std::to_string(step));
    }
    // Step 0 follows another batch (the last prompt); step 1 is captured (or step 2, where step 0
    // grew a buffer), the rest replay.
    EXPECT_GE(graphs.device_model()->graph_stats().replayed - before.replayed, steps - 3) << name;
  };
  std::vector<int> mixed, one, base;
  for (int i = 0; i < 12; ++i) {
    mixed.push_back(ids[size_t(i % 5)]);
    one.push_back(ids[3]);
    base.push_back(0);
  }
  run("one row of the base", {0}, 8);
  run("one row of a variant", {ids[1]}, 8);
  run("12 rows of 5 variants", mixed, 8);
  run("12 rows of one variant", one, 8);
  run("12 rows of the base", base, 8);
  run("4 rows of one variant", std::vector<int>(4, ids[2]), 8);
  run("40 rows of one variant", std::vector<int>(40, ids[4]), 6);
  run("40 rows of the base", std::vector<int>(40, 0), 6);
  run("one row of a variant again", {ids[1]}, 6);
  graphs.remove_variant(ids[2]);
  plain.remove_variant(ids[2]);
  const int again = graphs.add_variant("math again", delta("math", AlphaMode::Tensor));
  ASSERT_EQ(plain.add_variant("math again", delta("math", AlphaMode::Tensor)), again);
  std::vector<int> mixed2;
  for (int i = 0; i < 12; ++i) mixed2.push_back(i % 3 == 0 ? again : i % 3 == 1 ? ids[1] : 0);
  run("12 rows of 3 variants after a variant was replaced", mixed2, 8);
  const auto st = graphs.device_model()->graph_stats();
  EXPECT_GE(st.captured, 6u);
  EXPECT_EQ(plain.device_model()->graph_stats().captured + plain.device_model()->graph_stats().replayed, 0u);
  std::printf("  %llu steps captured, %llu replayed; worst |graph - launched| logit %.2e\n",
              (unsigned long long)st.captured, (unsigned long long)st.replayed, worst);
}

// A forked sequence (Model::fork_sequence: its cache copied on the device) continues like a
// sequence that prefilled the same prompt itself, apart from the one it was copied from, also past
// the cache's first capacity (16 positions), where it grows. A fork of a prefix copies only that
// prefix's positions.
TEST_F(GpuModel, ForkedSequenceContinuesLikeOneThatPrefilledItsPrompt) {
  Model model(kDemo / "base", on_cuda());
  const int v = model.add_variant("coder", delta("coder", AlphaMode::Row));
  const size_t V = model.config().vocab_size;
  const std::vector<int32_t> prompt{1, 450, 996, 1354, 1701, 2916};  // ids below the demo's 4096
  Sequence a = model.new_sequence(v), c = model.new_sequence(v);
  for (Sequence* s : {&a, &c}) {
    std::vector<ForwardRow> rows;
    for (size_t i = 0; i < prompt.size(); ++i)
      rows.push_back({s, prompt[i], i + 1 == prompt.size()});
    model.forward(rows);
  }
  Sequence b = model.fork_sequence(a);
  EXPECT_EQ(b.length, a.length);
  double worst = 0;
  for (size_t step = 0; step < 14; ++step) {
    // a is fed other tokens than b and c: b must not see them.
    const int32_t t = int32_t(100 + 37 * step), other = int32_t(2000 + 11 * step);
    const std::vector<ForwardRow> rows{{&a, other, true}, {&b, t, true}, {&c, t, true}};
    const auto logits = model.forward(rows);
    for (size_t i = 0; i < V; ++i) {
      const float got = logits[V + i], want = logits[2 * V + i];
      worst = std::max(worst, double(std::abs(got - want)));
      ASSERT_NEAR(got, want, 1e-3 * (1 + std::abs(want))) << "step " << step << ", logit " << i;
    }
  }
  std::printf("  worst |forked - prefilled| logit %.2e\n", worst);

  // A fork of the first 3 positions (a kept cache whose tokens a new prompt begins with) goes on
  // with the rest of the prompt like c did.
  Sequence d = model.fork_sequence(a, 3);
  EXPECT_EQ(d.length, 3u);
  Sequence e = model.new_sequence(v);
  std::vector<ForwardRow> rd, re;
  for (size_t i = 3; i < prompt.size(); ++i) rd.push_back({&d, prompt[i], i + 1 == prompt.size()});
  for (size_t i = 0; i < prompt.size(); ++i) re.push_back({&e, prompt[i], i + 1 == prompt.size()});
  const auto got = model.forward(rd), want = model.forward(re);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 1e-3 * (1 + std::abs(want[i]))) << "logit " << i;

  // A fork of no positions (nothing copied) prefills the whole prompt like a new sequence.
  Sequence z = model.fork_sequence(a, 0);
  EXPECT_EQ(z.length, 0u);
  std::vector<ForwardRow> rz;
  for (size_t i = 0; i < prompt.size(); ++i) rz.push_back({&z, prompt[i], i + 1 == prompt.size()});
  const auto got0 = model.forward(rz);
  ASSERT_EQ(got0.size(), want.size());
  for (size_t i = 0; i < got0.size(); ++i)
    ASSERT_NEAR(got0[i], want[i], 1e-3 * (1 + std::abs(want[i])))
        << "logit " << i << " (fork of 0)";
}

// The engine on the device with room for one delta on the GPU: alternating requests evict and
// reload, the second load of a delta comes from the pinned host tier, and every answer equals the
// same greedy generation run directly on a device model.
TEST_F(GpuModel, EngineMovesDeltasBetweenTiersAndKeepsAnswers) {
  EngineOptions eo;
  eo.device = "cuda";
  eo.threads = 4;
  eo.delta_cache_bytes = fs::file_size(delta("coder", AlphaMode::Row)) + 1024;
  Engine engine(kDemo / "base", eo);
  Model direct(kDemo / "base", on_cuda());
  const Tokenizer tokenizer(kDemo / "base");
  std::map<std::string, int> ids;
  for (const char* n : {"coder", "legal"}) {
    engine.add_variant(n, delta(n, AlphaMode::Row));
    ids[n] = direct.add_variant(n, delta(n, AlphaMode::Row));
  }
  const auto prompt = tokenizer.encode("def main():", true);
  for (int round = 0; round < 3; ++round)
    for (const char* n : {"coder", "legal"}) {
      GenerationRequest req;
      req.model = n;
      req.prompt = prompt;
      req.sampling.temperature = 0;
      req.stop.max_tokens = 12;
      req.stop_at_eos = false;
      std::vector<int32_t> tokens;
      std::promise<void> done;
      GenerationCallbacks cb;
      cb.on_token = [&](const TokenLogprob& t, const std::string&) {
        if (t.token >= 0) tokens.push_back(t.token);
      };
      cb.on_done = [&](FinishReason, const Usage&) { done.set_value(); };
      cb.on_error = [&](const std::string& m, int) {
        ADD_FAILURE() << m;
        done.set_value();
      };
      engine.submit(req, cb);
      done.get_future().wait();
      StopConditions stop;
      stop.max_tokens = 12;
      const auto want = generate(direct, tokenizer, ids[n], prompt, req.sampling, stop);
      EXPECT_EQ(tokens, want.tokens) << n << " round " << round;
    }
  const auto m = engine.metrics();
  EXPECT_GE(m.cache_evictions, 4u);
  EXPECT_GE(m.cache_loads, 6u);
  EXPECT_GE(m.cache_host_hits, 4u) << "reloads after the first should come from pinned host memory";
  std::printf("  engine: %llu loads (%llu from the host tier), %llu evictions\n",
              (unsigned long long)m.cache_loads, (unsigned long long)m.cache_host_hits,
              (unsigned long long)m.cache_evictions);
}

TEST_F(GpuModel, WrongDeviceAndBadDeltaFailWithOneLine) {
  ModelOptions o = on_cuda();
  o.cuda_device = 99;
  try {
    Model m(kDemo / "base", o);
    FAIL() << "device 99 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda:99"), std::string::npos) << e.what();
  }
  Model gpu(kDemo / "base", on_cuda());
  test::TempDir tmp;
  // A truncated delta is refused at open, before anything reaches the device.
  const auto good = delta("coder", AlphaMode::Row);
  std::ifstream in(good, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  std::ofstream(tmp / "cut.bitdelta", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  EXPECT_THROW(gpu.add_variant("cut", tmp / "cut.bitdelta"), Error);
  // The model still works afterwards.
  EXPECT_NO_THROW(gpu.add_variant("coder", good));
  const auto s = score(gpu, gpu.find_variant("coder"), std::vector<int32_t>{1, 50, 60});
  EXPECT_EQ(s.prompt_logprobs.size(), 2u);
}

// Every model subcommand takes --device cuda: score on the device agrees with the CPU within the
// bound, and a bad device string is one line on stderr.
TEST_F(GpuModel, CliScoreOnTheDeviceAgreesWithTheCpu) {
  test::TempDir tmp;
  const std::string args = (kDemo / "base").string() + " --delta " + delta("legal", AlphaMode::Row).string() +
                           " --tokens 1,400,500,600,700,800,900,1000 --json";
  const auto c = test::run_cli("score " + args, tmp.path());
  const auto g = test::run_cli("score " + args + " --device cuda", tmp.path());
  ASSERT_EQ(c.exit_code, 0) << c.err;
  ASSERT_EQ(g.exit_code, 0) << g.err;
  const auto cj = json::parse(c.out), gj = json::parse(g.out);
  const auto cl = cj["prompt_logprobs"].get<std::vector<double>>(), gl = gj["prompt_logprobs"].get<std::vector<double>>();
  ASSERT_EQ(cl.size(), gl.size());
  for (size_t i = 0; i < cl.size(); ++i) EXPECT_NEAR(gl[i], cl[i], tolerance(cl[i])) << i;
  const auto bad = test::run_cli("score " + args + " --device cuda:x", tmp.path());
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("cuda:x"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace bitdelta
