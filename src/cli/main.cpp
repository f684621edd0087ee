// bitdelta: serve many fine-tuned variants of one LLM from one copy of the base weights.
#include <cstdio>
#include <exception>
#include <string>

#include "commands.h"

namespace {

// The argument parser reads "-1" for an unsigned option as 2^64 - 1 (strtoull wraps), which asked
// for that many threads, or no limit on tokens. Every unsigned option of every subcommand refuses
// a negative value instead, by the name the parser gives their type.
void refuse_negative_counts(CLI::App& app) {
  for (CLI::Option* o : app.get_options())
    if (o->get_type_name().find("UINT") != std::string::npos)
      o->check(CLI::Validator(
          [](std::string& v) {
            const auto at = v.find_first_not_of(" \t");
            return at != std::string::npos && v[at] == '-' ? "must not be negative, got " + v
                                                           : std::string();
          },
          ""));
  for (CLI::App* sub : app.get_subcommands({})) refuse_negative_counts(*sub);
}

}  // namespace

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
  refuse_negative_counts(app);
  // The parser would call an unknown first word "A subcommand is required"; name it instead.
  if (argc > 1 && argv[1][0] != '-') {
    std::string names;
    bool known = false;
    for (const CLI::App* sub : app.get_subcommands({})) {
      known = known || sub->get_name() == argv[1];
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known) {
      std::fprintf(stderr, "bitdelta: error: unknown subcommand '%s' (one of: %s)\n", argv[1],
                   names.c_str());
      return int(CLI::ExitCodes::ExtrasError);
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    // Bad arguments are one line too, in the same form as every other error.
    std::fprintf(stderr, "bitdelta: error: %s (see --help)\n", e.what());
    return e.get_exit_code();
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
