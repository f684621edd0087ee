// bitdelta inspect FILE [--json]: a .bitdelta file, a checkpoint directory or a safetensors file.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "bitdelta/checkpoint.h"
#include "bitdelta/delta_file.h"
#include "bitdelta/error.h"
#include "bitdelta/fingerprint.h"
#include "cli_util.h"
#include "commands.h"

namespace bitdelta::cli {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json stats(std::vector<float> v) {
  if (v.empty()) return json::object();
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (float x : v) sum += x;
  return {{"count", v.size()}, {"min", v.front()}, {"median", v[v.size() / 2]}, {"max", v.back()},
          {"mean", sum / double(v.size())}};
}

std::vector<float> alphas_of(const CompressedWeight& w) {
  std::vector<float> a(w.alpha.shape[0]);
  std::memcpy(a.data(), w.alpha.data.data(), a.size() * 4);
  return a;
}

json inspect_delta(const fs::path& path) {
  const DeltaFile delta(path);
  json j = {{"kind", "bitdelta"}, {"path", path.string()}, {"file_bytes", delta.file().file_size()},
            {"format_version", delta.meta("format_version")}, {"base_fingerprint", delta.base_fingerprint()},
            {"finetuned_fingerprint", delta.meta("finetuned_fingerprint")},
            {"alpha_mode", delta.meta("alpha_mode")}, {"alpha_source", delta.meta("alpha_source")},
            {"architecture", delta.meta("architecture")}, {"created_by", delta.meta("created_by")},
            {"metadata", delta.metadata()}};
  std::vector<float> all;
  json compressed = json::array();
  for (const auto& w : delta.compressed()) {
    auto a = alphas_of(w);
    all.insert(all.end(), a.begin(), a.end());
    compressed.push_back({{"name", w.name}, {"sign_shape", w.signs.shape}, {"alpha_shape", w.alpha.shape},
                          {"bytes", w.signs.data.size() + w.alpha.data.size()}, {"alpha", stats(std::move(a))}});
  }
  json whole = json::array();
  for (const auto& p : delta.whole())
    whole.push_back({{"name", p.name}, {"dtype", dtype_name(p.value.dtype)}, {"shape", p.value.shape},
                     {"bytes", p.value.data.size()}});
  j["compressed"] = compressed;
  j["whole"] = whole;
  j["alpha"] = stats(std::move(all));
  return j;
}

json tensor_list(const std::vector<TensorInfo>& tensors, json& dtypes, uint64_t& total, uint64_t& params) {
  json list = json::array();
  for (const auto& t : tensors) {
    list.push_back({{"name", t.name}, {"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"bytes", t.bytes()}});
    const std::string d(dtype_name(t.dtype));
    dtypes[d] = dtypes.value(d, uint64_t(0)) + t.bytes();
    total += t.bytes();
    params += numel(t.shape);
  }
  return list;
}

json inspect_checkpoint(const fs::path& dir) {
  const Checkpoint ckpt(dir);
  std::vector<TensorInfo> infos;
  for (const auto& name : ckpt.tensor_names()) infos.push_back(ckpt.info(name));
  json dtypes = json::object();
  uint64_t total = 0, params = 0;
  json tensors = tensor_list(infos, dtypes, total, params);
  return {{"kind", "checkpoint"}, {"path", dir.string()}, {"architecture", ckpt.architecture()},
          {"model_type", ckpt.config().value("model_type", "")}, {"fingerprint", fingerprint(ckpt)},
          {"shards", ckpt.shard_names()}, {"parameters", params}, {"tensor_bytes", total},
          {"dtypes", dtypes}, {"tensors", tensors}};
}

json inspect_safetensors(const fs::path& path) {
  const SafetensorsFile file(path);
  json dtypes = json::object();
  uint64_t total = 0, params = 0;
  json tensors = tensor_list(file.tensors(), dtypes, total, params);
  return {{"kind", "safetensors"}, {"path", path.string()}, {"metadata", file.metadata()},
          {"parameters", params}, {"tensor_bytes", total}, {"dtypes", dtypes}, {"tensors", tensors}};
}

std::string shape_of(const json& s) { return shape_str(s.get<Shape>()); }

void print_text(const json& j) {
  const std::string kind = j["kind"];
  if (kind == "bitdelta") {
    std::printf("%s: bitdelta delta, format version %s, %s\n", j["path"].get<std::string>().c_str(),
                j["format_version"].get<std::string>().c_str(), human_bytes(j["file_bytes"].get<double>()).c_str());
    std::printf("  architecture           %s\n", j["architecture"].get<std::string>().c_str());
    std::printf("  base fingerprint       %s\n", j["base_fingerprint"].get<std::string>().c_str());
    std::printf("  fine-tune fingerprint  %s\n", j["finetuned_fingerprint"].get<std::string>().c_str());
    std::printf("  alpha                  per %s, from %s\n", j["alpha_mode"].get<std::string>().c_str(),
                j["alpha_source"].get<std::string>().c_str());
    std::printf("  created by             %s\n", j["created_by"].get<std::string>().c_str());
    if (!j["alpha"].empty())
      std::printf("  alpha over %zu values:  min %.4g  median %.4g  max %.4g  mean %.4g\n",
                  j["alpha"]["count"].get<size_t>(), j["alpha"]["min"].get<double>(),
                  j["alpha"]["median"].get<double>(), j["alpha"]["max"].get<double>(),
                  j["alpha"]["mean"].get<double>());
    std::printf("  %zu compressed weights (1 bit each + alpha):\n", j["compressed"].size());
    for (const auto& w : j["compressed"])
      std::printf("    %-52s signs %-14s alpha %-8s %10s  alpha median %.4g\n", w["name"].get<std::string>().c_str(),
                  shape_of(w["sign_shape"]).c_str(), shape_of(w["alpha_shape"]).c_str(),
                  human_bytes(w["bytes"].get<double>()).c_str(), w["alpha"].value("median", 0.0));
    std::printf("  %zu parameters stored whole:\n", j["whole"].size());
    for (const auto& p : j["whole"])
      std::printf("    %-52s %-5s %-14s %10s\n", p["name"].get<std::string>().c_str(),
                  p["dtype"].get<std::string>().c_str(), shape_of(p["shape"]).c_str(),
                  human_bytes(p["bytes"].get<double>()).c_str());
    return;
  }
  std::printf("%s: %s\n", j["path"].get<std::string>().c_str(),
              kind == "checkpoint" ? "Hugging Face checkpoint" : "safetensors file");
  if (kind == "checkpoint") {
    std::printf("  architecture  %s (model_type %s)\n", j["architecture"].get<std::string>().c_str(),
                j["model_type"].get<std::string>().c_str());
    std::printf("  fingerprint   %s\n", j["fingerprint"].get<std::string>().c_str());
    std::printf("  shards        %zu\n", j["shards"].size());
  }
  std::printf("  parameters    %llu in %zu tensors, %s\n", (unsigned long long)j["parameters"].get<uint64_t>(),
              j["tensors"].size(), human_bytes(j["tensor_bytes"].get<double>()).c_str());
  for (const auto& [d, bytes] : j["dtypes"].items())
    std::printf("  %-13s %s\n", d.c_str(), human_bytes(bytes.get<double>()).c_str());
  for (const auto& t : j["tensors"])
    std::printf("    %-56s %-5s %-16s %10s\n", t["name"].get<std::string>().c_str(),
                t["dtype"].get<std::string>().c_str(), shape_of(t["shape"]).c_str(),
                human_bytes(t["bytes"].get<double>()).c_str());
}

}  // namespace

void add_inspect_command(CLI::App& app) {
  auto path = std::make_shared<std::string>();
  auto as_json = std::make_shared<bool>(false);
  auto* cmd = app.add_subcommand("inspect", "Describe a .bitdelta file, a checkpoint directory or a safetensors file");
  cmd->add_option("FILE", *path, "Path to inspect")->required();
  cmd->add_flag("--json", *as_json, "Print JSON");
  cmd->callback([path, as_json] {
    std::error_code ec;
    json j;
    if (fs::is_directory(*path, ec)) {
      j = inspect_checkpoint(*path);
    } else {
      const SafetensorsFile probe(*path);
      const auto& md = probe.metadata();
      auto it = md.find("format");
      j = it != md.end() && it->second == kDeltaFormat ? inspect_delta(*path) : inspect_safetensors(*path);
    }
    if (*as_json)
      std::printf("%s\n", j.dump(2).c_str());
    else
      print_text(j);
  });
}

}  // namespace bitdelta::cli
