// Each subcommand lives in its own file and registers itself on the CLI11 app.
#pragma once

#include <CLI/CLI.hpp>

namespace bitdelta::cli {

void add_compress_command(CLI::App& app);
void add_inspect_command(CLI::App& app);
void add_apply_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_score_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_serve_command(CLI::App& app);
void add_bench_command(CLI::App& app);  // bench serve

}  // namespace bitdelta::cli
