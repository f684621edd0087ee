// bitdelta generate BASE [--delta FILE] (--prompt TEXT | --prompt-tokens 1,2,3) [--max-tokens N]
//   [--temperature T] [--top-p P] [--top-k K] [--min-p P] [--repetition-penalty R] [--seed S]
//   [--stop STR ...] [--json]
// bitdelta score BASE [--delta FILE] --tokens 1,2,3 [--json]
#include <cstdio>
#include <nlohmann/json.hpp>

#include "bitdelta/error.h"
#include "bitdelta/generate.h"
#include "commands.h"

namespace bitdelta::cli {

namespace {

struct ModelArgs {
  std::string base, delta;
  size_t threads = 0;
  bool force = false;
};

void add_model_options(CLI::App* cmd, ModelArgs& a) {
  cmd->add_option("BASE", a.base, "Base checkpoint directory")->required();
  cmd->add_option("--delta", a.delta, "A .bitdelta file: run this variant instead of the base");
  cmd->add_option("--threads", a.threads, "Worker threads (0: all cores)");
  cmd->add_flag("--force", a.force, "Accept a delta made for a base with another fingerprint");
}

// The model and the id of the variant to run (0: the base).
std::pair<std::unique_ptr<Model>, int> load(const ModelArgs& a) {
  auto model = std::make_unique<Model>(a.base, a.threads);
  const int variant = a.delta.empty() ? 0 : model->add_variant("variant", a.delta, a.force);
  return {std::move(model), variant};
}

std::vector<int32_t> parse_ids(const std::string& text, const char* option) {
  std::vector<int32_t> ids;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    try {
      size_t used = 0;
      const long v = std::stol(item, &used);
      if (used != item.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument("range");
      ids.push_back(int32_t(v));
    } catch (const std::exception&) {
      fail(option, ": '", item, "' is not a token id (expected comma-separated non-negative integers)");
    }
    at = comma + 1;
  }
  return ids;
}

}  // namespace

void add_generate_command(CLI::App& app) {
  struct Args {
    ModelArgs model;
    std::string prompt, prompt_tokens;
    size_t max_tokens = 128;
    SamplingParams sampling;
    std::vector<std::string> stop;
    bool json = false;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("generate", "Generate text from the base or a variant");
  add_model_options(cmd, a->model);
  auto* prompt = cmd->add_option("--prompt", a->prompt, "Prompt text (BOS is prepended)");
  auto* tokens = cmd->add_option("--prompt-tokens", a->prompt_tokens, "Prompt as token ids, e.g. 1,2,3 (used as is)");
  prompt->excludes(tokens);
  cmd->add_option("--max-tokens", a->max_tokens, "Most tokens to generate");
  cmd->add_option("--temperature", a->sampling.temperature, "0: greedy");
  cmd->add_option("--top-p", a->sampling.top_p);
  cmd->add_option("--top-k", a->sampling.top_k, "0: off");
  cmd->add_option("--min-p", a->sampling.min_p);
  cmd->add_option("--repetition-penalty", a->sampling.repetition_penalty);
  cmd->add_option("--seed", a->sampling.seed);
  cmd->add_option("--stop", a->stop, "Stop before this string (repeatable)");
  cmd->add_flag("--json", a->json, R"(Print {"tokens", "text", "logprobs"} instead of streaming text)");
  cmd->callback([a] {
    if (a->prompt.empty() && a->prompt_tokens.empty()) fail("generate: give --prompt or --prompt-tokens");
    a->sampling.validate();
    auto [model, variant] = load(a->model);
    const Tokenizer tokenizer(a->model.base);
    const auto ids = a->prompt_tokens.empty() ? tokenizer.encode(a->prompt, true) : parse_ids(a->prompt_tokens, "--prompt-tokens");
    StopConditions stop;
    stop.stop_ids = tokenizer.eos_ids();
    stop.stop_strings = a->stop;
    stop.max_tokens = a->max_tokens;
    const bool stream = !a->json;
    const auto r = generate(*model, tokenizer, variant, ids, a->sampling, stop, [&](std::string_view text) {
      if (stream) {
        std::fwrite(text.data(), 1, text.size(), stdout);
        std::fflush(stdout);
      }
    });
    if (stream) {
      std::printf("\n");
      std::fprintf(stderr, "[%zu tokens, finish_reason %s]\n", r.tokens.size(), to_string(r.finish));
      return;
    }
    const nlohmann::json j = {{"tokens", r.tokens}, {"text", r.text}, {"logprobs", r.logprobs},
                              {"finish_reason", to_string(r.finish)}, {"prompt_tokens", ids}};
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  });
}

void add_score_command(CLI::App& app) {
  struct Args {
    ModelArgs model;
    std::string tokens;
    bool json = false;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("score", "Log-probabilities of a token sequence under the base or a variant");
  add_model_options(cmd, a->model);
  cmd->add_option("--tokens", a->tokens, "Token ids, e.g. 1,2,3")->required();
  cmd->add_flag("--json", a->json, R"(Print {"prompt_logprobs", "last_logits"})");
  cmd->callback([a] {
    auto [model, variant] = load(a->model);
    const auto ids = parse_ids(a->tokens, "--tokens");
    const auto r = score(*model, variant, ids);
    if (a->json) {
      const nlohmann::json j = {{"prompt_logprobs", r.prompt_logprobs}, {"last_logits", r.last_logits}};
      std::printf("%s\n", j.dump().c_str());
      return;
    }
    double total = 0;
    for (float lp : r.prompt_logprobs) total += lp;
    std::printf("%zu tokens, total log-prob %.4f, mean %.4f\n", ids.size(), total,
                r.prompt_logprobs.empty() ? 0.0 : total / double(r.prompt_logprobs.size()));
    for (size_t i = 0; i < r.prompt_logprobs.size(); ++i) std::printf("  %6d  %.4f\n", ids[i + 1], r.prompt_logprobs[i]);
  });
}

}  // namespace bitdelta::cli
