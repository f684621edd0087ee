// Choosing the next token from logits (logit bias, repetition, presence and frequency penalties,
// temperature, top-k, top-p, min-p), deciding when generation stops (EOS, stop strings, token
// limit), and log-softmax for logprobs.
#pragma once

#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace bitdelta {

struct SamplingParams {
  float temperature = 1.0f;         // 0 = greedy (argmax, lowest id on ties)
  int top_k = 0;                    // keep the k most likely tokens; 0 = off
  float top_p = 1.0f;               // keep the smallest set with probability >= top_p; in (0, 1]
  float min_p = 0.0f;               // drop tokens with p < min_p * p_max; in [0, 1]
  float repetition_penalty = 1.0f;  // > 0; 1 = off
  float presence_penalty = 0.0f;    // in [-2, 2]: subtracted once from each id already generated
  float frequency_penalty = 0.0f;   // in [-2, 2]: subtracted per time an id was generated
  uint64_t seed = 0;
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token id, added to its logit: [-100, 100])

  // Throws Error naming the first bad field and its value.
  void validate() const;
};

// One token of the distribution a Sampler draws from.
struct TokenProbability {
  int32_t id;
  double p;
};

// Samples tokens of one sequence. Deterministic: the same params (seed included), logits and
// previous tokens give the same tokens on every platform (mt19937_64 with our own bits-to-double;
// the standard distributions are implementation-defined). Not thread-safe: one per sequence.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);  // validates

  // previous_tokens are the sequence's tokens so far, the last `generated` of them its output
  // (the rest its prompt). Order: logit bias (added) -> repetition penalty (for ids anywhere in
  // previous_tokens, once each: logit > 0 -> logit / penalty, else logit * penalty) -> presence and
  // frequency penalties (for ids in the output, as the OpenAI API defines them: logit -= count *
  // frequency + presence) -> greedy if temperature == 0 -> temperature -> top-k (exactly k, lower
  // id first among equal logits) -> softmax -> top-p -> min-p -> renormalize -> draw. NaN logits
  // are never chosen. Ids outside the logits (in previous_tokens or logit_bias) are ignored. Throws
  // Error if logits is empty or has no finite or +inf value.
  int32_t sample(std::span<const float> logits, std::span<const int32_t> previous_tokens,
                 size_t generated = 0);

  // The renormalized distribution sample() draws from, most likely first (ties: lower id first).
  // For greedy it is the single argmax with p = 1. Consumes no randomness.
  std::vector<TokenProbability> distribution(std::span<const float> logits,
                                             std::span<const int32_t> previous_tokens,
                                             size_t generated = 0);

  const SamplingParams& params() const { return params_; }

 private:
  struct Candidate {
    double logit;   // after penalty and temperature
    double weight;  // exp(logit - max logit)
    int32_t id;
  };
  void build(std::span<const float> logits, std::span<const int32_t> previous_tokens,
             size_t generated);
  double uniform();  // [0, 1), 53 random bits

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<float> penalized_;        // scratch: logits after the bias and penalties
  std::vector<uint8_t> seen_;           // scratch: marks of previous tokens
  std::vector<uint32_t> counts_;        // scratch: how often each id was generated
  std::vector<Candidate> candidates_;   // scratch
  std::vector<TokenProbability> kept_;  // the distribution of the last build()
};

// log(softmax(logits)), with the log-sum-exp accumulated in float64. -inf stays -inf; if some
// logits are +inf they share all the probability. Throws Error if logits is empty, has a NaN, or is
// all -inf.
std::vector<float> log_softmax(std::span<const float> logits);

// Why generation ended, as the OpenAI API names it.
enum class FinishReason { kNone, kStop, kLength };
const char* to_string(FinishReason reason);  // "", "stop", "length"

struct StopConditions {
  std::vector<int32_t> stop_ids;          // e.g. Tokenizer::eos_ids(); empty = ignore EOS
  std::vector<std::string> stop_strings;  // matched in the generated text, never empty strings
  size_t max_tokens = std::numeric_limits<size_t>::max();
};

// Decides when one sequence stops and which text may be sent. Feed it each generated token with the
// text that became final with it (StreamDecoder::push); it returns the text safe to send now,
// holding back a tail that might be the start of a stop string. The output text never contains a
// stop string: it ends just before the first one. Stop strings may span tokens.
class StopChecker {
 public:
  explicit StopChecker(StopConditions conditions);  // throws Error on an empty stop string

  // Counts the token, appends `new_text` (for a stop id too: EOS decodes to nothing, but it can
  // flush bytes held back by the decoder), then checks stop strings, stop ids and max_tokens in
  // that order. Throws Error if called after done().
  std::string push(int32_t token, std::string_view new_text);
  // Call once at the end, with the decoder's finish() text: returns the rest of the text to send
  // (up to a stop string, if one completes). If nothing stopped generation before, the reason
  // becomes kLength (the caller ran out of room) unless a stop string completes here.
  std::string finish(std::string_view tail);

  bool done() const { return reason_ != FinishReason::kNone; }
  FinishReason reason() const { return reason_; }
  const std::string& text() const { return text_; }            // all text returned so far
  const std::string& stop_string() const { return matched_; }  // the stop string hit, if any
  size_t tokens() const { return tokens_; }

 private:
  std::string release(bool final);

  StopConditions conditions_;
  size_t longest_stop_ = 0;
  FinishReason reason_ = FinishReason::kNone;
  bool finished_ = false;
  bool string_matched_ = false;
  size_t tokens_ = 0;
  std::string pending_;  // text received but not yet returned
  std::string text_;
  std::string matched_;
};

}  // namespace bitdelta
