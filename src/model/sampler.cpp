#include "bitdelta/sampler.h"

#include <algorithm>
#include <cmath>

#include "bitdelta/error.h"

namespace bitdelta {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

void SamplingParams::validate() const {
  if (!std::isfinite(temperature) || temperature < 0)
    fail("sampling parameter temperature must be a finite number >= 0 (0 = greedy), got ",
         temperature);
  if (top_k < 0) fail("sampling parameter top_k must be >= 0 (0 = off), got ", top_k);
  if (!(top_p > 0 && top_p <= 1)) fail("sampling parameter top_p must be in (0, 1], got ", top_p);
  if (!(min_p >= 0 && min_p <= 1)) fail("sampling parameter min_p must be in [0, 1], got ", min_p);
  if (!std::isfinite(repetition_penalty) || repetition_penalty <= 0)
    fail("sampling parameter repetition_penalty must be a finite number > 0, got ",
         repetition_penalty);
  if (!(presence_penalty >= -2 && presence_penalty <= 2))
    fail("sampling parameter presence_penalty must be in [-2, 2], got ", presence_penalty);
  if (!(frequency_penalty >= -2 && frequency_penalty <= 2))
    fail("sampling parameter frequency_penalty must be in [-2, 2], got ", frequency_penalty);
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0) fail("sampling parameter logit_bias: token id ", id, " is negative");
    if (!(bias >= -100 && bias <= 100))
      fail("sampling parameter logit_bias of token ", id, " must be in [-100, 100], got ", bias);
  }
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
  params_.validate();
}

double Sampler::uniform() {
  return static_cast<double>(rng_() >> 11) * 0x1.0p-53;
}

void Sampler::build(std::span<const float> logits, std::span<const int32_t> previous_tokens,
                    size_t generated) {
  const size_t n = logits.size();
  if (n == 0) fail("sampler: empty logits");
  penalized_.assign(logits.begin(), logits.end());
  for (const auto& [id, bias] : params_.logit_bias)
    if (static_cast<size_t>(id) < n) penalized_[size_t(id)] += bias;
  if (params_.repetition_penalty != 1.0f) {
    // Once per distinct token, however often it occurred (as Hugging Face does).
    seen_.assign(n, 0);
    for (const int32_t id : previous_tokens) {
      if (id < 0 || static_cast<size_t>(id) >= n || seen_[size_t(id)]) continue;
      seen_[size_t(id)] = 1;
      float& x = penalized_[size_t(id)];
      x = x > 0 ? x / params_.repetition_penalty : x * params_.repetition_penalty;
    }
  }
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) {
    const auto output = previous_tokens.last(std::min(generated, previous_tokens.size()));
    // All zero between calls (each count set is cleared below), so a token costs its output's
    // length, not the vocabulary's.
    if (counts_.size() != n) counts_.assign(n, 0);
    for (const int32_t id : output)
      if (id >= 0 && static_cast<size_t>(id) < n) ++counts_[size_t(id)];
    for (const int32_t id : output) {
      if (id < 0 || static_cast<size_t>(id) >= n || counts_[size_t(id)] == 0) continue;
      const float count = float(counts_[size_t(id)]);
      penalized_[size_t(id)] -= count * params_.frequency_penalty + params_.presence_penalty;
      counts_[size_t(id)] = 0;  // once per distinct token
    }
  }

  kept_.clear();
  if (params_.temperature == 0.0f) {
    size_t best = n;
    for (size_t i = 0; i < n; ++i)
      if (!std::isnan(penalized_[i]) && (best == n || penalized_[i] > penalized_[best])) best = i;
    if (best == n || penalized_[best] == -std::numeric_limits<float>::infinity())
      fail("sampler: no logit is finite or +inf (", n, " logits)");
    kept_.push_back({static_cast<int32_t>(best), 1.0});
    return;
  }

  // Candidates in id order, scaled by temperature; NaN and -inf can never be drawn.
  candidates_.clear();
  double top = -kInf;
  for (size_t i = 0; i < n; ++i) {
    const float x = penalized_[i];
    if (std::isnan(x) || x == -std::numeric_limits<float>::infinity()) continue;
    const double z = static_cast<double>(x) / static_cast<double>(params_.temperature);
    candidates_.push_back({z, 0.0, static_cast<int32_t>(i)});
    top = std::max(top, z);
  }
  if (candidates_.empty()) fail("sampler: no logit is finite or +inf (", n, " logits)");
  if (top == kInf) {  // +inf logits share all the probability
    std::erase_if(candidates_, [](const Candidate& c) { return c.logit != kInf; });
    for (auto& c : candidates_) c.logit = 0.0;
    top = 0.0;
  }

  // A strict total order, so the kept set and its order never depend on the sort implementation.
  const auto more_likely = [](const Candidate& a, const Candidate& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  };
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < candidates_.size()) {
    std::nth_element(candidates_.begin(), candidates_.begin() + params_.top_k, candidates_.end(),
                     more_likely);
    candidates_.resize(static_cast<size_t>(params_.top_k));
    std::sort(candidates_.begin(), candidates_.end(), more_likely);
  }

  double total = 0.0;
  for (auto& c : candidates_) total += c.weight = std::exp(c.logit - top);

  if (params_.top_p < 1.0f) {
    // Sort only as far as needed: the nucleus is usually a small head of the vocabulary.
    const double target = static_cast<double>(params_.top_p) * total;
    double cumulative = 0.0;
    size_t sorted = 0, keep = 0;
    for (size_t m = std::min<size_t>(64, candidates_.size()); keep == 0;
         m = std::min(m * 4, candidates_.size())) {
      std::partial_sort(candidates_.begin() + std::ptrdiff_t(sorted),
                        candidates_.begin() + std::ptrdiff_t(m), candidates_.end(), more_likely);
      for (; sorted < m && keep == 0; ++sorted) {
        cumulative += candidates_[sorted].weight;
        if (cumulative >= target) keep = sorted + 1;
      }
      if (sorted == candidates_.size()) keep = sorted;  // rounding left the sum just short
    }
    candidates_.resize(keep);
  }

  // The most likely token has weight exp(0) = 1, so min_p compares weights directly.
  const double min_weight = static_cast<double>(params_.min_p);
  double kept_total = 0.0;
  for (const auto& c : candidates_)
    if (c.weight >= min_weight) kept_total += c.weight;
  for (const auto& c : candidates_)
    if (c.weight >= min_weight) kept_.push_back({c.id, c.weight / kept_total});
}

int32_t Sampler::sample(std::span<const float> logits, std::span<const int32_t> previous_tokens,
                        size_t generated) {
  build(logits, previous_tokens, generated);
  if (kept_.size() == 1) return kept_[0].id;  // greedy draws no random number
  const double u = uniform();
  double cumulative = 0.0;
  for (const auto& t : kept_) {
    cumulative += t.p;
    if (u < cumulative) return t.id;
  }
  return kept_.back().id;  // u just below 1 and rounding in the sum
}

std::vector<TokenProbability> Sampler::distribution(std::span<const float> logits,
                                                    std::span<const int32_t> previous_tokens,
                                                    size_t generated) {
  build(logits, previous_tokens, generated);
  std::vector<TokenProbability> out = kept_;
  std::sort(out.begin(), out.end(), [](const TokenProbability& a, const TokenProbability& b) {
    return a.p > b.p || (a.p == b.p && a.id < b.id);
  });
  return out;
}

std::vector<float> log_softmax(std::span<const float> logits) {
  if (logits.empty()) fail("log_softmax: empty logits");
  double top = -kInf;
  size_t infinite = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isnan(logits[i])) fail("log_softmax: logit ", i, " is NaN");
    if (logits[i] == std::numeric_limits<float>::infinity()) ++infinite;
    top = std::max(top, static_cast<double>(logits[i]));
  }
  if (top == -kInf) fail("log_softmax: all ", logits.size(), " logits are -inf");
  std::vector<float> out(logits.size());
  if (infinite > 0) {
    const float share = static_cast<float>(-std::log(static_cast<double>(infinite)));
    for (size_t i = 0; i < logits.size(); ++i)
      out[i] = logits[i] == std::numeric_limits<float>::infinity()
                   ? share
                   : -std::numeric_limits<float>::infinity();
    return out;
  }
  double sum = 0.0;
  for (const float x : logits) sum += std::exp(static_cast<double>(x) - top);
  const double lse = top + std::log(sum);
  for (size_t i = 0; i < logits.size(); ++i)
    out[i] = static_cast<float>(static_cast<double>(logits[i]) - lse);
  return out;
}

// --- stopping
// ----------------------------------------------------------------------------------------

const char* to_string(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kNone:
      break;
  }
  return "";
}

StopChecker::StopChecker(StopConditions conditions) : conditions_(std::move(conditions)) {
  for (size_t i = 0; i < conditions_.stop_strings.size(); ++i) {
    if (conditions_.stop_strings[i].empty()) fail("stop string ", i, " is empty");
    longest_stop_ = std::max(longest_stop_, conditions_.stop_strings[i].size());
  }
}

// Returns the pending text that can no longer be part of a stop string (all of it if `final`), or
// the text before the first stop string, which ends generation.
std::string StopChecker::release(bool final) {
  size_t first = std::string::npos;
  for (const auto& stop : conditions_.stop_strings) {
    const size_t at = pending_.find(stop);
    if (at < first) {
      first = at;
      matched_ = stop;
    }
  }
  size_t cut = pending_.size();
  if (first != std::string::npos) {
    cut = first;
    string_matched_ = true;
    reason_ = FinishReason::kStop;
  } else if (!final) {
    // Hold back the longest tail that a stop string starts with (an occurrence must begin there).
    for (size_t len = std::min(pending_.size(), longest_stop_ - std::min<size_t>(longest_stop_, 1));
         len > 0; --len) {
      const std::string_view tail = std::string_view(pending_).substr(pending_.size() - len);
      const bool starts_stop = std::any_of(
          conditions_.stop_strings.begin(), conditions_.stop_strings.end(),
          [&](const std::string& stop) { return stop.size() > len && stop.starts_with(tail); });
      if (starts_stop) {
        cut = pending_.size() - len;
        break;
      }
    }
  }
  std::string out = pending_.substr(0, cut);
  pending_ = string_matched_ ? std::string() : pending_.substr(cut);
  text_ += out;
  return out;
}

std::string StopChecker::push(int32_t token, std::string_view new_text) {
  if (done())
    fail("StopChecker: token ", token, " pushed after generation finished (", to_string(reason_),
         ")");
  ++tokens_;
  pending_ += new_text;
  std::string out = release(false);
  if (done()) return out;
  const auto& ids = conditions_.stop_ids;
  if (std::find(ids.begin(), ids.end(), token) != ids.end()) {
    reason_ = FinishReason::kStop;
  } else if (tokens_ >= conditions_.max_tokens) {
    reason_ = FinishReason::kLength;
  }
  return out;
}

std::string StopChecker::finish(std::string_view tail) {
  if (finished_ || string_matched_) {
    finished_ = true;
    return {};
  }
  finished_ = true;
  pending_ += tail;
  std::string out = release(true);
  if (reason_ == FinishReason::kNone) reason_ = FinishReason::kLength;
  return out;
}

}  // namespace bitdelta
