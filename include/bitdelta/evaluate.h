// Quality measurements of a variant, batched across many sequences per forward step: perplexity
// on held-out text and exact-match accuracy on arithmetic problems (definitions in
// models/demo/README.md, shared with tools/demo_family/train.py).
#pragma once

#include <string>
#include <vector>

#include "bitdelta/model.h"
#include "bitdelta/tokenizer.h"

namespace bitdelta {

// The text's ids are cut into consecutive pieces of chunk−1 tokens, each prefixed by BOS; the
// result is exp(mean −log p(token)) over every position after the first of every piece.
struct Perplexity {
  double value = 0;
  double total_nll = 0;
  size_t tokens = 0;
};
Perplexity perplexity(Model& model, int variant, const std::vector<int32_t>& ids, int32_t bos, size_t chunk = 256);

struct MathProblem {
  std::string prompt, answer;
};
// Reads a JSON-lines file of {"prompt", "answer"} objects; throws naming the file and line.
std::vector<MathProblem> read_math_problems(const std::string& path);

// Greedy decoding of [BOS] + prompt for at most max_new tokens (stopping at EOS); the answer is
// the decoded text up to the first EOS, its first line, stripped of spaces; exact match counts.
double math_accuracy(Model& model, int variant, const Tokenizer& tokenizer, const std::vector<MathProblem>& problems,
                     size_t max_new = 8);

}  // namespace bitdelta
