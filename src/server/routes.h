// The API's handlers, independent of how the HTTP layer registers them.
#pragma once

#include <httplib.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "bitdelta/chat_template.h"
#include "bitdelta/engine.h"
#include "bitdelta/server.h"
#include "server/metrics.h"
#include "server/protocol.h"

namespace bitdelta::server {

// What every handler shares; owned by Server::Impl.
struct Context {
  Engine& engine;
  ServerOptions options;
  ChatTemplate chat_template;
  std::filesystem::path variants_root;  // canonical variants_dir ("" when loading is off)
  HttpCounters http;
  std::atomic<bool> stopping{false};
  std::atomic<uint64_t> next_id{1};
  std::string id_prefix;      // random per process, so ids differ across restarts
  int64_t started = 0;        // unix time, reported as models' "created"
  std::mutex variants_mutex;  // load/unload one at a time

  Context(Engine& e, ServerOptions o) : engine(e), options(std::move(o)) {}
  std::string new_id(const char* kind);
};

// Writes the OpenAI error object; counts the response.
void send_error(Context& ctx, httplib::Response& res, const std::string& route, int status,
                const std::string& message, const std::string& code = "");
void send_json(Context& ctx, httplib::Response& res, const std::string& route, int status,
               const json& body);

void handle_generation(Context& ctx, const httplib::Request& req, httplib::Response& res,
                       Endpoint endpoint);
void handle_models(Context& ctx, const httplib::Request& req, httplib::Response& res);
void handle_model(Context& ctx, const httplib::Request& req,
                  httplib::Response& res);  // /v1/models/{id}
void handle_load(Context& ctx, const httplib::Request& req, httplib::Response& res);
void handle_unload(Context& ctx, const httplib::Request& req, httplib::Response& res);
void handle_health(Context& ctx, const httplib::Request& req, httplib::Response& res);
// POST /tokenize and /detokenize (as vLLM and llama.cpp's servers have them).
void handle_tokenize(Context& ctx, const httplib::Request& req, httplib::Response& res);
void handle_detokenize(Context& ctx, const httplib::Request& req, httplib::Response& res);
void handle_metrics(Context& ctx, const httplib::Request& req, httplib::Response& res);

// The client's X-Request-Id (1 to 128 visible ASCII characters), echoed on the response and put in
// the request's log line so that a gateway's logs and ours can be joined; empty when absent or not
// of that form (then ignored, not refused).
std::string request_id(const httplib::Request& req);

// Every JSON we send goes through this: bytes that are not UTF-8 become U+FFFD instead of throwing.
std::string dump(const json& j);

}  // namespace bitdelta::server
