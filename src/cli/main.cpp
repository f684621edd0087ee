// bitdelta: serve many fine-tuned variants of one LLM from one copy of the base weights.
#include <cstdio>
#include <exception>
#include <string>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"bitdelta: 1-bit deltas of fine-tuned LLMs, served from one base"};
  app.set_version_flag("--version", std::string("bitdelta ") + BITDELTA_VERSION);
  app.require_subcommand(1);
  bitdelta::cli::add_compress_command(app);
  bitdelta::cli::add_inspect_command(app);
  bitdelta::cli::add_apply_command(app);
  bitdelta::cli::add_generate_command(app);
  bitdelta::cli::add_score_command(app);
  bitdelta::cli::add_eval_command(app);
  bitdelta::cli::add_serve_command(app);
  bitdelta::cli::add_bench_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    // One line on stderr naming what was wrong; the library's messages carry file and tensor.
    std::string msg = e.what();
    for (auto& c : msg)
      if (c == '\n') c = ' ';
    std::fprintf(stderr, "bitdelta: error: %s\n", msg.c_str());
    return 1;
  }
  return 0;
}
