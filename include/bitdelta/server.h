// The OpenAI-compatible HTTP server over an Engine: /v1/completions, /v1/chat/completions (with SSE
// streaming), /v1/models, /v1/variants/load|unload, /health and Prometheus /metrics.
#pragma once

#include <cstddef>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "bitdelta/engine.h"

namespace bitdelta {

// Each connection holds a thread: past this many, a typo (--http-threads 100000) exhausted the
// machine's threads before the server answered anything.
inline constexpr size_t kMaxHttpThreads = 4096;

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                     // 0: any free port (bind() returns it)
  std::string api_key;                 // when set, /v1/* require "Authorization: Bearer <key>"
  std::filesystem::path variants_dir;  // /v1/variants/load reads only below it; empty: refused
  size_t http_threads = 64;            // connections served at once (each waits on its request);
                                       // at most kMaxHttpThreads
  size_t max_body_bytes = 16u << 20;   // larger request bodies are refused (413)
  // Origins whose pages may read the answers (CORS: Access-Control-Allow-Origin); "*" any. Empty:
  // none (a browser page of another origin cannot call the server).
  std::vector<std::string> allowed_origins;
};

class Server {
 public:
  // The engine must outlive the server.
  Server(Engine& engine, ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the listening socket; throws Error naming host and port if that fails. Returns the port.
  int bind();
  // Serves until stop() (binds first if bind() was not called). Blocks.
  void run();
  // Thread-safe: streams in flight end, waiting requests are cancelled, run() returns.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bitdelta
