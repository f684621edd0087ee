// bitdelta apply BASE DELTA -o OUT_DIR [--force]
#include "bitdelta/apply.h"

#include <cstdio>
#include <optional>

#include "cli_util.h"
#include "commands.h"

namespace bitdelta::cli {

void add_apply_command(CLI::App& app) {
  struct Args {
    std::string base, delta, out;
    bool force = false;
    size_t threads = 0;
  };
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("apply", "Write a variant (base + delta) as a complete Hugging Face checkpoint");
  cmd->add_option("BASE", args->base, "Base checkpoint directory")->required();
  cmd->add_option("DELTA", args->delta, ".bitdelta file")->required();
  cmd->add_option("-o,--output", args->out, "Output checkpoint directory (must not exist, or be empty)")->required();
  cmd->add_flag("--force", args->force, "Apply even if the delta was made for another base fingerprint");
  cmd->add_option("--threads", args->threads, "Worker threads (0: all cores)");
  cmd->callback([args] {
    const Checkpoint base(args->base);
    const DeltaFile delta(args->delta);
    ApplyOptions options;
    options.force = args->force;
    options.threads = args->threads;
    std::optional<ProgressBar> bar(std::in_place, "apply");
    options.on_progress = [&](size_t done, size_t total) { bar->update(done, total, done, total); };
    apply_delta(base, delta, args->out, options);
    bar.reset();
    std::printf("wrote %s: %s with %zu compressed and %zu whole tensors from %s\n", args->out.c_str(),
                args->base.c_str(), delta.compressed().size(), delta.whole().size(), args->delta.c_str());
  });
}

}  // namespace bitdelta::cli
