// bitdelta score BASE [--delta FILE] --tokens 1,2,3 [--json]
#include <cstdio>
#include <nlohmann/json.hpp>

#include "bitdelta/generate.h"
#include "commands.h"
#include "model_args.h"

namespace bitdelta::cli {

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
