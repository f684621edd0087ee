// The engine end to end on the demo family: continuous batching across variants gives the same
// tokens as running each request alone, a cold variant loads once for many requests, the cache
// evicts by policy under a byte budget and keeps pinned variants, a broken delta fails only its
// own requests, a cancelled request frees its slot, requests of one prompt prefill it once, and
// the logit bias and penalties follow their definition.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "bitdelta/compress.h"
#include "bitdelta/engine.h"
#include "bitdelta/generate.h"
#include "test_util.h"

namespace bitdelta {
namespace {

namespace fs = std::filesystem;
const fs::path kDemo = fs::path(BITDELTA_SOURCE_DIR) / "models" / "demo";
const std::vector<std::string> kVariants{"coder", "math", "writer", "legal"};

// Collects one request's callbacks and lets the test wait for the end.
struct Collector {
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<int32_t> tokens;
  std::string text, error;
  int status = 0;
  bool done = false;
  FinishReason reason = FinishReason::kNone;

  GenerationCallbacks callbacks() {
    GenerationCallbacks cb;
    cb.on_token = [this](const TokenLogprob& t, const std::string& piece) {
      std::lock_guard lock(mutex);
      if (t.token >= 0) tokens.push_back(t.token);
      text += piece;
    };
    cb.on_done = [this](FinishReason r, const Usage&) {
      std::lock_guard lock(mutex);
      reason = r;
      done = true;
      cv.notify_all();
    };
    cb.on_error = [this](const std::string& msg, int http) {
      std::lock_guard lock(mutex);
      error = msg;
      status = http;
      done = true;
      cv.notify_all();
    };
    return cb;
  }
  bool wait(double seconds = 60) {
    std::unique_lock lock(mutex);
    return cv.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return done; });
  }
};

class EngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(kDemo / "base" / "config.json")) return;
    deltas_ = new test::TempDir();
    for (const auto& v : kVariants)
      compress(Checkpoint(kDemo / "base"), Checkpoint(kDemo / v), (*deltas_) / (v + ".bitdelta"));
  }
  static void TearDownTestSuite() {
    delete deltas_;
    deltas_ = nullptr;
  }
  void SetUp() override {
    if (!deltas_) GTEST_SKIP() << "models/demo is missing";
  }
  static fs::path delta(const std::string& v) { return (*deltas_) / (v + ".bitdelta"); }

  static GenerationRequest greedy(const Engine& e, const std::string& model, const std::string& prompt, size_t n) {
    GenerationRequest r;
    r.model = model;
    r.prompt = e.tokenizer().encode(prompt, true);
    r.sampling.temperature = 0;
    r.stop.max_tokens = n;
    return r;
  }

  static test::TempDir* deltas_;
};
test::TempDir* EngineTest::deltas_ = nullptr;

TEST_F(EngineTest, MixedVariantBatchesGiveTheTokensOfEachRequestAlone) {
  EngineOptions opt;
  opt.threads = 2;
  Engine engine(kDemo / "base", opt);
  for (const auto& v : kVariants) engine.add_variant(v, delta(v));
  const std::vector<std::pair<std::string, std::string>> jobs{
      {"coder", "def add(a, b):\n"}, {"math", "Question: What is 12 + 30?\nAnswer:"},
      {"writer", "The old house"}, {"legal", "Permission is hereby granted"}, {"base", "The"}};
  std::vector<Collector> together(jobs.size());
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (size_t i = 0; i < jobs.size(); ++i)
    handles.push_back(engine.submit(greedy(engine, jobs[i].first, jobs[i].second, 24), together[i].callbacks()));
  for (auto& c : together) ASSERT_TRUE(c.wait());
  const auto m = engine.metrics();
  EXPECT_GT(m.mixed_steps, 0u);
  EXPECT_GE(m.max_variants_in_step, 3u);

  // The same requests one at a time, through the single-sequence path.
  Model model(kDemo / "base", 2);
  const Tokenizer& tok = engine.tokenizer();
  for (size_t i = 0; i < jobs.size(); ++i) {
    ASSERT_TRUE(together[i].error.empty()) << together[i].error;
    const int id = jobs[i].first == "base" ? 0 : model.add_variant(jobs[i].first, delta(jobs[i].first));
    SamplingParams sp;
    sp.temperature = 0;
    StopConditions stop;
    stop.stop_ids = tok.eos_ids();
    stop.max_tokens = 24;
    const auto alone = generate(model, tok, id, tok.encode(jobs[i].second, true), sp, stop);
    EXPECT_EQ(together[i].tokens, alone.tokens) << jobs[i].first;
    EXPECT_EQ(together[i].text, alone.text) << jobs[i].first;
  }
}

// Requests of one model and prompt admitted together prefill it once: the others wait for it, go on
// from a copy of its cache and sample their own tokens. Greedy, each one's tokens are those of the
// request alone (sampled ones are compared in
// ServerTest.ChoicesAndPromptListsAreTheirSingleRequests: here a batch's rounding may flip a draw
// near a tie, sharing or not); with seeds, the followers draw apart. submit_all hands them to the
// scheduler together, so which ones share is certain; it takes all or none.
TEST_F(EngineTest, RequestsOfOnePromptPrefillItOnce) {
  EngineOptions opt;
  opt.threads = 2;
  opt.max_queue = 8;
  Engine engine(kDemo / "base", opt);
  engine.add_variant("writer", delta("writer"));
  const Tokenizer& tok = engine.tokenizer();
  const auto prompt = tok.encode(
      "Once upon a time, in a village by the sea, there lived an old fisherman who", true);
  const auto other = tok.encode("The sea", true);
  Model model(kDemo / "base", 2);
  const int id = model.add_variant("writer", delta("writer"));
  StopConditions stop;
  stop.stop_ids = tok.eos_ids();
  stop.max_tokens = 12;
  SamplingParams greedy;
  greedy.temperature = 0;
  const auto alone = generate(model, tok, id, prompt, greedy, stop);
  const auto alone_other = generate(model, tok, id, other, greedy, stop);

  // Four greedy of one prompt, one of them also asking for prompt logprobs (it cannot take the
  // others' prefill, which computes none), one of another prompt, and three of the first prompt
  // sampled with seeds.
  std::vector<Collector> out(8);
  std::vector<std::vector<float>> prompt_lp(8);
  std::vector<GenerationRequest> requests;
  std::vector<GenerationCallbacks> callbacks;
  for (size_t i = 0; i < out.size(); ++i) {
    GenerationRequest r;
    r.model = "writer";
    r.prompt = i == 4 ? other : prompt;
    r.sampling.temperature = i < 5 ? 0.0f : 0.9f;
    r.sampling.seed = 100 + i;
    r.stop.max_tokens = 12;
    r.prompt_logprobs = i == 3;
    requests.push_back(r);
    auto cb = out[i].callbacks();
    cb.on_prompt_logprobs = [&prompt_lp, i](const std::vector<float>& lp) { prompt_lp[i] = lp; };
    callbacks.push_back(cb);
  }
  // One more than the queue takes: refused whole, nothing runs.
  auto too_many = requests;
  too_many.push_back(requests[0]);
  auto more_callbacks = callbacks;
  more_callbacks.push_back(callbacks[0]);
  EXPECT_THROW(engine.submit_all(too_many, more_callbacks), EngineError);
  // One bad request refuses them all.
  auto bad = requests;
  bad[2].prompt = {};
  EXPECT_THROW(engine.submit_all(bad, callbacks), EngineError);
  EXPECT_EQ(engine.metrics().prompt_tokens_run, 0u);

  const auto handles = engine.submit_all(requests, callbacks);
  ASSERT_EQ(handles.size(), out.size());
  for (auto& c : out) ASSERT_TRUE(c.wait());
  for (size_t i = 0; i < out.size(); ++i) ASSERT_TRUE(out[i].error.empty()) << out[i].error;
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(out[i].tokens, i == 4 ? alone_other.tokens : alone.tokens) << "request " << i;
    EXPECT_EQ(out[i].text, i == 4 ? alone_other.text : alone.text) << "request " << i;
  }
  EXPECT_FALSE(out[5].tokens == out[6].tokens && out[6].tokens == out[7].tokens);
  EXPECT_EQ(prompt_lp[3].size(), prompt.size() - 1);
  // Requests 0 and 3 ran the prompt, 4 its own; 1, 2, 5, 6 and 7 took request 0's.
  const auto m = engine.metrics();
  EXPECT_EQ(m.prompt_tokens_run, 2 * prompt.size() + other.size());
  EXPECT_EQ(m.prompt_tokens_shared, 5 * prompt.size());
}

// A finished sequence's cache is kept (EngineOptions::prefix_cache_bytes): a prompt that begins
// with its tokens (the next turn of a conversation: the prompt, the answer, more) starts from a
// copy of those positions and gives the greedy tokens of the request alone. Kept caches are per
// model, the prompt's last token always runs, and the budget bounds them.
TEST_F(EngineTest, PromptsThatBeginLikeAFinishedOneStartFromItsCache) {
  const auto run = [](Engine& engine, const std::string& model,
                      const std::vector<int32_t>& prompt) {
    GenerationRequest r;
    r.model = model;
    r.prompt = prompt;
    r.sampling.temperature = 0;
    r.stop.max_tokens = 8;
    r.stop_at_eos = false;
    Collector c;
    auto h = engine.submit(r, c.callbacks());
    EXPECT_TRUE(c.wait());
    EXPECT_TRUE(c.error.empty()) << c.error;
    return c.tokens;
  };
  Model model(kDemo / "base", 2);
  const int id = model.add_variant("coder", delta("coder"));
  const Tokenizer model_tok(kDemo / "base");
  const auto alone = [&](int variant, const std::vector<int32_t>& prompt) {
    SamplingParams sp;
    sp.temperature = 0;
    StopConditions stop;
    stop.max_tokens = 8;
    return generate(model, model_tok, variant, prompt, sp, stop).tokens;
  };
  EngineOptions opt;
  opt.threads = 2;
  Engine engine(kDemo / "base", opt);
  engine.add_variant("coder", delta("coder"));
  const Tokenizer& tok = engine.tokenizer();
  const auto first =
      tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", true);
  ASSERT_GE(first.size(), 16u);
  const auto answer = run(engine, "coder", first);
  EXPECT_EQ(answer, alone(id, first));
  EXPECT_EQ(engine.metrics().prefix_cache_entries, 1u);
  // The next turn: the first prompt, its answer and more. All but the last answer token are kept
  // (the last was never fed).
  std::vector<int32_t> next = first;
  next.insert(next.end(), answer.begin(), answer.end());
  const auto more = tok.encode("\n# and now in a loop\n", false);
  next.insert(next.end(), more.begin(), more.end());
  EXPECT_EQ(run(engine, "coder", next), alone(id, next));
  auto m = engine.metrics();
  EXPECT_EQ(m.prompt_tokens_cached, first.size() + answer.size() - 1);
  // It replaced the first one's cache, which it holds whole.
  EXPECT_EQ(m.prefix_cache_entries, 1u);
  // A prompt that shares only its first 16 tokens starts from those.
  std::vector<int32_t> partial(first.begin(), first.begin() + 16);
  const auto other = tok.encode(" return 1 if n < 2 else fib(n - 1) + fib(n - 2)", false);
  partial.insert(partial.end(), other.begin(), other.end());
  EXPECT_EQ(run(engine, "coder", partial), alone(id, partial));
  EXPECT_EQ(engine.metrics().prompt_tokens_cached - m.prompt_tokens_cached, 16u);
  // Another model's caches are not this one's; a prompt equal to a kept one runs its last token.
  m = engine.metrics();
  EXPECT_EQ(run(engine, "base", next), alone(0, next));
  EXPECT_EQ(engine.metrics().prompt_tokens_cached, m.prompt_tokens_cached);
  EXPECT_EQ(run(engine, "coder", first), answer);
  EXPECT_EQ(engine.metrics().prompt_tokens_cached - m.prompt_tokens_cached, first.size() - 1);

  // The budget bounds what is kept: room for one cache keeps the latest; none keeps nothing.
  const uint64_t one = engine.metrics().prefix_cache_bytes / engine.metrics().prefix_cache_entries;
  for (const uint64_t budget : {one + one / 2, uint64_t(0)}) {
    EngineOptions small = opt;
    small.prefix_cache_bytes = budget;
    Engine e(kDemo / "base", small);
    e.add_variant("coder", delta("coder"));
    run(e, "coder", first);
    run(e, "coder", partial);
    EXPECT_EQ(e.metrics().prefix_cache_entries, budget ? 1u : 0u);
    EXPECT_LE(e.metrics().prefix_cache_bytes, budget);
    // partial took 16 tokens of first's cache; first, run again, takes 16 of partial's: its own
    // cache (all of first but its last token) was evicted.
    run(e, "coder", first);
    EXPECT_EQ(e.metrics().prompt_tokens_cached, budget ? 32u : 0u);
  }
}

TEST_F(EngineTest, TwentyRequestsToAColdVariantCauseOneLoad) {
  EngineOptions opt;
  opt.threads = 2;
  Engine engine(kDemo / "base", opt);
  engine.add_variant("coder", delta("coder"));
  std::vector<Collector> c(20);
  std::vector<std::shared_ptr<RequestHandle>> h;
  for (auto& x : c) h.push_back(engine.submit(greedy(engine, "coder", "import", 4), x.callbacks()));
  for (auto& x : c) {
    ASSERT_TRUE(x.wait());
    EXPECT_TRUE(x.error.empty()) << x.error;
  }
  const auto m = engine.metrics();
  EXPECT_EQ(m.cache_loads, 1u);
  // Requests the engine routes after the load finished are hits; the rest waited on the one load.
  EXPECT_GE(m.cache_misses, 1u);
  EXPECT_EQ(m.cache_misses + m.cache_hits, 20u);
}

TEST_F(EngineTest, BudgetOfTwoDeltasEvictsByPolicyAndKeepsPinned) {
  std::vector<uint64_t> sizes;
  for (const auto& v : kVariants) sizes.push_back(fs::file_size(delta(v)));
  std::sort(sizes.rbegin(), sizes.rend());
  const uint64_t budget = sizes[0] + sizes[1] + 1024;  // any two fit
  ASSERT_GT(sizes[1] + sizes[2] + sizes[3], budget);   // no three do

  auto run = [](Engine& e, const std::string& v) {
    Collector c;
    auto h = e.submit(greedy(e, v, "a", 2), c.callbacks());
    EXPECT_TRUE(c.wait());
    EXPECT_TRUE(c.error.empty()) << c.error;
  };
  auto state = [](const Engine& e, const std::string& v) {
    for (const auto& s : e.variants())
      if (s.name == v) return s.state;
    return std::string("?");
  };
  auto resident_bytes = [](const Engine& e) {
    uint64_t total = 0;
    for (const auto& s : e.variants()) total += s.bytes;
    return total;
  };
  EngineOptions opt;
  opt.threads = 2;
  opt.delta_cache_bytes = budget;
  {
    // A pinned variant stays whatever else is asked for.
    auto pinned = opt;
    pinned.pinned = {"legal"};
    Engine engine(kDemo / "base", pinned);
    for (const auto& v : kVariants) engine.add_variant(v, delta(v));
    for (const auto& v : {"legal", "coder", "math", "writer", "coder"}) {
      run(engine, v);
      EXPECT_EQ(state(engine, "legal"), "resident") << "after " << v;
      EXPECT_EQ(state(engine, v), "resident");
      EXPECT_LE(resident_bytes(engine), budget);
    }
    EXPECT_EQ(engine.metrics().cache_evictions, 3u);
  }
  {
    // Rate outweighs recency: math asked for 10 times, then coder once (the most recent); a third
    // variant evicts coder, the one with the lower rate-weighted score. (Half-life 2 s: math's rate
    // stays above 2/s for the test's duration, coder's ~0.35/s plus at most 1 for recency.)
    auto fast = opt;
    fast.rate_half_life_s = 2;
    Engine engine(kDemo / "base", fast);
    for (const auto& v : kVariants) engine.add_variant(v, delta(v));
    for (int i = 0; i < 10; ++i) run(engine, "math");
    run(engine, "coder");
    run(engine, "writer");
    EXPECT_EQ(state(engine, "math"), "resident");
    EXPECT_EQ(state(engine, "writer"), "resident");
    EXPECT_EQ(state(engine, "coder"), "cold");
    EXPECT_EQ(engine.metrics().cache_evictions, 1u);
  }
}

TEST_F(EngineTest, ACorruptDeltaFailsOnlyItsOwnRequestsAndIsRetried) {
  test::TempDir dir;
  const auto bad = dir / "bad.bitdelta";
  std::string bytes = test::read_file(delta("writer"));
  test::write_text(bad, bytes.substr(0, bytes.size() / 2));  // truncated
  EngineOptions opt;
  opt.threads = 2;
  Engine engine(kDemo / "base", opt);
  engine.add_variant("broken", bad);
  engine.add_variant("coder", delta("coder"));
  Collector b1, b2, ok;
  auto h1 = engine.submit(greedy(engine, "broken", "x", 4), b1.callbacks());
  auto h2 = engine.submit(greedy(engine, "broken", "y", 4), b2.callbacks());
  auto h3 = engine.submit(greedy(engine, "coder", "def", 8), ok.callbacks());
  for (auto* c : {&b1, &b2, &ok}) ASSERT_TRUE(c->wait());
  EXPECT_NE(b1.error.find("broken"), std::string::npos) << b1.error;
  EXPECT_NE(b1.error.find("bad.bitdelta"), std::string::npos) << b1.error;
  EXPECT_EQ(b1.status, 500);
  EXPECT_FALSE(b2.error.empty());
  EXPECT_TRUE(ok.error.empty()) << ok.error;
  EXPECT_EQ(ok.tokens.size(), 8u);
  // Fixed on disk: the next request loads it again and succeeds.
  test::write_text(bad, bytes);
  Collector again;
  auto h4 = engine.submit(greedy(engine, "broken", "z", 4), again.callbacks());
  ASSERT_TRUE(again.wait());
  EXPECT_TRUE(again.error.empty()) << again.error;
  // The two broken requests failed on one load, or on two if the second arrived after the first
  // load had already failed (each later request retries); then the repaired file loaded once.
  const auto m = engine.metrics();
  EXPECT_GE(m.cache_load_failures, 1u);
  EXPECT_LE(m.cache_load_failures, 2u);
  EXPECT_EQ(m.cache_loads, m.cache_load_failures + 2);  // + coder + the repaired one
}

TEST_F(EngineTest, CancelFreesTheSlotAndRefusalsAreClear) {
  EngineOptions opt;
  opt.threads = 2;
  opt.max_queue = 4;
  opt.max_running = 1;
  Engine engine(kDemo / "base", opt);
  Collector c;
  auto h = engine.submit(greedy(engine, "base", "The", 100000), c.callbacks());
  for (int i = 0; i < 200 && engine.metrics().running == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(engine.metrics().running, 1u);
  h->cancel();
  for (int i = 0; i < 200 && engine.metrics().running != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(engine.metrics().running, 0u);
  EXPECT_FALSE(c.done);  // no callback after cancel

  auto kind_of = [&](GenerationRequest r) {
    try {
      Collector x;
      engine.submit(std::move(r), x.callbacks());
    } catch (const EngineError& e) {
      return int(e.kind);
    }
    return -1;
  };
  EXPECT_EQ(kind_of(greedy(engine, "nope", "a", 1)), int(EngineError::Kind::UnknownModel));
  auto bad = greedy(engine, "base", "a", 1);
  bad.prompt.push_back(999999);
  EXPECT_EQ(kind_of(bad), int(EngineError::Kind::BadRequest));
  bad = greedy(engine, "base", "a", 1);
  bad.sampling.temperature = -1;
  EXPECT_EQ(kind_of(bad), int(EngineError::Kind::BadRequest));
}

// Logit bias and the presence and frequency penalties in the engine's batched decode (and in
// generate()) give the tokens of their definition, written here over score()'s logits of the whole sequence so far (so
// neither the sampler nor the incremental decode path is the reference): the output alone is
// penalized, and padded ids past the tokenizer's vocabulary are never chosen.
TEST_F(EngineTest, PenaltiesAndLogitBiasFollowTheirDefinition) {
  EngineOptions opt;
  opt.threads = 2;
  Engine engine(kDemo / "base", opt);
  engine.add_variant("writer", delta("writer"));
  Model model(kDemo / "base", 2);
  const int variant = model.add_variant("writer", delta("writer"));
  const Tokenizer& tok = engine.tokenizer();
  const size_t n = 16, vocab = tok.vocab_size();
  const auto prompt = tok.encode("The old house", true);
  const int32_t boosted = prompt[1];  // a prompt token: bias only, no penalty until generated
  const std::vector<std::pair<float, float>> penalties{{0.0f, 1.5f}, {1.2f, 0.0f}, {0.4f, 0.6f}};
  for (const auto& [presence, frequency] : penalties) {
    GenerationRequest r = greedy(engine, "writer", "The old house", n);
    r.stop_at_eos = false;
    r.sampling.presence_penalty = presence;
    r.sampling.frequency_penalty = frequency;
    r.sampling.logit_bias = {{boosted, 1.0f}, {3, -100.0f}};
    Collector c;
    auto h = engine.submit(r, c.callbacks());
    ASSERT_TRUE(c.wait());
    ASSERT_TRUE(c.error.empty()) << c.error;

    std::vector<int32_t> sequence = prompt, expected;
    while (expected.size() < n) {
      const auto logits = score(model, variant, sequence).last_logits;
      std::vector<double> z(logits.begin(), logits.begin() + long(vocab));
      z[size_t(boosted)] += 1.0;
      z[3] -= 100.0;
      for (size_t id = 0; id < vocab; ++id) {
        const auto count = std::count(expected.begin(), expected.end(), int32_t(id));
        if (count > 0) z[id] -= double(count) * frequency + presence;
      }
      const int32_t next = int32_t(std::max_element(z.begin(), z.end()) - z.begin());
      expected.push_back(next);
      sequence.push_back(next);
    }
    EXPECT_EQ(c.tokens, expected) << "presence " << presence << ", frequency " << frequency;
    StopConditions stop;  // no EOS: n tokens
    stop.max_tokens = n;
    EXPECT_EQ(generate(model, tok, variant, prompt, r.sampling, stop).tokens, expected)
        << "generate(), presence " << presence << ", frequency " << frequency;
  }
}

}  // namespace
}  // namespace bitdelta
