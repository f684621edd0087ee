// bitdelta eval BASE --variant NAME=FT_DIR|DELTA ... [--text NAME=FILE ...] [--math FILE]
//   [--alpha row|tensor] [--threads N] [--json]
// What the 1 bit costs: per variant, perplexity on its domain's text for the base, the full
// fine-tune and BitDelta; the share of the fine-tune's improvement BitDelta keeps; math accuracy;
// sizes.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "bitdelta/compress.h"
#include "bitdelta/error.h"
#include "bitdelta/evaluate.h"
#include "cli_util.h"
#include "model_args.h"
#include "commands.h"

namespace bitdelta::cli {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::pair<std::string, std::string> split_pair(const std::string& s, const char* option) {
  const auto eq = s.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == s.size()) fail(option, ": expected NAME=PATH, got '", s, "'");
  return {s.substr(0, eq), s.substr(eq + 1)};
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, ": cannot open");
  return {std::istreambuf_iterator<char>(in), {}};
}

std::string fmt(double v, const char* f = "%.3f") {
  if (std::isnan(v)) return "-";
  char b[32];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

}  // namespace

void add_eval_command(CLI::App& app) {
  struct Args {
    std::string base, math, alpha = "row", device = "cpu";
    std::vector<std::string> variants, texts;
    size_t threads = 0;
    bool json = false, cuda_graphs = true;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("eval", "Measure what BitDelta costs in quality against the full fine-tunes");
  cmd->add_option("BASE", a->base, "Base checkpoint directory")->required();
  cmd->add_option("--variant", a->variants, "NAME=FT_DIR (compressed here) or NAME=FILE.bitdelta; repeatable")->required();
  cmd->add_option("--text", a->texts, "NAME=FILE: held-out text of variant NAME's domain; repeatable");
  cmd->add_option("--math", a->math, "JSON lines of {\"prompt\", \"answer\"}: exact-match accuracy of every model");
  cmd->add_option("--alpha", a->alpha, "Alpha mode when compressing")->check(CLI::IsMember({"row", "tensor"}));
  cmd->add_option("--threads", a->threads, "Worker threads (0: all cores)");
  cmd->add_flag("--json", a->json, "Print the results as JSON");
  add_device_option(cmd, a->device, a->cuda_graphs);
  cmd->callback([a] {
    const ModelOptions mo = model_options(a->device, a->threads, ModelOptions{}.host_cache_bytes, a->cuda_graphs);
    Model base(a->base, mo);
    const Tokenizer tokenizer(a->base);
    std::map<std::string, std::string> texts;
    for (const auto& t : a->texts) texts.insert(split_pair(t, "--text"));
    const auto problems = a->math.empty() ? std::vector<MathProblem>{} : read_math_problems(a->math);

    char tmpl[] = "/tmp/bitdelta-eval-XXXXXX";
    if (!::mkdtemp(tmpl)) fail("cannot create a temporary directory");
    struct Cleanup {
      fs::path p;
      ~Cleanup() {
        std::error_code ec;
        fs::remove_all(p, ec);
      }
    } cleanup{tmpl};

    const double nan = std::nan("");
    std::map<std::string, double> base_ppl;
    const double base_math = problems.empty() ? nan : math_accuracy(base, 0, tokenizer, problems);
    json results = json::array();
    for (const auto& spec : a->variants) {
      const auto [name, path] = split_pair(spec, "--variant");
      json r = {{"variant", name}};
      fs::path delta_path = path;
      std::unique_ptr<Model> full;
      if (fs::is_directory(path)) {
        delta_path = fs::path(tmpl) / (name + ".bitdelta");
        CompressOptions o;
        o.alpha_mode = alpha_mode_from_name(a->alpha);
        o.threads = a->threads;
        const auto report = compress(base.checkpoint(), Checkpoint(path), delta_path, o);
        r["finetuned_bytes"] = report.finetuned_bytes;
        full = std::make_unique<Model>(path, mo);
      }
      r["delta_bytes"] = fs::file_size(delta_path);
      const int id = base.add_variant(name, delta_path);
      r["alpha_mode"] = std::string(alpha_mode_name(base.variant(id).delta->alpha_mode()));

      double ppl_base = nan, ppl_full = nan, ppl_bd = nan;
      if (auto it = texts.find(name); it != texts.end()) {
        const auto ids = tokenizer.encode(read_text(it->second), false);
        if (!base_ppl.count(it->second)) base_ppl[it->second] = perplexity(base, 0, ids, tokenizer.bos_id()).value;
        ppl_base = base_ppl[it->second];
        ppl_bd = perplexity(base, id, ids, tokenizer.bos_id()).value;
        if (full) ppl_full = perplexity(*full, 0, ids, tokenizer.bos_id()).value;
        r["text"] = it->second;
        r["text_tokens"] = ids.size();
      }
      r["ppl_base"] = ppl_base;
      r["ppl_full"] = ppl_full;
      r["ppl_bitdelta"] = ppl_bd;
      // The share of the fine-tune's perplexity improvement that BitDelta keeps.
      r["kept"] = (ppl_base - ppl_bd) / (ppl_base - ppl_full);
      r["math_base"] = base_math;
      r["math_full"] = full && !problems.empty() ? math_accuracy(*full, 0, tokenizer, problems) : nan;
      r["math_bitdelta"] = problems.empty() ? nan : math_accuracy(base, id, tokenizer, problems);
      results.push_back(r);
    }
    auto num = [](const json& j, const char* k) {
      return j.contains(k) && j[k].is_number() ? j[k].get<double>() : std::nan("");
    };
    if (a->json) {
      std::printf("%s\n", results.dump(2).c_str());
      return;
    }
    std::printf("%-10s | %-33s | %-6s | %-23s | %s\n", "", "perplexity on its domain", "", "math accuracy", "size");
    std::printf("%-10s | %9s %9s %13s | %6s | %6s %6s %9s | %9s %9s %6s\n", "variant", "base", "full FT", "BitDelta",
                "kept", "base", "full", "BitDelta", "full FT", "delta", "ratio");
    for (const auto& r : results) {
      const double ft = num(r, "finetuned_bytes"), delta = num(r, "delta_bytes");
      std::printf("%-10s | %9s %9s %13s | %6s | %6s %6s %9s | %9s %9s %6s\n", r["variant"].get<std::string>().c_str(),
                  fmt(num(r, "ppl_base")).c_str(), fmt(num(r, "ppl_full")).c_str(),
                  fmt(num(r, "ppl_bitdelta")).c_str(), fmt(100 * num(r, "kept"), "%.1f%%").c_str(),
                  fmt(100 * num(r, "math_base"), "%.1f%%").c_str(), fmt(100 * num(r, "math_full"), "%.1f%%").c_str(),
                  fmt(100 * num(r, "math_bitdelta"), "%.1f%%").c_str(),
                  std::isnan(ft) ? "-" : human_bytes(ft).c_str(), human_bytes(delta).c_str(),
                  fmt(ft / delta, "%.1fx").c_str());
    }
  });
}

}  // namespace bitdelta::cli
