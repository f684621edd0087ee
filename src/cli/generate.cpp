// bitdelta generate BASE [--delta FILE] (--prompt TEXT | --prompt-tokens 1,2,3) [--max-tokens N]
//   [--temperature T] [--top-p P] [--top-k K] [--min-p P] [--repetition-penalty R]
//   [--presence-penalty P] [--frequency-penalty F] [--seed S] [--stop STR ...] [--json]
#include <cstdio>
#include <nlohmann/json.hpp>

#include "bitdelta/error.h"
#include "bitdelta/generate.h"
#include "commands.h"
#include "model_args.h"

namespace bitdelta::cli {

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
  cmd->add_option("--presence-penalty", a->sampling.presence_penalty, "[-2, 2], on generated tokens");
  cmd->add_option("--frequency-penalty", a->sampling.frequency_penalty,
                  "[-2, 2], per time a token was generated");
  cmd->add_option("--seed", a->sampling.seed);
  cmd->add_option("--stop", a->stop, "Stop before this string (repeatable)");
  cmd->add_flag("--json", a->json, R"(Print {"tokens", "text", "logprobs"} instead of streaming text)");
  cmd->callback([a] {
    if (a->prompt.empty() && a->prompt_tokens.empty()) fail("generate: give --prompt or --prompt-tokens");
    if (a->max_tokens == 0) fail("generate: --max-tokens must be at least 1");
    a->sampling.validate();
    auto [model, variant] = load(a->model);
    const Tokenizer tokenizer(a->model.base);
    const auto ids = a->prompt_tokens.empty() ? tokenizer.encode(a->prompt, tokenizer.adds_bos())
                                              : parse_ids(a->prompt_tokens, "--prompt-tokens");
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

}  // namespace bitdelta::cli
