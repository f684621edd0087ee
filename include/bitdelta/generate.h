// Running one sequence through a Model: scoring a prompt, and generating a continuation with a
// sampler, stop conditions and streamed text. (The server's scheduler batches many sequences;
// these are the single-sequence paths the CLI and the evaluator use.)
#pragma once

#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "bitdelta/model.h"
#include "bitdelta/sampler.h"
#include "bitdelta/tokenizer.h"

namespace bitdelta {

// Prompts are fed in chunks of at most this many tokens per forward step.
inline constexpr size_t kPrefillChunk = 256;

struct ScoreResult {
  std::vector<float> prompt_logprobs;  // log p(token i | tokens < i), for i = 1 .. n-1
  std::vector<float> last_logits;      // the final position's logits
};

// Throws Error on an empty prompt or an id outside the vocabulary.
ScoreResult score(Model& model, int variant, std::span<const int32_t> tokens);

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids (a stop id that ended generation included)
  std::vector<float> logprobs;  // log p of each generated id under the model's raw distribution
  std::string text;             // the text sent, up to any stop string
  FinishReason finish = FinishReason::kNone;
};

// Prefills `prompt` (non-empty), then samples until a stop condition holds. on_text receives the
// text as it becomes final (never a split UTF-8 character, never part of a stop string).
GenerateResult generate(Model& model, const Tokenizer& tokenizer, int variant, std::span<const int32_t> prompt,
                        const SamplingParams& sampling, StopConditions stop,
                        const std::function<void(std::string_view)>& on_text = {});

}  // namespace bitdelta
