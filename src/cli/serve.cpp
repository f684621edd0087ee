// bitdelta serve [BASE] [--variant NAME=DELTA_OR_FT_DIR ...] [--config FILE] [--host H] [--port P]
//   [--api-key KEY] [--allowed-origin ORIGIN ...] [--max-batch-tokens N] [--max-running N]
//   [--max-queue N] [--delta-cache-bytes B]
//   [--pin NAME ...] [--protect-top N] [--variants-dir DIR] [--cache-dir DIR] [--threads N]
// With no BASE and no config it serves the demo family: models/demo/base and its four fine-tunes,
// compressed once into build/demo/<name>.bitdelta.
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <type_traits>

#include "bitdelta/compress.h"
#include "bitdelta/engine.h"
#include "bitdelta/error.h"
#include "bitdelta/server.h"
#include "cli_util.h"
#include "commands.h"
#include "model_args.h"

namespace bitdelta::cli {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct VariantSpec {
  std::string name;
  fs::path path;  // a .bitdelta file or a fine-tune checkpoint directory
  bool pinned = false;
};

struct ServeArgs {
  std::string base;
  std::vector<std::string> variant_args;  // NAME=PATH
  std::string config;
  ServerOptions server;
  EngineOptions engine;
  std::string delta_cache_bytes, host_cache_bytes, prefix_cache_bytes;
  std::string variants_dir, cache_dir;
  ServeArgs() { server.http_threads = 0; }  // 0: sized from the engine's limits
};

// "4096", "512M", "1.5G" (powers of 1024).
uint64_t parse_bytes(const std::string& text, const char* field) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    fail(field, ": '", text, "' is not a byte count (e.g. 1073741824, 512M, 2G)");
  }
  std::string unit = text.substr(used);
  if (!unit.empty() && (unit.back() == 'B' || unit.back() == 'b')) unit.pop_back();
  double scale = 1;
  if (unit == "K" || unit == "k")
    scale = 1024.0;
  else if (unit == "M" || unit == "m")
    scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "g")
    scale = 1024.0 * 1024 * 1024;
  else if (!unit.empty())
    fail(field, ": unknown unit in '", text, "' (use K, M or G)");
  if (!(v >= 0) || v * scale > 1.8e19) fail(field, ": '", text, "' is out of range");
  return uint64_t(v * scale);
}

VariantSpec parse_variant_arg(const std::string& arg) {
  const size_t eq = arg.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == arg.size())
    fail("--variant: '", arg, "' must be NAME=PATH (a .bitdelta file or a fine-tune directory)");
  return {arg.substr(0, eq), arg.substr(eq + 1), false};
}

// Reads a config file; command-line options given explicitly override it (applied after).
void read_config(const fs::path& file, ServeArgs& a, std::vector<VariantSpec>& variants) {
  std::ifstream in(file);
  if (!in) fail("--config: cannot read ", file.string());
  json c;
  try {
    c = json::parse(in);
  } catch (const json::exception& e) {
    fail(file.string(), ": not valid JSON (", e.what(), ")");
  }
  if (!c.is_object()) fail(file.string(), ": must be a JSON object");
  const fs::path dir = file.parent_path();
  const auto rel = [&](const std::string& p) {
    return fs::path(p).is_relative() ? dir / p : fs::path(p);
  };
  const auto get = [&](const char* key, auto& out) {
    if (!c.contains(key)) return;
    using T = std::remove_reference_t<decltype(out)>;
    // JSON's -1 or 2.5 would convert to a huge or truncated count without a word.
    if constexpr (std::is_integral_v<T> && std::is_unsigned_v<T> && !std::is_same_v<T, bool>)
      if (!c[key].is_number_unsigned())
        fail(file.string(), ": field ", key, " must be a non-negative integer");
    try {
      out = c[key].get<T>();
    } catch (const json::exception&) {
      fail(file.string(), ": field ", key, " has the wrong type");
    }
  };
  std::string base;
  get("base", base);
  if (!base.empty()) a.base = rel(base).string();
  get("host", a.server.host);
  get("port", a.server.port);
  if (a.server.port < 0 || a.server.port > 65535)
    fail(file.string(), ": field port must be 0 to 65535, got ", a.server.port);
  get("api_key", a.server.api_key);
  get("allowed_origins", a.server.allowed_origins);
  get("base_name", a.engine.base_name);
  get("threads", a.engine.threads);
  get("device", a.engine.device);
  get("cuda_graphs", a.engine.cuda_graphs);
  get("max_batch_tokens", a.engine.max_batch_tokens);
  get("max_running", a.engine.max_running);
  get("max_queue", a.engine.max_queue);
  get("protect_top", a.engine.protect_top);
  get("http_threads", a.server.http_threads);
  for (auto [key, out] : {std::pair{"delta_cache_bytes", &a.delta_cache_bytes},
                          std::pair{"prefix_cache_bytes", &a.prefix_cache_bytes}})
    if (c.contains(key)) {
      const auto& v = c[key];
      *out = v.is_string() ? v.get<std::string>() : v.dump();
    }
  std::string vdir, cdir;
  get("variants_dir", vdir);
  if (!vdir.empty()) a.variants_dir = rel(vdir).string();
  get("cache_dir", cdir);
  if (!cdir.empty()) a.cache_dir = rel(cdir).string();
  if (c.contains("variants")) {
    if (!c["variants"].is_array())
      fail(file.string(), ": variants must be a list of {name, path, pinned}");
    for (size_t i = 0; i < c["variants"].size(); ++i) {
      const auto& v = c["variants"][i];
      if (!v.is_object() || !v.contains("name") || !v["name"].is_string() || !v.contains("path") ||
          !v["path"].is_string())
        fail(file.string(), ": variants[", i, "] must have a string name and path");
      VariantSpec spec{v["name"].get<std::string>(), rel(v["path"].get<std::string>()), false};
      if (v.contains("pinned")) {
        if (!v["pinned"].is_boolean())
          fail(file.string(), ": variants[", i, "].pinned must be a boolean");
        spec.pinned = v["pinned"].get<bool>();
      }
      variants.push_back(std::move(spec));
    }
  }
}

fs::file_time_type newest_file(const fs::path& dir) {
  fs::file_time_type t{};
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) t = std::max(t, e.last_write_time());
  return t;
}

// A fine-tune directory becomes a delta file in the cache, compressed again only when a file of the
// fine-tune or the base is newer than the cached delta.
fs::path delta_for(const VariantSpec& v, const fs::path& base, const fs::path& cache_dir,
                   size_t threads) {
  if (!fs::is_directory(v.path)) {
    if (!fs::exists(v.path)) fail("variant ", v.name, ": ", v.path.string(), " does not exist");
    return v.path;
  }
  const fs::path out = cache_dir / (v.name + ".bitdelta");
  if (fs::exists(out) &&
      fs::last_write_time(out) >= std::max(newest_file(v.path), newest_file(base)))
    return out;
  fs::create_directories(cache_dir);
  std::fprintf(stderr, "compressing %s against %s -> %s\n", v.path.c_str(), base.c_str(),
               out.c_str());
  CompressOptions options;
  options.threads = threads;
  options.created_by = std::string("bitdelta ") + BITDELTA_VERSION;
  const auto report = compress(Checkpoint(base), Checkpoint(v.path), out, options);
  std::fprintf(stderr, "  %s in %.1fs\n", human_bytes(double(report.output_bytes)).c_str(),
               report.seconds);
  return out;
}

// Ctrl-C and SIGTERM: the handler only writes a byte to a pipe (async-signal-safe); a watcher
// thread reads it and asks the server to stop. (sigwait with the signals blocked is not enough:
// libraries such as OpenBLAS start threads before main, and the kernel may deliver the signal to
// one of those.)
int g_signal_pipe[2] = {-1, -1};  // the one global: a signal handler can reach nothing else

extern "C" void on_stop_signal(int sig) {
  const char c = char(sig);
  [[maybe_unused]] const auto n = ::write(g_signal_pipe[1], &c, 1);
}

class SignalWatcher {
 public:
  SignalWatcher() {
    if (::pipe(g_signal_pipe) != 0) fail("serve: cannot create the signal pipe");
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    ::signal(SIGPIPE, SIG_IGN);  // a client gone mid-write is an error return, not a death
  }
  ~SignalWatcher() {
    finish();
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    ::close(g_signal_pipe[0]);
    ::close(g_signal_pipe[1]);
  }
  void finish() {
    done_ = true;
    if (thread_.joinable()) thread_.join();
  }
  void start(Server& server) {
    thread_ = std::thread([this, &server] {
      while (!done_) {
        pollfd p{g_signal_pipe[0], POLLIN, 0};
        if (::poll(&p, 1, 200) <= 0) continue;
        char sig = 0;
        if (::read(g_signal_pipe[0], &sig, 1) != 1) continue;
        std::fprintf(stderr, "\n[serve] %s: shutting down\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
        server.stop();
        return;
      }
    });
  }

 private:
  std::atomic<bool> done_{false};
  std::thread thread_;
};

}  // namespace

void add_serve_command(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  auto* cmd = app.add_subcommand(
      "serve", "Serve the base and its variants through an OpenAI-compatible HTTP API");
  cmd->add_option("BASE", a->base,
                  "Base checkpoint directory (default: models/demo/base with the demo variants)");
  cmd->add_option("--variant", a->variant_args,
                  "NAME=PATH: a .bitdelta file or a fine-tune directory (repeatable)");
  cmd->add_option("--config", a->config,
                  R"(JSON file: {"base", "variants": [{"name", "path", "pinned"}], options...})");
  cmd->add_option("--host", a->server.host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", a->server.port, "Port (0: any free port)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", a->server.api_key, "Require Authorization: Bearer KEY on /v1/*");
  cmd->add_option("--allowed-origin", a->server.allowed_origins,
                  "Origin whose browser pages may call the API (CORS; * for any; repeatable; "
                  "default: none)");
  cmd->add_option("--base-name", a->engine.base_name, "Model name of the base")
      ->capture_default_str();
  cmd->add_option("--max-batch-tokens", a->engine.max_batch_tokens, "Rows per forward step")
      ->capture_default_str();
  cmd->add_option("--max-running", a->engine.max_running, "Sequences decoding at once")
      ->capture_default_str();
  cmd->add_option("--max-queue", a->engine.max_queue, "Waiting requests before 429")
      ->capture_default_str();
  cmd->add_option("--delta-cache-bytes", a->delta_cache_bytes,
                  "Resident delta budget, e.g. 512M (default: unlimited)");
  cmd->add_option("--pin", a->engine.pinned, "Variant never evicted (repeatable)");
  cmd->add_option("--protect-top", a->engine.protect_top,
                  "The N most requested variants are never evicted");
  cmd->add_option("--variants-dir", a->variants_dir,
                  "Directory /v1/variants/load may read from (default: loading off)");
  cmd->add_option("--cache-dir", a->cache_dir, "Where fine-tune directories are compressed to");
  cmd->add_option("--threads", a->engine.threads, "Compute threads (0: all cores)");
  cmd->add_option("--device", a->engine.device, "cpu, cuda or cuda:N (the delta cache is then GPU memory)");
  cmd->add_option("--host-cache-bytes", a->host_cache_bytes,
                  "cuda: pinned host memory kept for evicted deltas (e.g. 16G)");
  cmd->add_option("--prefix-cache-bytes", a->prefix_cache_bytes,
                  "Finished sequences' caches kept for prompts that begin like them (default 1G; "
                  "0: off; GPU memory with --device cuda)");
  add_cuda_graphs_option(cmd, a->engine.cuda_graphs);
  cmd->add_option("--http-threads", a->server.http_threads,
                  "Connections served at once (0: max-running + max-queue + 16, so a full queue is "
                  "seen as 429)");
  cmd->callback([a, cmd] {
    ServeArgs args;
    std::vector<VariantSpec> variants;
    if (!a->config.empty()) read_config(a->config, args, variants);
    // Explicit command-line options win over the config file.
    const auto given = [&](const char* name) { return cmd->count(name) > 0; };
    if (!a->base.empty()) args.base = a->base;
    if (given("--host") || args.server.host.empty()) args.server.host = a->server.host;
    if (given("--port")) args.server.port = a->server.port;
    if (given("--api-key")) args.server.api_key = a->server.api_key;
    if (given("--allowed-origin")) args.server.allowed_origins = a->server.allowed_origins;
    if (given("--base-name")) args.engine.base_name = a->engine.base_name;
    if (given("--max-batch-tokens")) args.engine.max_batch_tokens = a->engine.max_batch_tokens;
    if (given("--max-running")) args.engine.max_running = a->engine.max_running;
    if (given("--max-queue")) args.engine.max_queue = a->engine.max_queue;
    if (given("--delta-cache-bytes")) args.delta_cache_bytes = a->delta_cache_bytes;
    if (given("--protect-top")) args.engine.protect_top = a->engine.protect_top;
    if (given("--variants-dir")) args.variants_dir = a->variants_dir;
    if (given("--cache-dir")) args.cache_dir = a->cache_dir;
    if (given("--threads")) args.engine.threads = a->engine.threads;
    if (given("--device")) args.engine.device = a->engine.device;
    if (given("--host-cache-bytes")) args.host_cache_bytes = a->host_cache_bytes;
    if (given("--prefix-cache-bytes")) args.prefix_cache_bytes = a->prefix_cache_bytes;
    if (given("--cuda-graphs")) args.engine.cuda_graphs = a->engine.cuda_graphs;
    if (given("--http-threads")) args.server.http_threads = a->server.http_threads;
    for (const auto& p : a->engine.pinned) args.engine.pinned.push_back(p);
    for (const auto& v : a->variant_args) variants.push_back(parse_variant_arg(v));

    fs::path cache_dir = args.cache_dir;
    if (args.base.empty()) {
      // The demo family, relative to the current directory; its deltas go to build/, never models/.
      args.base = "models/demo/base";
      if (!fs::exists(args.base))
        fail("no BASE given and ", args.base, " does not exist (run from the repository root)");
      if (variants.empty())
        for (const char* name : {"coder", "math", "writer", "legal"})
          variants.push_back({name, fs::path("models/demo") / name, false});
      if (cache_dir.empty()) cache_dir = "build/demo";
    }
    if (cache_dir.empty()) cache_dir = fs::temp_directory_path() / "bitdelta-cache";
    if (!args.delta_cache_bytes.empty())
      args.engine.delta_cache_bytes = parse_bytes(args.delta_cache_bytes, "--delta-cache-bytes");
    if (!args.host_cache_bytes.empty())
      args.engine.host_cache_bytes = parse_bytes(args.host_cache_bytes, "--host-cache-bytes");
    if (!args.prefix_cache_bytes.empty())
      args.engine.prefix_cache_bytes = parse_bytes(args.prefix_cache_bytes, "--prefix-cache-bytes");
    for (const auto& v : variants)
      if (v.pinned) args.engine.pinned.push_back(v.name);
    args.server.variants_dir = args.variants_dir;
    // Every waiting request holds a connection thread; with fewer threads than the engine admits,
    // excess clients would queue unseen in the HTTP layer instead of getting 429.
    if (args.server.http_threads == 0)
      args.server.http_threads =
          std::min<size_t>(args.engine.max_running + args.engine.max_queue + 16, kMaxHttpThreads);

    std::vector<std::pair<std::string, fs::path>> deltas;
    for (const auto& v : variants)
      deltas.emplace_back(v.name, delta_for(v, args.base, cache_dir, args.engine.threads));
    for (const auto& p : args.engine.pinned) {
      bool found = p == args.engine.base_name;
      for (const auto& v : variants) found |= v.name == p;
      if (!found) fail("--pin: no variant named '", p, "'");
    }

    SignalWatcher signals;  // before the engine's threads exist
    Engine engine(args.base, args.engine);
    // Pinned variants load right away (they stay resident anyway); the others on first use.
    for (const auto& [name, path] : deltas) {
      const auto& pins = args.engine.pinned;
      engine.add_variant(name, path, std::find(pins.begin(), pins.end(), name) != pins.end());
    }
    Server server(engine, args.server);
    const int port = server.bind();
    std::string names;
    for (const auto& [name, path] : deltas) names += (names.empty() ? "" : ", ") + name;
    std::fprintf(stderr, "[serve] listening on http://%s:%d (base '%s' from %s; variants: %s)\n",
                 args.server.host.c_str(), port, args.engine.base_name.c_str(), args.base.c_str(),
                 names.empty() ? "none" : names.c_str());
    signals.start(server);
    server.run();
    signals.finish();  // before the server goes away
    std::fprintf(stderr, "[serve] stopped\n");
  });
}

}  // namespace bitdelta::cli
