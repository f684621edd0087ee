// bitdelta compress BASE FINETUNED -o OUT.bitdelta [--alpha row|tensor] [--threads N]
#include "bitdelta/compress.h"

#include <algorithm>
#include <cstdio>
#include <optional>

#include "cli_util.h"
#include "commands.h"

namespace bitdelta::cli {

namespace {

struct CompressArgs {
  std::string base, finetuned, out, alpha = "row";
  size_t threads = 0;
};

void print_report(const CompressArgs& args, const CompressReport& r) {
  std::printf("compressed %s against %s -> %s\n", args.finetuned.c_str(), args.base.c_str(), args.out.c_str());
  std::printf("  input:   base %s, fine-tune %s\n", human_bytes(double(r.base_bytes)).c_str(),
              human_bytes(double(r.finetuned_bytes)).c_str());
  std::printf("  output:  %s, %.2fx smaller than the fine-tune (%zu weights compressed to 1 bit, %zu stored whole, "
              "%zu unchanged and omitted)\n",
              human_bytes(double(r.output_bytes)).c_str(), double(r.finetuned_bytes) / double(r.output_bytes),
              r.compressed, r.whole, r.omitted);
  std::printf("  time:    %.2f s (%s/s of input)\n", r.seconds,
              human_bytes(double(r.base_bytes + r.finetuned_bytes) / std::max(r.seconds, 1e-9)).c_str());
  if (r.errors.empty()) return;
  auto errs = r.errors;
  std::sort(errs.begin(), errs.end(), [](const auto& a, const auto& b) { return a.rel_error < b.rel_error; });
  std::printf("  relative error ||D - alpha*S|| / ||D|| over %zu compressed weights (alpha per %s):\n", errs.size(),
              args.alpha.c_str());
  std::printf("           min %.4f   median %.4f   max %.4f\n", errs.front().rel_error,
              errs[errs.size() / 2].rel_error, errs.back().rel_error);
  std::printf("  worst:\n");
  for (size_t i = 0; i < std::min<size_t>(5, errs.size()); ++i) {
    const auto& e = errs[errs.size() - 1 - i];
    std::printf("           %.4f  %s %s\n", e.rel_error, e.name.c_str(), shape_str(e.shape).c_str());
  }
}

}  // namespace

void add_compress_command(CLI::App& app) {
  auto args = std::make_shared<CompressArgs>();
  auto* cmd = app.add_subcommand("compress", "Compress a fine-tune against its base into a 1-bit delta file");
  cmd->add_option("BASE", args->base, "Base checkpoint directory")->required();
  cmd->add_option("FINETUNED", args->finetuned, "Fine-tuned checkpoint directory")->required();
  cmd->add_option("-o,--output", args->out, "Output .bitdelta file")->required();
  cmd->add_option("--alpha", args->alpha, "Scale granularity: one alpha per output row, or per tensor")
      ->check(CLI::IsMember({"row", "tensor"}));
  cmd->add_option("--threads", args->threads, "Worker threads (0: all cores)");
  cmd->callback([args] {
    const Checkpoint base(args->base);
    const Checkpoint finetuned(args->finetuned);
    CompressOptions options;
    options.alpha_mode = alpha_mode_from_name(args->alpha);
    options.threads = args->threads;
    options.created_by = std::string("bitdelta ") + BITDELTA_VERSION;
    std::optional<ProgressBar> bar(std::in_place, "compress");
    options.on_progress = [&](const CompressProgress& p) {
      bar->update(p.tensors_done, p.tensors_total, p.bytes_done, p.bytes_total);
    };
    const auto report = compress(base, finetuned, args->out, options);
    bar.reset();  // finish the progress line before the summary
    print_report(*args, report);
  });
}

}  // namespace bitdelta::cli
