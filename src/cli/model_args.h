// What the subcommands that run a model share: the base directory, an optional delta, threads, device.
#pragma once

#include <climits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bitdelta/error.h"
#include "bitdelta/model.h"
#include "commands.h"

namespace bitdelta::cli {

struct ModelArgs {
  std::string base, delta, device = "cpu";
  size_t threads = 0;
  bool force = false, cuda_graphs = true;
};

// --cuda-graphs on|off (ModelOptions::cuda_graphs), its default shown from `cuda_graphs`.
inline CLI::Option* add_cuda_graphs_option(CLI::App* cmd, bool& cuda_graphs) {
  return cmd
      ->add_option("--cuda-graphs", cuda_graphs,
                   "cuda: replay a decode step as a CUDA graph when the batch stays (on or off)")
      ->type_name("on|off")
      ->default_str(cuda_graphs ? "on" : "off");
}

// --device: cpu | cuda | cuda:N, and --cuda-graphs (every subcommand that runs a model has them).
inline void add_device_option(CLI::App* cmd, std::string& device, bool& cuda_graphs) {
  cmd->add_option("--device", device, "cpu, cuda or cuda:N")->capture_default_str();
  add_cuda_graphs_option(cmd, cuda_graphs);
}


inline void add_model_options(CLI::App* cmd, ModelArgs& a) {
  cmd->add_option("BASE", a.base, "Base checkpoint directory")->required();
  cmd->add_option("--delta", a.delta, "A .bitdelta file: run this variant instead of the base");
  cmd->add_option("--threads", a.threads, "Worker threads (0: all cores)");
  cmd->add_flag("--force", a.force, "Accept a delta made for a base with another fingerprint");
  add_device_option(cmd, a.device, a.cuda_graphs);
}

// The model and the id of the variant to run (0: the base).
inline std::pair<std::unique_ptr<Model>, int> load(const ModelArgs& a) {
  auto model =
      std::make_unique<Model>(a.base, model_options(a.device, a.threads, ModelOptions{}.host_cache_bytes, a.cuda_graphs));
  const int variant = a.delta.empty() ? 0 : model->add_variant("variant", a.delta, a.force);
  return {std::move(model), variant};
}

inline std::vector<int32_t> parse_ids(const std::string& text, const char* option) {
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

}  // namespace bitdelta::cli
