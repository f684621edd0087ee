#include "bitdelta/evaluate.h"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "bitdelta/error.h"
#include "bitdelta/sampler.h"

namespace bitdelta {

namespace {

// Sequences per forward step: enough rows to amortize each weight read over many tokens.
constexpr size_t kSequencesPerStep = 8;
constexpr size_t kProblemsPerStep = 64;

std::string strip(std::string s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

}  // namespace

Perplexity perplexity(Model& model, int variant, const std::vector<int32_t>& ids, int32_t bos, size_t chunk) {
  if (chunk < 2) fail("perplexity: chunk must be at least 2 tokens");
  if (bos < 0) fail("perplexity: the tokenizer has no BOS token");
  std::vector<std::vector<int32_t>> pieces;
  for (size_t i = 0; i < ids.size(); i += chunk - 1) {
    std::vector<int32_t> p{bos};
    p.insert(p.end(), ids.begin() + long(i), ids.begin() + long(std::min(ids.size(), i + chunk - 1)));
    pieces.push_back(std::move(p));
  }
  const size_t V = model.config().vocab_size;
  Perplexity r;
  for (size_t p0 = 0; p0 < pieces.size(); p0 += kSequencesPerStep) {
    const size_t np = std::min(kSequencesPerStep, pieces.size() - p0);
    std::vector<Sequence> seqs;
    for (size_t i = 0; i < np; ++i) seqs.push_back(model.new_sequence(variant));
    std::vector<ForwardRow> rows;
    for (size_t i = 0; i < np; ++i)
      for (int32_t t : pieces[p0 + i]) rows.push_back({&seqs[i], t, true});
    const auto logits = model.forward(rows);
    size_t at = 0;
    for (size_t i = 0; i < np; ++i) {
      const auto& piece = pieces[p0 + i];
      for (size_t j = 0; j + 1 < piece.size(); ++j) {
        const auto lp = log_softmax(std::span(logits).subspan((at + j) * V, V));
        r.total_nll -= double(lp[size_t(piece[j + 1])]);
        ++r.tokens;
      }
      at += piece.size();
    }
  }
  r.value = r.tokens ? std::exp(r.total_nll / double(r.tokens)) : 0.0;
  return r;
}

std::vector<MathProblem> read_math_problems(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(path, ": cannot open");
  std::vector<MathProblem> out;
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (strip(line).empty()) continue;
    try {
      const auto j = nlohmann::json::parse(line);
      out.push_back({j.at("prompt").get<std::string>(), j.at("answer").get<std::string>()});
    } catch (const nlohmann::json::exception& e) {
      fail(path, ":", n, ": expected {\"prompt\": ..., \"answer\": ...} (", e.what(), ")");
    }
  }
  if (out.empty()) fail(path, ": no problems");
  return out;
}

double math_accuracy(Model& model, int variant, const Tokenizer& tokenizer, const std::vector<MathProblem>& problems,
                     size_t max_new) {
  if (problems.empty()) return 0;
  const size_t V = model.config().vocab_size;
  size_t correct = 0;
  for (size_t p0 = 0; p0 < problems.size(); p0 += kProblemsPerStep) {
    const size_t np = std::min(kProblemsPerStep, problems.size() - p0);
    std::vector<Sequence> seqs;
    std::vector<std::vector<int32_t>> generated(np);
    std::vector<bool> finished(np, false);
    std::vector<ForwardRow> rows;
    for (size_t i = 0; i < np; ++i) seqs.push_back(model.new_sequence(variant));
    for (size_t i = 0; i < np; ++i) {
      const auto ids = tokenizer.encode(problems[p0 + i].prompt, tokenizer.adds_bos());
      for (size_t j = 0; j < ids.size(); ++j) rows.push_back({&seqs[i], ids[j], j + 1 == ids.size()});
    }
    std::vector<size_t> active(np);
    for (size_t i = 0; i < np; ++i) active[i] = i;
    for (size_t step = 0; step < max_new && !active.empty(); ++step) {
      const auto logits = model.forward(rows);
      rows.clear();
      std::vector<size_t> still;
      for (size_t a = 0; a < active.size(); ++a) {
        const size_t i = active[a];
        const float* l = &logits[a * V];
        const int32_t next = int32_t(std::max_element(l, l + V) - l);  // greedy, lowest id on ties
        generated[i].push_back(next);
        if (tokenizer.is_eos(next)) continue;
        still.push_back(i);
        rows.push_back({&seqs[i], next, true});
      }
      active = std::move(still);
    }
    for (size_t i = 0; i < np; ++i) {
      auto& g = generated[i];
      for (size_t j = 0; j < g.size(); ++j)
        if (tokenizer.is_eos(g[j])) {
          g.resize(j);
          break;
        }
      std::string text = tokenizer.decode(g);
      text = text.substr(0, text.find('\n'));
      correct += strip(text) == problems[p0 + i].answer;
    }
  }
  return double(correct) / double(problems.size());
}

}  // namespace bitdelta
