// Sampler (greedy, determinism, the truncation chain, logit bias, repetition, presence and
// frequency penalties, parameter checks), log_softmax, and StopChecker.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bitdelta/error.h"
#include "bitdelta/sampler.h"

namespace bitdelta {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::vector<float> random_logits(size_t n, uint64_t seed, float scale = 3.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

int32_t argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());  // first on ties
}

// The distribution written straight from the definition, over the whole vocabulary (0 = dropped):
// logit bias, repetition penalty, presence and frequency penalties (on the last `generated` of
// previous), temperature, top-k, softmax, top-p, min-p, renormalize.
std::vector<double> reference(const std::vector<float>& logits, const SamplingParams& p,
                              const std::vector<int32_t>& previous = {}, size_t generated = 0) {
  const size_t n = logits.size();
  std::vector<double> z(logits.begin(), logits.end());
  for (const auto& [id, bias] : p.logit_bias)
    if (size_t(id) < n) z[size_t(id)] += bias;
  std::vector<bool> penalized(n, false);
  for (const int32_t id : previous) {
    if (penalized[size_t(id)]) continue;
    penalized[size_t(id)] = true;
    z[size_t(id)] = z[size_t(id)] > 0 ? z[size_t(id)] / p.repetition_penalty
                                      : z[size_t(id)] * p.repetition_penalty;
  }
  const std::vector<int32_t> output(previous.end() - long(generated), previous.end());
  for (size_t id = 0; id < n; ++id) {
    const auto count = std::count(output.begin(), output.end(), int32_t(id));
    if (count > 0) z[id] -= double(count) * p.frequency_penalty + p.presence_penalty;
  }
  for (auto& x : z) x /= p.temperature;
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return z[a] > z[b]; });
  if (p.top_k > 0 && size_t(p.top_k) < n) order.resize(size_t(p.top_k));
  std::vector<double> prob(n, 0.0);
  double sum = 0;
  for (const size_t i : order) sum += std::exp(z[i] - z[order[0]]);
  for (const size_t i : order) prob[i] = std::exp(z[i] - z[order[0]]) / sum;
  if (p.top_p < 1) {
    double cumulative = 0;
    size_t keep = 0;
    while (keep < order.size() && cumulative < p.top_p) cumulative += prob[order[keep++]];
    for (size_t k = keep; k < order.size(); ++k) prob[order[k]] = 0;
  }
  const double p_max = prob[order[0]];
  for (auto& q : prob)
    if (q < p.min_p * p_max) q = 0;
  const double kept = std::accumulate(prob.begin(), prob.end(), 0.0);
  for (auto& q : prob) q /= kept;
  return prob;
}

// --- greedy and determinism
// --------------------------------------------------------------------------

TEST(Sampler, GreedyIsArgmaxLowestIdOnTies) {
  Sampler greedy({.temperature = 0.0f});
  for (uint64_t seed = 0; seed < 50; ++seed) {
    const auto logits = random_logits(1000, seed);
    EXPECT_EQ(greedy.sample(logits, {}), argmax(logits));
  }
  EXPECT_EQ(greedy.sample(std::vector<float>{1, 5, 2, 5, 5}, {}), 1);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(greedy.sample(std::vector<float>{nan, -3, nan, -1, kNegInf}, {}), 3);  // NaN never wins
  const auto d = greedy.distribution(std::vector<float>{0, 2, 1}, {});
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].id, 1);
  EXPECT_EQ(d[0].p, 1.0);
}

TEST(Sampler, TopKOneIsGreedy) {
  for (uint64_t seed = 0; seed < 50; ++seed) {
    Sampler sampler({.temperature = 1.7f, .top_k = 1, .seed = seed});
    const auto logits = random_logits(500, seed + 100);
    EXPECT_EQ(sampler.sample(logits, {}), argmax(logits));
  }
}

std::vector<int32_t> draw(const SamplingParams& params, const std::vector<float>& logits, int n) {
  Sampler sampler(params);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(sampler.sample(logits, out));
  return out;
}

TEST(Sampler, SeedDeterminesTheSequence) {
  const auto logits = random_logits(64, 5, 1.0f);
  const SamplingParams p{
      .temperature = 0.9f, .top_p = 0.95f, .repetition_penalty = 1.1f, .seed = 1234};
  const auto a = draw(p, logits, 300);
  EXPECT_EQ(draw(p, logits, 300), a);
  SamplingParams other = p;
  other.seed = 1235;
  EXPECT_NE(draw(other, logits, 300), a);
}

TEST(Sampler, PinnedSequence) {
  // mt19937_64 is fully specified by the standard and the bits-to-double step is ours, so this
  // sequence is the same on every platform and compiler; a change here changes users' outputs.
  const std::vector<float> logits = {0.5f, 1.0f, -0.25f, 2.0f, 0.0f, 1.5f};
  const auto got = draw({.temperature = 1.0f, .seed = 42}, logits, 16);
  const std::vector<int32_t> expected = {5, 3, 5, 1, 5, 1, 3, 3, 2, 3, 0, 3, 3, 3, 5, 5};
  EXPECT_EQ(got, expected);
}

// --- the truncation chain
// ----------------------------------------------------------------------------

const std::vector<float> kSmallVocab = {2.0f, 1.1f, 0.3f, -0.6f, 1.7f, -2.0f, 0.9f, -0.1f};

std::vector<SamplingParams> chains() {
  return {
      {.temperature = 1.0f},
      {.temperature = 0.6f},
      {.temperature = 2.5f},
      {.temperature = 1.0f, .top_k = 3},
      {.temperature = 1.0f, .top_p = 0.7f},
      {.temperature = 1.0f, .min_p = 0.3f},
      {.temperature = 1.3f, .top_k = 5, .top_p = 0.8f, .min_p = 0.15f},
      {.temperature = 0.8f, .top_k = 6, .top_p = 0.9f, .repetition_penalty = 1.8f},
      {.temperature = 0.9f, .presence_penalty = 0.7f, .frequency_penalty = 0.4f},
      {.temperature = 1.1f, .top_p = 0.9f, .repetition_penalty = 1.3f, .presence_penalty = -0.5f,
       .frequency_penalty = 1.2f, .logit_bias = {{1, 2.5f}, {4, -1.0f}, {99, 5.0f}}},
  };
}

TEST(Sampler, DistributionMatchesDefinition) {
  const std::vector<int32_t> previous = {0, 4, 4, 5};
  for (const auto& p : chains()) {
    Sampler sampler(p);
    // The last three of previous are the output: token 0 is prompt only, 4 was generated once
    // and also in the prompt, 5 once.
    const auto expected = reference(kSmallVocab, p, previous, 3);
    const auto got = sampler.distribution(kSmallVocab, previous, 3);
    std::vector<double> full(kSmallVocab.size(), 0.0);
    double last = 2.0;
    for (const auto& t : got) {
      EXPECT_LE(t.p, last) << "not most likely first";
      last = t.p;
      full[size_t(t.id)] = t.p;
    }
    // 1e-6: the sampler applies the penalty to the float logits, the reference in double.
    for (size_t i = 0; i < full.size(); ++i)
      EXPECT_NEAR(full[i], expected[i], 1e-6)
          << "token " << i << " temperature " << p.temperature << " top_k " << p.top_k << " top_p "
          << p.top_p << " min_p " << p.min_p;
  }
}

TEST(Sampler, FrequenciesMatchTruncatedDistribution) {
  // 200k draws per setting. Pearson's statistic over the kept tokens follows chi-square with
  // (kept - 1) degrees of freedom; the bound is its 1e-6 upper quantile (Wilson-Hilferty), so a
  // correct sampler fails with probability < 1e-6 (and the seed is fixed, so it passes or fails
  // for good), while a wrongly kept, dropped or reweighted token gives a statistic in the
  // thousands.
  const int draws = 200000;
  const std::vector<int32_t> previous = {0, 4, 4, 5};
  uint64_t seed = 1;
  for (const auto& chain : chains()) {
    SamplingParams p = chain;
    p.seed = seed++;
    const auto expected = reference(kSmallVocab, p, previous);
    Sampler sampler(p);
    std::vector<int> count(kSmallVocab.size(), 0);
    for (int i = 0; i < draws; ++i) ++count[size_t(sampler.sample(kSmallVocab, previous))];
    double chi2 = 0;
    int kept = 0;
    for (size_t i = 0; i < count.size(); ++i) {
      if (expected[i] == 0) {
        EXPECT_EQ(count[i], 0) << "dropped token " << i << " was drawn";
        continue;
      }
      ++kept;
      const double e = expected[i] * draws;
      chi2 += (count[i] - e) * (count[i] - e) / e;
    }
    const double df = kept - 1, z = 4.753;  // z of the 1e-6 upper tail of the normal
    const double bound = df * std::pow(1 - 2 / (9 * df) + z * std::sqrt(2 / (9 * df)), 3);
    EXPECT_LT(chi2, bound) << "temperature " << p.temperature << " top_k " << p.top_k << " top_p "
                           << p.top_p << " min_p " << p.min_p;
  }
}

TEST(Sampler, TruncationKeepsAtLeastOneToken) {
  Sampler tiny_p({.temperature = 1.0f, .top_p = 1e-6f});
  EXPECT_EQ(tiny_p.distribution(kSmallVocab, {}).size(), 1u);
  Sampler full_min_p({.temperature = 1.0f, .min_p = 1.0f});
  EXPECT_EQ(full_min_p.distribution(kSmallVocab, {}).size(), 1u);
  // A nucleus that needs every token (the search must stop at the end).
  Sampler all({.temperature = 1.0f, .top_p = 0.99f});
  EXPECT_EQ(all.distribution(std::vector<float>{1, 1, 1}, {}).size(), 3u);
  Sampler all_200({.temperature = 1.0f, .top_p = 0.999f});  // 199/200 < 0.999: over two rounds
  EXPECT_EQ(all_200.distribution(std::vector<float>(200, 0.5f), {}).size(), 200u);
  // Equal logits: top-k keeps the lowest ids.
  Sampler top2({.temperature = 1.0f, .top_k = 2});
  const auto d = top2.distribution(std::vector<float>{1, 3, 3, 3}, {});
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0].id, 1);
  EXPECT_EQ(d[1].id, 2);
}

TEST(Sampler, LargeVocabularyTopP) {
  // Enough candidates that the nucleus search sorts in several rounds.
  const auto logits = random_logits(50000, 77, 1.5f);
  for (const float top_p : {0.1f, 0.5f, 0.9f, 0.999f}) {
    const SamplingParams p{.temperature = 1.0f, .top_p = top_p};
    Sampler sampler(p);
    const auto expected = reference(logits, p);
    const auto got = sampler.distribution(logits, {});
    EXPECT_EQ(got.size(), size_t(std::count_if(expected.begin(), expected.end(),
                                               [](double q) { return q > 0; })));
    for (const auto& t : got) EXPECT_NEAR(t.p, expected[size_t(t.id)], 1e-12);
  }
}

// --- repetition penalty
// ------------------------------------------------------------------------------

TEST(Sampler, RepetitionPenaltyChangesArgmax) {
  Sampler greedy({.temperature = 0.0f, .repetition_penalty = 1.5f});
  // Positive logits are divided: 2.0 / 1.5 = 1.33 < 1.8.
  EXPECT_EQ(greedy.sample(std::vector<float>{2.0f, 1.8f, 0.0f}, std::vector<int32_t>{0}), 1);
  EXPECT_EQ(greedy.sample(std::vector<float>{2.0f, 1.8f, 0.0f}, {}), 0);
  // Negative logits are multiplied: -1.0 * 1.5 = -1.5 < -1.2.
  EXPECT_EQ(greedy.sample(std::vector<float>{-1.0f, -1.2f}, std::vector<int32_t>{0}), 1);
  // Once per distinct token: 2.0 / 1.5 = 1.33 > 1.3, though token 0 occurred three times.
  EXPECT_EQ(greedy.sample(std::vector<float>{2.0f, 1.3f}, std::vector<int32_t>{0, 0, 0}), 0);
  // A penalty below 1 encourages repetition; ids outside the logits are ignored.
  Sampler encourage({.temperature = 0.0f, .repetition_penalty = 0.5f});
  EXPECT_EQ(encourage.sample(std::vector<float>{2.0f, 1.2f}, std::vector<int32_t>{1, 7, -3}), 1);
}

TEST(Sampler, PresenceAndFrequencyPenaltiesCountOnlyTheOutput) {
  const std::vector<float> logits{2.0f, 1.5f, 0.0f};
  const std::vector<int32_t> twice{0, 0};
  // Token 0 in the prompt only: no penalty, whatever its count.
  Sampler presence({.temperature = 0.0f, .presence_penalty = 0.6f});
  EXPECT_EQ(presence.sample(logits, twice, 0), 0);
  // Generated: 2.0 - 0.6 = 1.4 < 1.5, once however often it was generated.
  EXPECT_EQ(presence.sample(logits, twice, 1), 1);
  EXPECT_EQ(presence.sample(logits, std::vector<int32_t>{0}, 1), 1);
  Sampler presence_small({.temperature = 0.0f, .presence_penalty = 0.4f});
  EXPECT_EQ(presence_small.sample(logits, twice, 2), 0);  // 1.6 > 1.5
  // Frequency: 0.3 per time: once 1.7 > 1.5, twice 1.4 < 1.5.
  Sampler frequency({.temperature = 0.0f, .frequency_penalty = 0.3f});
  EXPECT_EQ(frequency.sample(logits, twice, 1), 0);
  EXPECT_EQ(frequency.sample(logits, twice, 2), 1);
  // Negative values encourage repeating; ids outside the logits are ignored; a count past the
  // tokens given is all of them.
  Sampler encourage({.temperature = 0.0f, .frequency_penalty = -1.5f});
  EXPECT_EQ(encourage.sample(logits, std::vector<int32_t>{2, 9, 2, -4}, 99), 2);  // 0 + 3 > 2
}

TEST(Sampler, LogitBiasIsAddedBeforeEverythingElse) {
  const std::vector<float> logits{2.0f, 1.5f, 0.0f};
  Sampler push({.temperature = 0.0f, .logit_bias = {{2, 2.5f}}});
  EXPECT_EQ(push.sample(logits, {}), 2);  // 2.5 > 2.0
  Sampler ban({.temperature = 0.0f, .logit_bias = {{0, -100.0f}, {7, 100.0f}}});
  EXPECT_EQ(ban.sample(logits, {}), 1);  // id 7 is outside the logits: ignored
  // Sampling: a -100 bias leaves the token a probability below e^-90 of the others'.
  Sampler banned({.temperature = 1.0f, .logit_bias = {{0, -100.0f}}});
  for (const auto& t : banned.distribution(logits, {})) {
    if (t.id == 0) {
      EXPECT_LT(t.p, 1e-39);
    }
  }
}

// --- parameters and bad input
// ------------------------------------------------------------------------

void expect_invalid(const SamplingParams& p, const std::string& field) {
  try {
    p.validate();
    ADD_FAILURE() << "accepted bad " << field;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
  EXPECT_THROW(Sampler{p}, Error);
}

TEST(Sampler, ValidateNamesTheField) {
  EXPECT_NO_THROW(SamplingParams{}.validate());
  EXPECT_NO_THROW(
      (SamplingParams{.temperature = 0, .top_k = 5, .top_p = 1, .min_p = 1}.validate()));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  expect_invalid({.temperature = -0.5f}, "temperature");
  expect_invalid({.temperature = nan}, "temperature");
  expect_invalid({.temperature = std::numeric_limits<float>::infinity()}, "temperature");
  expect_invalid({.top_k = -1}, "top_k");
  expect_invalid({.top_p = 0.0f}, "top_p");
  expect_invalid({.top_p = 1.01f}, "top_p");
  expect_invalid({.top_p = nan}, "top_p");
  expect_invalid({.min_p = -0.1f}, "min_p");
  expect_invalid({.min_p = 1.5f}, "min_p");
  expect_invalid({.repetition_penalty = 0.0f}, "repetition_penalty");
  expect_invalid({.repetition_penalty = -1.0f}, "repetition_penalty");
  expect_invalid({.presence_penalty = 2.5f}, "presence_penalty");
  expect_invalid({.presence_penalty = nan}, "presence_penalty");
  expect_invalid({.frequency_penalty = -2.01f}, "frequency_penalty");
  expect_invalid({.logit_bias = {{3, 100.5f}}}, "logit_bias");
  expect_invalid({.logit_bias = {{-1, 1.0f}}}, "logit_bias");
  EXPECT_NO_THROW((SamplingParams{.presence_penalty = -2, .frequency_penalty = 2,
                                  .logit_bias = {{0, -100.0f}, {5, 100.0f}}}
                       .validate()));
}

TEST(Sampler, BadLogits) {
  Sampler sampler({.seed = 3});
  EXPECT_THROW(sampler.sample(std::vector<float>{}, {}), Error);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(sampler.sample(std::vector<float>{nan, kNegInf}, {}), Error);
  Sampler greedy({.temperature = 0});
  EXPECT_THROW(greedy.sample(std::vector<float>{kNegInf, kNegInf}, {}), Error);
  // NaN and -inf are never drawn; +inf takes all the probability.
  for (int i = 0; i < 100; ++i)
    EXPECT_EQ(sampler.sample(std::vector<float>{nan, 0.0f, kNegInf}, {}), 1);
  const float inf = std::numeric_limits<float>::infinity();
  for (int i = 0; i < 100; ++i) {
    const int32_t id = sampler.sample(std::vector<float>{5.0f, inf, 1.0f, inf}, {});
    EXPECT_TRUE(id == 1 || id == 3) << id;
  }
}

// --- log_softmax
// -------------------------------------------------------------------------------------

TEST(SamplerLogSoftmax, MatchesDefinitionAndIsStable) {
  const auto logits = random_logits(300, 11, 4.0f);
  const auto lp = log_softmax(logits);
  double sum = 0, direct_sum = 0;
  for (const float x : logits) direct_sum += std::exp(double(x));
  for (size_t i = 0; i < logits.size(); ++i) {
    EXPECT_NEAR(lp[i], std::log(std::exp(double(logits[i])) / direct_sum), 1e-5);
    sum += std::exp(double(lp[i]));
  }
  EXPECT_NEAR(sum, 1.0, 1e-5);

  // Logits far beyond exp's range in float: only their differences matter.
  const auto big = log_softmax(std::vector<float>{10000.0f, 10001.0f, kNegInf});
  EXPECT_NEAR(big[0], -1.0 - std::log1p(std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(big[1], -std::log1p(std::exp(-1.0)), 1e-6);
  EXPECT_EQ(big[2], kNegInf);

  const float inf = std::numeric_limits<float>::infinity();
  const auto infinite = log_softmax(std::vector<float>{inf, 0.0f, inf});
  EXPECT_NEAR(infinite[0], -std::log(2.0), 1e-7);
  EXPECT_EQ(infinite[1], kNegInf);
  EXPECT_THROW(log_softmax(std::vector<float>{}), Error);
  EXPECT_THROW(log_softmax(std::vector<float>{kNegInf, kNegInf}), Error);
  EXPECT_THROW(log_softmax(std::vector<float>{0.0f, std::numeric_limits<float>::quiet_NaN()}),
               Error);
}

// --- StopChecker
// -------------------------------------------------------------------------------------

TEST(StopChecker, StopStringSpanningTokens) {
  StopChecker stop({.stop_ids = {2}, .stop_strings = {"\nUser:"}});
  EXPECT_EQ(stop.push(10, "Hel"), "Hel");
  EXPECT_EQ(stop.push(11, "lo\nUs"), "lo");  // "\nUs" could start the stop string: held back
  EXPECT_FALSE(stop.done());
  EXPECT_EQ(stop.push(12, "er: next"), "");
  EXPECT_TRUE(stop.done());
  EXPECT_EQ(stop.reason(), FinishReason::kStop);
  EXPECT_STREQ(to_string(stop.reason()), "stop");
  EXPECT_EQ(stop.stop_string(), "\nUser:");
  EXPECT_EQ(stop.text(), "Hello");
  EXPECT_EQ(stop.finish("ignored"), "");
  EXPECT_EQ(stop.text(), "Hello");
  EXPECT_THROW(stop.push(13, "x"), Error);
}

TEST(StopChecker, HeldTextIsReleasedWhenItDiverges) {
  StopChecker stop({.stop_strings = {"###"}});
  EXPECT_EQ(stop.push(1, "a#"), "a");
  EXPECT_EQ(stop.push(2, "#"), "");
  EXPECT_EQ(stop.push(3, "b"), "##b");
  EXPECT_EQ(stop.push(4, "##"), "");
  EXPECT_FALSE(stop.done());
  EXPECT_EQ(stop.finish(""), "##");  // the end of generation releases a held prefix
  EXPECT_EQ(stop.reason(), FinishReason::kLength);
  EXPECT_EQ(stop.text(), "a##b##");
}

TEST(StopChecker, EarliestStopStringWins) {
  StopChecker stop({.stop_strings = {"world", "o", "lo w"}});
  EXPECT_EQ(stop.push(1, "hello world"), "hel");  // "lo w" starts first, though listed last
  EXPECT_EQ(stop.stop_string(), "lo w");
  StopChecker inside({.stop_strings = {"END"}});
  EXPECT_EQ(inside.push(1, "abcENDdef"), "abc");  // a stop string inside one token's text
}

TEST(StopChecker, EosAndMaxTokens) {
  StopChecker eos({.stop_ids = {2, 7}, .stop_strings = {"zz"}, .max_tokens = 100});
  EXPECT_EQ(eos.push(5, "text z"), "text ");
  EXPECT_EQ(eos.push(7, ""), "");
  EXPECT_TRUE(eos.done());
  EXPECT_EQ(eos.reason(), FinishReason::kStop);
  EXPECT_EQ(eos.stop_string(), "");
  EXPECT_EQ(eos.finish(""), "z");
  EXPECT_EQ(eos.text(), "text z");

  StopChecker length({.stop_ids = {2}, .max_tokens = 3});
  EXPECT_EQ(length.push(5, "a"), "a");
  EXPECT_EQ(length.push(2, ""), "");  // EOS on the last allowed token is still "stop"
  EXPECT_EQ(length.reason(), FinishReason::kStop);

  StopChecker limit({.stop_ids = {2}, .max_tokens = 3});
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(limit.done());
    limit.push(5, "x");
  }
  EXPECT_EQ(limit.reason(), FinishReason::kLength);
  EXPECT_STREQ(to_string(limit.reason()), "length");
  EXPECT_EQ(limit.tokens(), 3u);
  EXPECT_EQ(limit.finish(""), "");
  EXPECT_EQ(limit.text(), "xxx");

  // A stop string completed by the decoder's final flush still truncates.
  StopChecker tail({.stop_strings = {"ab"}, .max_tokens = 1});
  EXPECT_EQ(tail.push(1, "xa"), "x");
  EXPECT_EQ(tail.reason(), FinishReason::kLength);
  EXPECT_EQ(tail.finish("bc"), "");
  EXPECT_EQ(tail.reason(), FinishReason::kStop);
  EXPECT_EQ(tail.text(), "x");
}

TEST(StopChecker, EmptyStopStringRejected) {
  EXPECT_THROW(StopChecker({.stop_strings = {"ok", ""}}), Error);
}

TEST(StopChecker, RandomSplitsMatchWholeText) {
  // However the text is cut into tokens, the output is the text up to the first stop string.
  std::mt19937_64 rng(17);
  const std::vector<std::string> stops = {"\n\n", "STOP", "ab\xC3\xA9"};
  const std::string alphabet[] = {"a", "b", "\xC3\xA9", "\n", "S", "T", "O", "P", " "};
  for (int trial = 0; trial < 2000; ++trial) {
    std::string text;
    for (size_t n = rng() % 40; n > 0; --n) text += alphabet[rng() % std::size(alphabet)];
    size_t first = std::string::npos;
    for (const auto& s : stops) first = std::min(first, text.find(s));
    const std::string expected = text.substr(0, first);

    StopChecker stop({.stop_strings = stops});
    std::string out;
    size_t at = 0;
    while (at < text.size() && !stop.done()) {
      const size_t len = std::min(text.size() - at, size_t(rng() % 5));
      out += stop.push(0, std::string_view(text).substr(at, len));
      at += len;
    }
    out += stop.finish("");
    ASSERT_EQ(out, expected) << "text: " << text;
    ASSERT_EQ(stop.text(), expected);
    EXPECT_EQ(stop.reason(),
              first == std::string::npos ? FinishReason::kLength : FinishReason::kStop);
  }
}

}  // namespace
}  // namespace bitdelta
