// The HTTP layer: httplib setup, API-key check, routing to the handlers, and errors in OpenAI shape
// for everything the handlers do not answer (unknown routes, oversized bodies, exceptions).
#include <httplib.h>

#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <regex>
#include <string_view>
#include <vector>

#include "bitdelta/error.h"
#include "bitdelta/server.h"
#include "server/routes.h"

namespace bitdelta {

using server::Context;

namespace {

// httplib listens with a backlog of 5: a burst of clients connecting at once overflows it and some
// see their connection reset. Listening again on the bound socket raises the backlog (Linux allows
// it); the socket is only reachable from a subclass.
class HttpServer : public httplib::Server {
 public:
  void raise_backlog() {
    const auto sock = svr_sock_.load();
    if (sock != INVALID_SOCKET) ::listen(sock, SOMAXCONN);
  }
};

}  // namespace

struct Server::Impl {
  Context ctx;
  HttpServer http;
  bool bound = false;

  Impl(Engine& engine, ServerOptions options) : ctx(engine, std::move(options)) {}
};

namespace {

bool authorized(const Context& ctx, const httplib::Request& req) {
  if (ctx.options.api_key.empty()) return true;
  const std::string expected = "Bearer " + ctx.options.api_key;
  const std::string got = req.get_header_value("Authorization");
  // Compare every byte so the time taken does not reveal how much of the key matched.
  if (got.size() != expected.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < got.size(); ++i) diff |= static_cast<unsigned char>(got[i] ^ expected[i]);
  return diff == 0;
}

}  // namespace

Server::Server(Engine& engine, ServerOptions options)
    : impl_(std::make_unique<Impl>(engine, std::move(options))) {
  Context& ctx = impl_->ctx;
  httplib::Server& http = impl_->http;
  ctx.started = int64_t(std::time(nullptr));
  {
    std::random_device rd;
    char buf[16];
    std::snprintf(buf, sizeof buf, "%08x", rd());
    ctx.id_prefix = buf;
  }
  bool known = true;
  ctx.chat_template = ChatTemplate::from_checkpoint(engine.base_dir(), &known);
  if (!known)
    std::fprintf(
        stderr,
        "[serve] the chat template in %s is not a family we know; chat uses the plain format\n",
        (engine.base_dir() / "tokenizer_config.json").c_str());
  else if (const std::string d = ctx.chat_template.details(); !d.empty())
    std::fprintf(stderr, "[serve] chat template: %s, %s\n", to_string(ctx.chat_template.family()),
                 d.c_str());
  if (!ctx.options.variants_dir.empty()) {
    std::error_code ec;
    ctx.variants_root = std::filesystem::canonical(ctx.options.variants_dir, ec);
    if (ec || !std::filesystem::is_directory(ctx.variants_root))
      fail("--variants-dir: ", ctx.options.variants_dir.string(), " is not a directory");
  }

  // Each connection holds a thread while its request runs, so the pool bounds concurrent requests.
  if (ctx.options.http_threads > kMaxHttpThreads)
    fail("http_threads is ", ctx.options.http_threads, "; at most ", kMaxHttpThreads,
         " (each connection holds a thread)");
  const size_t threads = std::max<size_t>(ctx.options.http_threads, 2);
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  // httplib's default also sets SO_REUSEPORT, which lets a second server bind the same port
  // silently and share its connections; we want "address in use" instead.
  http.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  http.set_payload_max_length(ctx.options.max_body_bytes);
  http.set_read_timeout(30);
  http.set_write_timeout(30);

  // The routes, one table: registered with httplib below, and read again by the error handler to
  // tell a known path asked with another method (405) from an unknown one (404).
  using Handler = void (*)(Context&, const httplib::Request&, httplib::Response&);
  struct Route {
    const char* method;
    const char* pattern;  // a regular expression over the whole path
    Handler handler;
  };
  static const Route kRoutes[] = {
      {"POST", "/v1/completions",
       [](Context& c, const httplib::Request& q, httplib::Response& r) {
         server::handle_generation(c, q, r, server::Endpoint::kCompletions);
       }},
      {"POST", "/v1/chat/completions",
       [](Context& c, const httplib::Request& q, httplib::Response& r) {
         server::handle_generation(c, q, r, server::Endpoint::kChat);
       }},
      {"GET", "/v1/models", server::handle_models},
      {"GET", "/v1/models/(.+)", server::handle_model},
      {"POST", "/v1/variants/load", server::handle_load},
      {"POST", "/v1/variants/unload", server::handle_unload},
      {"POST", "/tokenize", server::handle_tokenize},
      {"POST", "/detokenize", server::handle_detokenize},
      {"GET", "/health", server::handle_health},
      {"GET", "/metrics", server::handle_metrics},
  };
  // The methods a path is served with ("GET, POST"), empty when none. The patterns are compiled
  // once, not per 404 or OPTIONS request.
  static const std::vector<std::regex> kPatterns = [] {
    std::vector<std::regex> p;
    for (const Route& route : kRoutes) p.emplace_back(route.pattern);
    return p;
  }();
  const auto allowed = [](const std::string& path) {
    std::string methods;
    for (size_t i = 0; i < std::size(kRoutes); ++i)
      if (std::regex_match(path, kPatterns[i]) &&
          methods.find(kRoutes[i].method) == std::string::npos)
        methods += (methods.empty() ? "" : ", ") + std::string(kRoutes[i].method);
    return methods;
  };

  // Browsers (a chat page of another origin): each response says an allowed Origin may read it,
  // and OPTIONS is answered here for every known path, before the key check (a browser's preflight
  // carries no credentials), with the methods the path takes.
  http.set_pre_routing_handler([&ctx, allowed](const httplib::Request& req,
                                               httplib::Response& res) {
    if (const std::string id = server::request_id(req); !id.empty())
      res.set_header("X-Request-Id", id);
    const std::string origin = req.get_header_value("Origin");
    const auto& origins = ctx.options.allowed_origins;
    const bool any = std::find(origins.begin(), origins.end(), "*") != origins.end();
    const bool cors = !origin.empty() &&
                      (any || std::find(origins.begin(), origins.end(), origin) != origins.end());
    if (cors) {
      res.set_header("Access-Control-Allow-Origin", any ? "*" : origin);
      if (!any) res.set_header("Vary", "Origin");
    }
    if (req.method == "OPTIONS") {
      const std::string methods = allowed(req.path);
      if (methods.empty()) return httplib::Server::HandlerResponse::Unhandled;  // 404
      res.status = 204;
      res.set_header("Allow", methods + ", OPTIONS");
      if (cors) {
        res.set_header("Access-Control-Allow-Methods", methods);
        const std::string asked = req.get_header_value("Access-Control-Request-Headers");
        res.set_header("Access-Control-Allow-Headers",
                       asked.empty() ? "Authorization, Content-Type" : asked);
        res.set_header("Access-Control-Max-Age", "600");
      }
      ctx.http.count("other", 204);
      return httplib::Server::HandlerResponse::Handled;
    }
    const bool guarded =
        req.path.rfind("/v1/", 0) == 0 || req.path == "/tokenize" || req.path == "/detokenize";
    if (guarded && !authorized(ctx, req)) {
      server::send_error(ctx, res, "auth", 401,
                         "invalid or missing API key (send Authorization: Bearer <key>)",
                         "invalid_api_key");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });

  // Every handler catches what it expects; anything else becomes a 500 here, never a crash.
  const auto guard = [&ctx](auto handler) {
    return [&ctx, handler](const httplib::Request& req, httplib::Response& res) {
      try {
        handler(req, res);
      } catch (const std::exception& e) {
        server::send_error(ctx, res, req.path, 500, str("internal error: ", e.what()));
        std::fprintf(stderr, "[serve] %s status=500 internal error: %s\n", req.path.c_str(),
                     e.what());
      } catch (...) {
        server::send_error(ctx, res, req.path, 500, "internal error");
        std::fprintf(stderr, "[serve] %s status=500 internal error\n", req.path.c_str());
      }
    };
  };
  for (const Route& route : kRoutes) {
    const auto h = [&ctx, f = route.handler](const httplib::Request& req, httplib::Response& res) {
      f(ctx, req, res);
    };
    if (std::string_view(route.method) == "GET")
      http.Get(route.pattern, guard(h));
    else
      http.Post(route.pattern, guard(h));
  }
  // Responses httplib makes itself (unknown route 404, too large 413, bad request line 400) get a
  // body in the API's error shape.
  http.set_error_handler(httplib::Server::HandlerWithResponse(
      [&ctx, allowed](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty() || res.content_length_ > 0)
          return httplib::Server::HandlerResponse::Unhandled;
        std::string message = str("HTTP ", res.status);
        if (res.status == 404) {
          message = str("no route ", req.method, " ", req.path);
          if (const std::string methods = allowed(req.path); !methods.empty()) {
            res.status = 405;
            res.set_header("Allow", methods + ", OPTIONS");
            message = str(req.path, " takes ", methods, ", not ", req.method);
          }
        }
        if (res.status == 413)
          message = str("request body is larger than ", ctx.options.max_body_bytes, " bytes");
        res.set_content(server::dump(server::error_body(res.status, message,
                                                        server::error_type_for(res.status), "")),
                        "application/json");
        ctx.http.count("other", res.status);
        return httplib::Server::HandlerResponse::Handled;
      }));
  http.set_exception_handler(
      [&ctx](const httplib::Request& req, httplib::Response& res, std::exception_ptr) {
        server::send_error(ctx, res, req.path, 500, "internal error");
      });
}

Server::~Server() {
  stop();
}

int Server::bind() {
  auto& o = impl_->ctx.options;
  int port = o.port;
  if (o.port == 0) {
    port = impl_->http.bind_to_any_port(o.host);
    if (port < 0) fail("cannot listen on ", o.host, " (any port)");
  } else if (!impl_->http.bind_to_port(o.host, o.port)) {
    fail("cannot listen on ", o.host, ":", o.port, " (in use, or not an address of this machine)");
  }
  impl_->http.raise_backlog();
  impl_->bound = true;
  return port;
}

void Server::run() {
  if (!impl_->bound) bind();
  impl_->http.listen_after_bind();
}

void Server::stop() {
  impl_->ctx.stopping = true;
  impl_->http.stop();
}

}  // namespace bitdelta
