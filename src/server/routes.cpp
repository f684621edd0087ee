#include "server/routes.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <deque>
#include <optional>
#include <thread>

#include "bitdelta/error.h"
#include "server/client_watch.h"

namespace bitdelta::server {

namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

// How often a waiting handler looks at the stop flag and the client's socket.
constexpr auto kPoll = 100ms;

const char* kCompletionsRoute = "/v1/completions";
const char* kChatRoute = "/v1/chat/completions";

// What the engine reports about one sequence of a request, handed from its thread to the HTTP
// thread.
struct Event {
  enum class Kind { kPromptLogprobs, kToken, kDone, kError } kind;
  size_t seq = 0;  // which of the request's sequences (ParsedRequest::sequence)
  TokenLogprob token{};
  std::string text;
  std::vector<float> prompt_logprobs;
  FinishReason reason = FinishReason::kNone;
  Usage usage;
  int status = 0;
};

class Mailbox {
 public:
  void push(Event e) {
    {
      std::lock_guard lock(mutex_);
      events_.push_back(std::move(e));
    }
    cv_.notify_one();
  }
  // Everything that arrived, waiting up to `timeout` for the first.
  std::deque<Event> take(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, timeout, [&] { return !events_.empty(); });
    return std::exchange(events_, {});
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Event> events_;
};

// One generation request in flight: the parsed request (the builder refers to it), its engine
// sequences (n or best_of per prompt) and the events not yet turned into output.
struct Exchange {
  ParsedRequest request;
  std::optional<ResponseBuilder> builder;
  std::shared_ptr<Mailbox> mailbox = std::make_shared<Mailbox>();
  std::vector<std::shared_ptr<RequestHandle>> handles;  // one per sequence
  std::deque<Event> pending;
  std::string route;
  std::string request_id;  // the client's X-Request-Id, or empty
  bool finished = false;
  std::vector<char> started;          // streaming: the sequence's first chunk went out
  std::vector<FinishReason> reasons;  // per sequence, once done
  size_t done = 0;                    // sequences finished
  Usage usage;                        // summed: prompt tokens once per prompt
  std::chrono::steady_clock::time_point arrived = std::chrono::steady_clock::now();

  // Stops every sequence still in the engine (they share one answer: one failure ends them all).
  void stop() {
    for (auto& h : handles) h->cancel();
    finished = true;
  }
  // Records a finished sequence; true when it was the last.
  bool sequence_done(const Event& e) {
    reasons[e.seq] = e.reason;
    if (e.seq % request.best_of == 0) usage.prompt_tokens += e.usage.prompt_tokens;
    usage.completion_tokens += e.usage.completion_tokens;
    usage.ttft_s = done ? std::min(usage.ttft_s, e.usage.ttft_s) : e.usage.ttft_s;
    usage.total_s = std::max(usage.total_s, e.usage.total_s);
    if (++done < handles.size()) return false;
    finished = true;
    return true;
  }
  size_t prompt_tokens() const {
    size_t total = 0;
    for (const auto& p : request.prompts) total += p.ids.size();
    return total;
  }

  ~Exchange() {
    // A stream dropped by the server (shutdown, client gone) must not leave work in the engine.
    if (!finished) stop();
  }
};

GenerationCallbacks callbacks_for(const std::shared_ptr<Mailbox>& box, size_t seq) {
  GenerationCallbacks cb;
  cb.on_prompt_logprobs = [box, seq](const std::vector<float>& lp) {
    Event e{Event::Kind::kPromptLogprobs, seq};
    e.prompt_logprobs = lp;
    box->push(std::move(e));
  };
  cb.on_token = [box, seq](const TokenLogprob& t, const std::string& text) {
    Event e{Event::Kind::kToken, seq};
    e.token = t;
    e.text = text;
    box->push(std::move(e));
  };
  cb.on_done = [box, seq](FinishReason reason, const Usage& usage) {
    Event e{Event::Kind::kDone, seq};
    e.reason = reason;
    e.usage = usage;
    box->push(std::move(e));
  };
  cb.on_error = [box, seq](const std::string& message, int status) {
    Event e{Event::Kind::kError, seq};
    e.text = message;
    e.status = status;
    box->push(std::move(e));
  };
  return cb;
}

int status_for(EngineError::Kind kind) {
  switch (kind) {
    case EngineError::Kind::UnknownModel:
      return 404;
    case EngineError::Kind::QueueFull:
      return 429;
    case EngineError::Kind::BadRequest:
      return 400;
    case EngineError::Kind::Unavailable:
      return 503;
  }
  return 500;
}

const char* code_for(EngineError::Kind kind) {
  switch (kind) {
    case EngineError::Kind::UnknownModel:
      return "model_not_found";
    case EngineError::Kind::QueueFull:
      return "queue_full";
    case EngineError::Kind::BadRequest:
      return "invalid_request";
    case EngineError::Kind::Unavailable:
      return "unavailable";
  }
  return "";
}

void log_request(const Exchange& x, int status, const Usage* usage, const std::string& note_in) {
  const std::string note =
      x.request_id.empty() ? note_in
                           : note_in + (note_in.empty() ? "" : " ") + "request_id=" + x.request_id;
  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - x.arrived).count();
  const std::string seqs =
      x.request.sequences() > 1 ? str(" sequences=", x.request.sequences()) : std::string();
  if (usage)
    std::fprintf(stderr,
                 "[serve] %s model=%s status=%d prompt_tokens=%zu completion_tokens=%zu%s "
                 "ttft=%.3fs total=%.3fs%s%s\n",
                 x.route.c_str(), x.request.engine.model.c_str(), status, usage->prompt_tokens,
                 usage->completion_tokens, seqs.c_str(), usage->ttft_s, total,
                 note.empty() ? "" : " ", note.c_str());
  else
    std::fprintf(stderr, "[serve] %s model=%s status=%d prompt_tokens=%zu%s total=%.3fs %s\n",
                 x.route.c_str(), x.request.engine.model.c_str(), status, x.prompt_tokens(),
                 seqs.c_str(), total, note.c_str());
}

std::string sse(const json& j) {
  return "data: " + dump(j) + "\n\n";
}

// Writes what has arrived for a streaming request. Returns false when the client is gone (the
// engine sequences are cancelled); calls sink.done() at the end of the stream. A choice's first
// chunk goes out with its sequence's first event (its prompt logprobs come first, when asked for).
bool stream_some(Exchange& x, Context& ctx, httplib::DataSink& sink) {
  const auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
  const auto gone = [&] {
    x.stop();
    log_request(x, 200, nullptr, "cancelled: client disconnected");
    return false;
  };
  if (x.pending.empty()) x.pending = x.mailbox->take(kPoll);
  for (auto& e : x.pending) {
    if (e.kind != Event::Kind::kError && !x.started[e.seq]) {
      x.started[e.seq] = 1;
      if (e.kind == Event::Kind::kPromptLogprobs)
        x.builder->set_prompt_logprobs(e.seq, e.prompt_logprobs);
      if (auto first = x.builder->first_chunk(e.seq); first && !write(sse(*first))) return gone();
    }
    switch (e.kind) {
      case Event::Kind::kPromptLogprobs:
        break;
      case Event::Kind::kToken:
        if (json chunk = x.builder->add_token(e.seq, e.token, e.text);
            !chunk.is_null() && !write(sse(chunk)))
          return gone();
        break;
      case Event::Kind::kDone: {
        const bool last = x.sequence_done(e);
        std::string tail = sse(x.builder->final_chunk(e.seq, e.reason));
        if (last) {
          if (x.request.include_usage) tail += sse(x.builder->usage_chunk(x.usage));
          tail += "data: [DONE]\n\n";
        }
        if (!write(tail)) return gone();
        if (last) {
          sink.done();
          log_request(x, 200, &x.usage, "stream");
          return true;
        }
        break;
      }
      case Event::Kind::kError: {
        x.stop();
        const int status = e.status ? e.status : 500;
        write(sse(error_body(status, e.text, error_type_for(status), "generation_failed")) +
              "data: [DONE]\n\n");
        sink.done();
        log_request(x, status, nullptr, e.text);
        return true;
      }
    }
  }
  x.pending.clear();
  if (ctx.stopping) {
    write(sse(error_body(503, "the server is shutting down", error_type_for(503), "")) +
          "data: [DONE]\n\n");
    sink.done();
    log_request(x, 503, nullptr, "cancelled: shutting down");
    return true;  // ~Exchange cancels the engine sequences
  }
  if (!sink.is_writable()) return gone();
  return true;
}

std::string validate_variant_name(const json& body) {
  if (!body.contains("name") || !body["name"].is_string())
    throw ApiError(400, "name must be a string");
  const std::string name = body["name"].get<std::string>();
  if (name.empty() || name.size() > 128) throw ApiError(400, "name must be 1 to 128 characters");
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
          c == ':'))
      throw ApiError(400, "name may contain only letters, digits and - _ . :");
  return name;
}

json model_object(const Context& ctx, const VariantStatus& v) {
  const bool base = v.name == ctx.engine.options().base_name;
  json m = {{"id", v.name},
            {"object", "model"},
            {"created", ctx.started},
            {"owned_by", "bitdelta"},
            {"root", v.name},
            {"parent", base ? json(nullptr) : json(ctx.engine.options().base_name)},
            {"state", v.state},
            {"pinned", v.pinned}};
  if (!v.last_error.empty()) m["last_error"] = v.last_error;
  if (v.bytes) m["bytes"] = v.bytes;
  m["max_model_len"] = ctx.engine.config().max_position;
  return m;
}

}  // namespace

std::string request_id(const httplib::Request& req) {
  std::string id = req.get_header_value("X-Request-Id");
  if (id.empty() || id.size() > 128) return {};
  for (char c : id)
    if (c < 0x21 || c > 0x7e) return {};
  return id;
}

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string Context::new_id(const char* kind) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%06llx", static_cast<unsigned long long>(next_id++));
  return std::string(kind) + "-" + id_prefix + buf;
}

void send_json(Context& ctx, httplib::Response& res, const std::string& route, int status,
               const json& body) {
  res.status = status;
  res.set_content(dump(body), "application/json");
  ctx.http.count(route, status);
}

void send_error(Context& ctx, httplib::Response& res, const std::string& route, int status,
                const std::string& message, const std::string& code) {
  std::string line = message;  // one line, whatever the message carried
  for (auto& c : line)
    if (c == '\n' || c == '\r') c = ' ';
  send_json(ctx, res, route, status, error_body(status, line, error_type_for(status), code));
}

namespace {

ModelInfo model_info(Context& ctx) {
  return {&ctx.engine.tokenizer(), ctx.engine.options().base_name,
          size_t(ctx.engine.config().max_position), &ctx.chat_template,
          ctx.engine.options().max_queue};
}

// A request's "model", where given, must name a served model (they share the base's tokenizer).
void check_model(Context& ctx, const json& body) {
  if (!body.contains("model") || body["model"].is_null()) return;
  if (!body["model"].is_string()) throw ApiError(400, "model must be a string");
  const std::string name = body["model"].get<std::string>();
  for (const auto& v : ctx.engine.variants())
    if (v.name == name) return;
  throw ApiError(404, str("model '", name, "' does not exist"), "", "model_not_found");
}

}  // namespace

void handle_generation(Context& ctx, const httplib::Request& req, httplib::Response& res,
                       Endpoint endpoint) {
  auto x = std::make_shared<Exchange>();
  x->route = endpoint == Endpoint::kChat ? kChatRoute : kCompletionsRoute;
  x->request_id = request_id(req);
  const Tokenizer& tok = ctx.engine.tokenizer();
  try {
    x->request = parse_generation(parse_body(req.body), endpoint, model_info(ctx));
    x->builder.emplace(x->request, tok,
                       ctx.new_id(endpoint == Endpoint::kChat ? "chatcmpl" : "cmpl"),
                       int64_t(std::time(nullptr)));
    const size_t n = x->request.sequences();
    x->started.assign(n, 0);
    x->reasons.assign(n, FinishReason::kNone);
    // All or nothing, and together: sequences of one prompt prefill it once.
    std::vector<GenerationRequest> sequences;
    std::vector<GenerationCallbacks> callbacks;
    for (size_t s = 0; s < n; ++s) {
      sequences.push_back(x->request.sequence(s));
      callbacks.push_back(callbacks_for(x->mailbox, s));
    }
    x->handles = ctx.engine.submit_all(std::move(sequences), std::move(callbacks));
  } catch (const ApiError& e) {
    x->stop();
    send_error(ctx, res, x->route, e.status, e.what(), e.code);
    log_request(*x, e.status, nullptr, e.what());
    return;
  } catch (const EngineError& e) {
    x->stop();
    send_error(ctx, res, x->route, status_for(e.kind), e.what(), code_for(e.kind));
    log_request(*x, status_for(e.kind), nullptr, e.what());
    return;
  } catch (const Error& e) {
    x->stop();
    send_error(ctx, res, x->route, 400, e.what());
    log_request(*x, 400, nullptr, e.what());
    return;
  }

  // Until the answer starts, the handler waits here; a client that hangs up meanwhile (a timeout)
  // stops its sequences instead of leaving the engine to generate for nobody. 499: nginx's "client
  // closed request", for the log and /metrics (nothing reaches the client).
  ClientWatch watch(req);
  const auto hung_up = [&] {
    if (!watch.gone()) return false;
    x->stop();
    send_error(ctx, res, x->route, 499, "the client closed the connection before its answer");
    log_request(*x, 499, nullptr, "cancelled: client disconnected");
    return true;
  };

  if (!x->request.stream) {
    while (true) {
      for (auto& e : x->pending) {
        switch (e.kind) {
          case Event::Kind::kPromptLogprobs:
            x->builder->set_prompt_logprobs(e.seq, e.prompt_logprobs);
            break;
          case Event::Kind::kToken:
            x->builder->add_token(e.seq, e.token, e.text);
            break;
          case Event::Kind::kDone:
            if (x->sequence_done(e)) {
              send_json(ctx, res, x->route, 200, x->builder->finish(x->reasons, x->usage));
              log_request(*x, 200, &x->usage, "");
              return;
            }
            break;
          case Event::Kind::kError:
            x->stop();
            send_error(ctx, res, x->route, e.status ? e.status : 500, e.text, "generation_failed");
            log_request(*x, e.status ? e.status : 500, nullptr, e.text);
            return;
        }
      }
      x->pending.clear();
      if (ctx.stopping) {
        send_error(ctx, res, x->route, 503, "the server is shutting down");
        log_request(*x, 503, nullptr, "cancelled: shutting down");
        return;
      }
      x->pending = x->mailbox->take(kPoll);
      if (hung_up()) return;
    }
  }

  // Streaming: wait for the first token (or end, or error) of any sequence before answering, so
  // that a request failing before it produces anything (its variant's delta failed to load) gets a
  // proper HTTP status. Echoed prompt logprobs arriving before it are kept.
  const auto has_answer = [&] {
    return std::any_of(x->pending.begin(), x->pending.end(),
                       [](const Event& e) { return e.kind != Event::Kind::kPromptLogprobs; });
  };
  while (!has_answer()) {
    if (ctx.stopping) {
      send_error(ctx, res, x->route, 503, "the server is shutting down");
      log_request(*x, 503, nullptr, "cancelled: shutting down");
      return;  // ~Exchange cancels
    }
    for (auto& e : x->mailbox->take(kPoll)) x->pending.push_back(std::move(e));
    if (!has_answer() && hung_up()) return;
  }
  for (const auto& e : x->pending)
    if (e.kind == Event::Kind::kError) {
      x->stop();
      send_error(ctx, res, x->route, e.status ? e.status : 500, e.text, "generation_failed");
      log_request(*x, e.status ? e.status : 500, nullptr, e.text);
      return;
    }

  // Streaming: httplib calls the provider until it calls sink.done() or returns false; each call
  // writes what has arrived. A failed write means the client is gone: cancel the engine request.
  ctx.http.count(x->route, 200);
  Context* c = &ctx;
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [x, c](size_t, httplib::DataSink& sink) {
        // An exception must not escape into httplib's worker thread: end the stream with an error.
        try {
          return stream_some(*x, *c, sink);
        } catch (const std::exception& e) {
          const std::string m = str("internal error: ", e.what());
          std::fprintf(stderr, "[serve] %s status=500 %s\n", x->route.c_str(), m.c_str());
          x->stop();
          const std::string tail =
              sse(error_body(500, m, error_type_for(500), "")) + "data: [DONE]\n\n";
          sink.write(tail.data(), tail.size());
          sink.done();
          return true;
        }
      },
      [x](bool success) {
        // Called when the response ends; on failure (client gone) stop the engine's work now.
        if (!success && !x->finished) {
          x->stop();
          log_request(*x, 200, nullptr, "cancelled: client disconnected");
        }
      });
}

void handle_models(Context& ctx, const httplib::Request&, httplib::Response& res) {
  json data = json::array();
  for (const auto& v : ctx.engine.variants()) data.push_back(model_object(ctx, v));
  send_json(ctx, res, "/v1/models", 200, {{"object", "list"}, {"data", data}});
}

void handle_model(Context& ctx, const httplib::Request& req, httplib::Response& res) {
  const std::string id = req.matches.size() > 1 ? std::string(req.matches[1]) : "";
  for (const auto& v : ctx.engine.variants())
    if (v.name == id) return send_json(ctx, res, "/v1/models/{id}", 200, model_object(ctx, v));
  send_error(ctx, res, "/v1/models/{id}", 404, str("model '", id, "' does not exist"),
             "model_not_found");
}

void handle_load(Context& ctx, const httplib::Request& req, httplib::Response& res) {
  const std::string route = "/v1/variants/load";
  try {
    if (ctx.variants_root.empty())
      throw ApiError(403, "loading variants is disabled (start the server with --variants-dir)",
                     "permission_error");
    const json body = parse_body(req.body);
    const std::string name = validate_variant_name(body);
    if (!body.contains("path") || !body["path"].is_string() ||
        body["path"].get<std::string>().empty())
      throw ApiError(400, "path must be a non-empty string");
    fs::path path = body["path"].get<std::string>();
    if (path.is_relative()) path = ctx.variants_root / path;
    // canonical() resolves .. and every symlink, so what is checked is the file that will be read.
    std::error_code ec;
    const fs::path real = fs::canonical(path, ec);
    if (ec) throw ApiError(400, str("path: ", body["path"].get<std::string>(), " does not exist"));
    const auto rel = real.lexically_relative(ctx.variants_root);
    if (rel.empty() || *rel.begin() == ".." || rel.is_absolute())
      throw ApiError(403, str("path: ", body["path"].get<std::string>(),
                              " is outside the variants directory"));
    if (!fs::is_regular_file(real))
      throw ApiError(400, str("path: ", body["path"].get<std::string>(), " is not a file"));
    std::lock_guard lock(ctx.variants_mutex);
    for (const auto& v : ctx.engine.variants())
      if (v.name == name)
        throw ApiError(409, str("name: a model named '", name, "' already exists"));
    // Loaded now, in the background; with "wait" (the default) the answer says whether it worked,
    // and a delta that cannot be loaded is not kept.
    bool wait = true;
    if (body.contains("wait") && !body["wait"].is_null()) {
      if (!body["wait"].is_boolean()) throw ApiError(400, "wait must be a boolean");
      wait = body["wait"].get<bool>();
    }
    ctx.engine.add_variant(name, real, true);
    const auto status_of = [&]() -> std::optional<VariantStatus> {
      for (auto& v : ctx.engine.variants())
        if (v.name == name) return v;
      return std::nullopt;
    };
    auto v = status_of();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (wait && v && (v->state == "cold" || v->state == "loading") &&
           std::chrono::steady_clock::now() < deadline && !ctx.stopping) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      v = status_of();
    }
    if (!v) throw ApiError(409, str("name: '", name, "' was unloaded while loading"));
    if (v->state == "failed") {
      try {
        ctx.engine.remove_variant(name);
      } catch (const Error&) {
        // A request for it arrived meanwhile; it stays registered and will retry.
      }
      throw ApiError(400, str("path: the delta failed to load: ", v->last_error), "",
                     "load_failed");
    }
    send_json(ctx, res, route, 200, model_object(ctx, *v));
    std::fprintf(stderr, "[serve] added variant %s from %s (%s)\n", name.c_str(), real.c_str(),
                 v->state.c_str());
    return;
  } catch (const ApiError& e) {
    send_error(ctx, res, route, e.status, e.what(), e.code);
  } catch (const Error& e) {
    send_error(ctx, res, route, 400, e.what());
  }
}

void handle_unload(Context& ctx, const httplib::Request& req, httplib::Response& res) {
  const std::string route = "/v1/variants/unload";
  try {
    const json body = parse_body(req.body);
    const std::string name = validate_variant_name(body);
    if (name == ctx.engine.options().base_name)
      throw ApiError(400, "name: the base model cannot be unloaded");
    std::lock_guard lock(ctx.variants_mutex);
    bool found = false;
    for (const auto& v : ctx.engine.variants()) found |= v.name == name;
    if (!found)
      throw ApiError(404, str("name: no model named '", name, "'"), "", "model_not_found");
    try {
      ctx.engine.remove_variant(name);
    } catch (const Error& e) {
      throw ApiError(409, e.what());  // requests for it are running or waiting
    }
    send_json(ctx, res, route, 200, {{"id", name}, {"object", "model"}, {"deleted", true}});
    std::fprintf(stderr, "[serve] unloaded variant %s\n", name.c_str());
  } catch (const ApiError& e) {
    send_error(ctx, res, route, e.status, e.what(), e.code);
  }
}

void handle_tokenize(Context& ctx, const httplib::Request& req, httplib::Response& res) {
  const std::string route = "/tokenize";
  try {
    const json body = parse_body(req.body);
    check_model(ctx, body);
    const auto t = parse_tokenize(body, model_info(ctx));
    json out = {{"tokens", t.ids},
                {"count", t.ids.size()},
                {"max_model_len", ctx.engine.config().max_position}};
    if (t.token_strs) {
      json strs = json::array();
      for (const int32_t id : t.ids) strs.push_back(ctx.engine.tokenizer().token_text(id));
      out["token_strs"] = std::move(strs);
    }
    send_json(ctx, res, route, 200, out);
  } catch (const ApiError& e) {
    send_error(ctx, res, route, e.status, e.what(), e.code);
  } catch (const Error& e) {
    send_error(ctx, res, route, 400, e.what());
  }
}

void handle_detokenize(Context& ctx, const httplib::Request& req, httplib::Response& res) {
  const std::string route = "/detokenize";
  try {
    const json body = parse_body(req.body);
    check_model(ctx, body);
    const auto ids = parse_detokenize(body, model_info(ctx));
    send_json(ctx, res, route, 200, {{"prompt", ctx.engine.tokenizer().decode(ids)}});
  } catch (const ApiError& e) {
    send_error(ctx, res, route, e.status, e.what(), e.code);
  } catch (const Error& e) {
    send_error(ctx, res, route, 400, e.what());
  }
}

void handle_health(Context& ctx, const httplib::Request&, httplib::Response& res) {
  if (ctx.stopping) return send_json(ctx, res, "/health", 503, {{"status", "shutting down"}});
  send_json(ctx, res, "/health", 200, {{"status", "ok"}});
}

void handle_metrics(Context& ctx, const httplib::Request&, httplib::Response& res) {
  res.status = 200;
  res.set_content(render_metrics(ctx.engine.metrics(), ctx.engine.variants(), ctx.http),
                  "text/plain; version=0.0.4");
  ctx.http.count("/metrics", 200);
}

}  // namespace bitdelta::server
