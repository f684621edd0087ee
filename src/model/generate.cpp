#include "bitdelta/generate.h"

#include <algorithm>

#include "bitdelta/error.h"

namespace bitdelta {

namespace {

// Feeds tokens [from, to) of `tokens` to the sequence; returns the logits of every row when
// `all_logits`, else of the last row only.
std::vector<float> feed(Model& model, Sequence& seq, std::span<const int32_t> tokens, bool all_logits) {
  std::vector<float> logits;
  for (size_t at = 0; at < tokens.size(); at += kPrefillChunk) {
    const size_t n = std::min(kPrefillChunk, tokens.size() - at);
    std::vector<ForwardRow> rows(n);
    for (size_t i = 0; i < n; ++i) rows[i] = {&seq, tokens[at + i], all_logits || at + i + 1 == tokens.size()};
    auto l = model.forward(rows);
    logits.insert(logits.end(), l.begin(), l.end());
  }
  return logits;
}

}  // namespace

ScoreResult score(Model& model, int variant, std::span<const int32_t> tokens) {
  if (tokens.empty()) fail("score: the prompt is empty");
  auto seq = model.new_sequence(variant);
  const size_t V = model.config().vocab_size;
  const auto logits = feed(model, seq, tokens, true);
  ScoreResult r;
  for (size_t i = 1; i < tokens.size(); ++i) {
    const auto lp = log_softmax(std::span(logits).subspan((i - 1) * V, V));
    r.prompt_logprobs.push_back(lp[size_t(tokens[i])]);
  }
  r.last_logits.assign(logits.end() - long(V), logits.end());
  return r;
}

GenerateResult generate(Model& model, const Tokenizer& tokenizer, int variant, std::span<const int32_t> prompt,
                        const SamplingParams& sampling, StopConditions stop,
                        const std::function<void(std::string_view)>& on_text) {
  if (prompt.empty()) fail("generate: the prompt is empty");
  Sampler sampler(sampling);
  StopChecker checker(std::move(stop));
  StreamDecoder decoder(tokenizer);
  auto seq = model.new_sequence(variant);
  std::vector<int32_t> history(prompt.begin(), prompt.end());
  std::vector<float> logits = feed(model, seq, prompt, false);
  GenerateResult r;
  const size_t max_len = model.config().max_position;
  while (!checker.done()) {
    if (seq.length >= max_len) break;  // no room left: finish() reports "length"
    const int32_t token = sampler.sample(logits, history, r.tokens.size());
    r.tokens.push_back(token);
    r.logprobs.push_back(log_softmax(logits)[size_t(token)]);
    history.push_back(token);
    const std::string text = checker.push(token, decoder.push(token));
    if (on_text && !text.empty()) on_text(text);
    if (checker.done()) break;
    const ForwardRow row{&seq, token, true};
    logits = model.forward({&row, 1});
  }
  const std::string tail = checker.finish(decoder.finish());
  if (on_text && !tail.empty()) on_text(tail);
  r.text = checker.text();
  r.finish = checker.reason();
  return r;
}

}  // namespace bitdelta
