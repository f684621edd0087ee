#include "server/protocol.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "bitdelta/error.h"

namespace bitdelta::server {

namespace {

constexpr int64_t kMaxLogprobs = 20;
constexpr size_t kMaxStops = 16;

const char* finish_reason_name(FinishReason reason) {
  return reason == FinishReason::kLength ? "length" : "stop";
}

[[noreturn]] void bad(const std::string& message) {
  throw ApiError(400, message);
}

bool present(const json& body, const char* field) {
  return body.contains(field) && !body[field].is_null();
}

bool get_bool(const json& body, const char* field, bool fallback) {
  if (!present(body, field)) return fallback;
  if (!body[field].is_boolean()) bad(str(field, " must be a boolean"));
  return body[field].get<bool>();
}

// Integers may arrive as 16 or 16.0; anything else (strings, fractions, 1e300) is refused.
int64_t get_int(const json& v, const std::string& field, int64_t lo, int64_t hi) {
  const auto range = [&] {
    return hi == INT64_MAX ? str(field, " must be an integer >= ", lo)
                           : str(field, " must be an integer between ", lo, " and ", hi);
  };
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(INT64_MAX)) bad(range());
    x = int64_t(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9.0e15) bad(range());
    x = int64_t(d);
  } else {
    bad(range());
  }
  if (x < lo || x > hi) bad(range());
  return x;
}

double get_number(const json& body, const char* field, double fallback) {
  if (!present(body, field)) return fallback;
  const auto& v = body[field];
  if (!v.is_number()) bad(str(field, " must be a number"));
  const double d = v.get<double>();
  if (!std::isfinite(d)) bad(str(field, " must be a finite number"));
  return d;
}

void check_token(const Tokenizer& tokenizer, const json& v, const std::string& field) {
  (void)get_int(v, field, 0, int64_t(tokenizer.vocab_size()) - 1);
}

std::vector<int32_t> token_ids(const Tokenizer& tokenizer, const json& array,
                               const std::string& field) {
  std::vector<int32_t> ids;
  ids.reserve(array.size());
  for (size_t i = 0; i < array.size(); ++i) {
    const std::string name = str(field, "[", i, "]");
    if (!array[i].is_number()) bad(str(name, " must be a token id (an integer)"));
    check_token(tokenizer, array[i], name + " (a token id)");
    ids.push_back(array[i].get<int32_t>());
  }
  return ids;
}

std::vector<int32_t> encode_text(const Tokenizer& tokenizer, const std::string& text) {
  return tokenizer.encode(text, tokenizer.adds_bos());
}

// The text of a chat message's content: a string, or a list of {"type": "text", "text"} parts.
std::string message_content(const json& m, size_t i) {
  const std::string field = str("messages[", i, "].content");
  if (!m.contains("content") || m["content"].is_null()) {
    if (m.value("role", "") == "assistant") return "";
    bad(field + " is required");
  }
  const auto& c = m["content"];
  if (c.is_string()) return c.get<std::string>();
  if (!c.is_array()) bad(field + " must be a string or a list of text parts");
  std::string text;
  for (size_t k = 0; k < c.size(); ++k) {
    const auto& part = c[k];
    const std::string pf = str(field, "[", k, "]");
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      bad(pf + " must be an object with a type");
    if (part["type"] != "text")
      bad(str(pf, ".type '", part["type"].get<std::string>(), "' is not supported (only text)"));
    if (!part.contains("text") || !part["text"].is_string()) bad(pf + ".text must be a string");
    text += part["text"].get<std::string>();
  }
  return text;
}

// One prompt: text, or token ids. `field` names it in errors ("prompt", "prompt[2]").
Prompt one_prompt(const Tokenizer& tok, const json& p, const std::string& field) {
  Prompt out;
  if (p.is_string()) {
    out.echo_text = p.get<std::string>();
    out.ids = encode_text(tok, out.echo_text);
  } else if (p.is_array() && !p.empty() && p[0].is_number()) {
    out.ids = token_ids(tok, p, field);
    out.echo_text = tok.decode(out.ids);
  } else if (p.is_array() && p.empty()) {
    bad(field + " must not be empty");
  } else {
    bad(field + " must be a string or a list of token ids");
  }
  if (out.ids.empty()) bad(field + " must not be empty (this tokenizer has no BOS)");
  return out;
}

// A prompt is a string or a list of token ids; a list of those is a list of prompts.
void parse_prompt(const json& body, const ModelInfo& model, ParsedRequest& r) {
  const Tokenizer& tok = *model.tokenizer;
  if (!present(body, "prompt")) bad("prompt is required");
  const json& p = body["prompt"];
  if (p.is_array() && !p.empty() && (p[0].is_string() || p[0].is_array())) {
    for (size_t i = 0; i < p.size(); ++i) {
      if (!p[i].is_string() && !p[i].is_array())
        bad(str("prompt[", i,
                "] must be a string or a list of token ids (prompt is a list of "
                "prompts)"));
      r.prompts.push_back(one_prompt(tok, p[i], str("prompt[", i, "]")));
    }
  } else if (p.is_string() || p.is_array()) {
    r.prompts.push_back(one_prompt(tok, p, "prompt"));
  } else {
    bad("prompt must be a string, a list of token ids, or a list of those");
  }
}

void parse_messages(const json& body, const ModelInfo& model, ParsedRequest& r) {
  if (!present(body, "messages")) bad("messages is required");
  const json& ms = body["messages"];
  if (!ms.is_array()) bad("messages must be a list of {role, content}");
  if (ms.empty()) bad("messages must not be empty");
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < ms.size(); ++i) {
    const auto& m = ms[i];
    if (!m.is_object()) bad(str("messages[", i, "] must be an object with role and content"));
    if (!m.contains("role") || !m["role"].is_string())
      bad(str("messages[", i, "].role must be a string"));
    std::string role = m["role"].get<std::string>();
    if (role == "developer") role = "system";  // newer OpenAI clients' name for system instructions
    messages.push_back({role, message_content(m, i)});
  }
  std::vector<ChatSegment> segments;
  try {
    segments = model.chat_template->render(messages);
  } catch (const Error& e) {
    bad(e.what());
  }
  const Tokenizer& tok = *model.tokenizer;
  auto& ids = r.prompts.emplace_back().ids;
  for (size_t i = 0; i < segments.size(); ++i) {
    // The first segment gets BOS as the tokenizer would add it; later ones where the template
    // asks (Llama-2's turns).
    const bool bos = i == 0 ? tok.adds_bos() : segments[i].bos_before;
    if (bos && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
    const auto piece = tok.encode(segments[i].text, false);
    ids.insert(ids.end(), piece.begin(), piece.end());
    if (segments[i].eos_after && !tok.eos_ids().empty()) ids.push_back(tok.eos_ids().front());
  }
}

void parse_stop(const json& body, ParsedRequest& r) {
  if (!present(body, "stop")) return;
  const json& s = body["stop"];
  auto& out = r.engine.stop.stop_strings;
  if (s.is_string()) {
    if (s.get<std::string>().empty()) bad("stop must not be an empty string");
    out.push_back(s.get<std::string>());
    return;
  }
  if (!s.is_array()) bad("stop must be a string or a list of strings");
  if (s.size() > kMaxStops) bad(str("stop may list at most ", kMaxStops, " strings"));
  for (size_t i = 0; i < s.size(); ++i) {
    if (!s[i].is_string()) bad(str("stop[", i, "] must be a string"));
    if (s[i].get<std::string>().empty()) bad(str("stop[", i, "] must not be empty"));
    out.push_back(s[i].get<std::string>());
  }
}

void parse_sampling(const json& body, const ModelInfo& model, ParsedRequest& r) {
  SamplingParams& s = r.engine.sampling;
  s.temperature = float(get_number(body, "temperature", 1.0));
  if (s.temperature < 0) bad("temperature must be >= 0");
  s.top_p = float(get_number(body, "top_p", 1.0));
  if (!(s.top_p > 0 && s.top_p <= 1)) bad("top_p must be in (0, 1]");
  if (present(body, "top_k")) {
    const int64_t k = get_int(body["top_k"], "top_k", -1, INT32_MAX);
    s.top_k = k < 0 ? 0 : int(k);  // -1 means off, as in vLLM
  }
  s.min_p = float(get_number(body, "min_p", 0.0));
  if (s.min_p < 0 || s.min_p > 1) bad("min_p must be in [0, 1]");
  s.repetition_penalty = float(get_number(body, "repetition_penalty", 1.0));
  if (!(s.repetition_penalty > 0)) bad("repetition_penalty must be > 0");
  if (present(body, "seed")) {
    const json& v = body["seed"];
    if (v.is_number_unsigned())
      s.seed = v.get<uint64_t>();
    else if (v.is_number_integer())
      s.seed = uint64_t(v.get<int64_t>());
    else
      bad("seed must be an integer");
  } else {
    // No seed: every request draws differently, as the OpenAI API does.
    s.seed = std::random_device{}() * 0x100000001ull + std::random_device{}();
  }
  s.presence_penalty = float(get_number(body, "presence_penalty", 0.0));
  if (!(s.presence_penalty >= -2 && s.presence_penalty <= 2))
    bad("presence_penalty must be in [-2, 2]");
  s.frequency_penalty = float(get_number(body, "frequency_penalty", 0.0));
  if (!(s.frequency_penalty >= -2 && s.frequency_penalty <= 2))
    bad("frequency_penalty must be in [-2, 2]");
  if (present(body, "logit_bias")) {
    const json& bias = body["logit_bias"];
    if (!bias.is_object()) bad("logit_bias must be an object mapping token ids to biases");
    const size_t vocab = model.tokenizer->vocab_size();
    for (const auto& [key, value] : bias.items()) {
      // Keys are token ids written in decimal, as the OpenAI API has them.
      size_t id = 0;
      bool ok = !key.empty() && key.size() <= 10;
      for (const char ch : key) {
        ok = ok && ch >= '0' && ch <= '9';
        id = id * 10 + size_t(ch - '0');  // at most 10 digits: no overflow
      }
      if (!ok || id >= vocab)
        bad(str("logit_bias: key '", key, "' must be a token id between 0 and ", vocab - 1));
      if (!value.is_number() || !(value.get<double>() >= -100 && value.get<double>() <= 100))
        bad(str("logit_bias[\"", key, "\"] must be a number in [-100, 100]"));
      s.logit_bias.emplace_back(int32_t(id), float(value.get<double>()));
    }
  }
  try {
    s.validate();
  } catch (const Error& e) {
    bad(e.what());
  }
}

}  // namespace

std::string error_type_for(int status) {
  switch (status) {
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 404:
      return "not_found_error";
    case 409:
      return "conflict_error";
    case 429:
      return "rate_limit_error";
    case 503:
      return "service_unavailable";
    default:
      return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

json error_body(int status, const std::string& message, const std::string& type,
                const std::string& code) {
  return {{"error",
           {{"message", message},
            {"type", type.empty() ? error_type_for(status) : type},
            {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

json parse_body(const std::string& body) {
  json j;
  try {
    j = json::parse(body);  // also rejects invalid UTF-8 inside strings
  } catch (const json::exception& e) {
    bad(str("request body is not valid JSON: ", e.what()));
  }
  if (!j.is_object()) bad("request body must be a JSON object");
  return j;
}

ParsedRequest parse_generation(const json& body, Endpoint endpoint, const ModelInfo& model) {
  ParsedRequest r;
  r.endpoint = endpoint;
  const bool chat = endpoint == Endpoint::kChat;
  if (present(body, "model")) {
    if (!body["model"].is_string()) bad("model must be a string (GET /v1/models lists them)");
    r.engine.model = body["model"].get<std::string>();
  } else {
    r.engine.model = model.base_name;
  }
  if (chat)
    parse_messages(body, model, r);
  else
    parse_prompt(body, model, r);
  size_t longest = 0;
  for (size_t i = 0; i < r.prompts.size(); ++i) {
    const size_t len = r.prompts[i].ids.size();
    if (len >= model.context)
      bad(str(r.prompts.size() > 1 ? str("prompt[", i, "]") : std::string("prompt"), " has ", len,
              " tokens, but the model's context is ", model.context,
              " tokens (max_position_embeddings)"));
    longest = std::max(longest, len);
  }

  // n choices per prompt, chosen from best_of sequences (the OpenAI API allows up to 128).
  if (present(body, "n")) r.n = size_t(get_int(body["n"], "n", 1, 128));
  r.best_of = r.n;
  if (present(body, "best_of")) {
    r.best_of = size_t(get_int(body["best_of"], "best_of", 1, 128));
    if (r.best_of < r.n)
      bad(str("best_of must be >= n (best_of is ", r.best_of, ", n is ", r.n, ")"));
  }
  if (r.sequences() > model.max_sequences)
    bad(str("this request asks for ", r.sequences(), " sequences (", r.prompts.size(),
            " prompt(s), ", r.best_of > r.n ? "best_of " : "n ", r.best_of,
            " each), but the server queues at most ", model.max_sequences, " (--max-queue)"));
  for (const char* f : {"tools", "functions"})
    if (present(body, f) && !(body[f].is_array() && body[f].empty()))
      bad(str(f, " are not supported"));
  if (present(body, "response_format")) {
    const json& rf = body["response_format"];
    if (!rf.is_object() || rf.value("type", "") != "text")
      bad("response_format: only {\"type\": \"text\"} is supported");
  }
  if (present(body, "suffix") &&
      !(body["suffix"].is_string() && body["suffix"].get<std::string>().empty()))
    bad("suffix is not supported");

  // max_tokens: explicit values must fit the context; the default fills what is left (chat) or is
  // 16 (completions, as in the OpenAI API), cut to what fits.
  // A list of prompts: what fits the longest.
  const size_t room = model.context - longest;
  const char* max_field =
      chat && present(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  if (present(body, max_field)) {
    const auto m = size_t(get_int(body[max_field], max_field, 1, INT64_MAX));
    if (m > room)
      bad(str(max_field, " is ", m, ", but the prompt has ", longest,
              " tokens and the model's context is ", model.context, " tokens"));
    r.engine.stop.max_tokens = m;
  } else {
    r.engine.stop.max_tokens = chat ? room : std::min<size_t>(16, room);
  }

  parse_sampling(body, model, r);
  parse_stop(body, r);
  r.engine.stop_at_eos = !get_bool(body, "ignore_eos", false);
  if (present(body, "stop_token_ids")) {
    if (!body["stop_token_ids"].is_array()) bad("stop_token_ids must be a list of token ids");
    r.engine.stop.stop_ids = token_ids(*model.tokenizer, body["stop_token_ids"], "stop_token_ids");
  }

  if (chat) {
    r.logprobs = get_bool(body, "logprobs", false);
    if (present(body, "top_logprobs")) {
      r.engine.top_logprobs =
          size_t(get_int(body["top_logprobs"], "top_logprobs", 0, kMaxLogprobs));
      if (!r.logprobs && r.engine.top_logprobs > 0) bad("top_logprobs requires logprobs: true");
    }
  } else {
    if (present(body, "logprobs")) {
      if (body["logprobs"].is_boolean())
        bad(str("logprobs must be an integer between 0 and ", kMaxLogprobs));
      r.engine.top_logprobs = size_t(get_int(body["logprobs"], "logprobs", 0, kMaxLogprobs));
      r.logprobs = true;
    }
    r.echo = get_bool(body, "echo", false);
    r.engine.prompt_logprobs = r.echo && r.logprobs;
  }
  if (!r.echo)
    for (auto& p : r.prompts) p.echo_text.clear();

  r.stream = get_bool(body, "stream", false);
  if (r.stream && r.best_of > r.n)
    bad("best_of > n cannot be streamed (the best choices are known only at the end)");
  if (present(body, "stream_options")) {
    const json& so = body["stream_options"];
    if (!so.is_object()) bad("stream_options must be an object");
    if (!r.stream) bad("stream_options is only allowed with stream: true");
    r.include_usage = get_bool(so, "include_usage", false);
  }
  return r;
}

TokenizeRequest parse_tokenize(const json& body, const ModelInfo& model) {
  const bool has_prompt = present(body, "prompt"), has_messages = present(body, "messages");
  if (has_prompt == has_messages) bad("give either prompt (text) or messages");
  TokenizeRequest out;
  out.token_strs = get_bool(body, "return_token_strs", false);
  if (has_messages) {
    if (present(body, "add_special_tokens"))
      bad("add_special_tokens applies to prompt, not messages (their template decides)");
    ParsedRequest r;
    parse_messages(body, model, r);
    out.ids = std::move(r.prompts.at(0).ids);
    return out;
  }
  if (!body["prompt"].is_string()) bad("prompt must be a string");
  const bool special = get_bool(body, "add_special_tokens", true);
  const Tokenizer& tok = *model.tokenizer;
  out.ids = tok.encode(body["prompt"].get<std::string>(), special && tok.adds_bos());
  return out;
}

std::vector<int32_t> parse_detokenize(const json& body, const ModelInfo& model) {
  if (!present(body, "tokens") || !body["tokens"].is_array())
    bad("tokens must be a list of token ids");
  return token_ids(*model.tokenizer, body["tokens"], "tokens");
}

GenerationRequest ParsedRequest::sequence(size_t s) const {
  GenerationRequest g = engine;
  g.prompt = prompts.at(s / best_of).ids;
  g.sampling.seed = engine.sampling.seed + s % best_of;  // wraps: any seed is valid
  return g;
}

ResponseBuilder::ResponseBuilder(const ParsedRequest& request, const Tokenizer& tokenizer,
                                 std::string id, int64_t created)
    : request_(request),
      tokenizer_(tokenizer),
      id_(std::move(id)),
      created_(created),
      seqs_(request.sequences()) {}

void ResponseBuilder::set_prompt_logprobs(size_t seq, const std::vector<float>& logprobs) {
  seqs_.at(seq).prompt_logprobs = logprobs;
}

json ResponseBuilder::chunk(json choice) const {
  const bool chat = request_.endpoint == Endpoint::kChat;
  json c = {{"id", id_},
            {"object", chat ? "chat.completion.chunk" : "text_completion"},
            {"created", created_},
            {"model", request_.engine.model},
            {"choices", json::array({std::move(choice)})}};
  if (request_.include_usage) c["usage"] = nullptr;
  return c;
}

json ResponseBuilder::usage_json(const Usage& usage) const {
  return {{"prompt_tokens", usage.prompt_tokens},
          {"completion_tokens", usage.completion_tokens},
          {"total_tokens", usage.prompt_tokens + usage.completion_tokens}};
}

json ResponseBuilder::chat_logprob(const TokenLogprob& t) const {
  const auto entry = [&](int32_t id, float lp) {
    const std::string text = tokenizer_.token_text(id);
    json bytes = json::array();
    for (unsigned char c : text) bytes.push_back(int(c));
    return json{{"token", text}, {"logprob", lp}, {"bytes", bytes}};
  };
  json e = entry(t.token, t.logprob);
  json top = json::array();
  for (const auto& [id, lp] : t.top) top.push_back(entry(id, lp));
  e["top_logprobs"] = std::move(top);
  return e;
}

// The legacy completions shape; with echo, the prompt's tokens come first (their first logprob is
// null: nothing predicts the first token).
json ResponseBuilder::legacy_logprobs(size_t seq, size_t from, size_t text_offset,
                                      bool with_prompt) const {
  const Sequence& q = seqs_[seq];
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  if (with_prompt) {
    const Prompt& prompt = prompt_of(seq);
    size_t offset = 0;
    for (size_t i = 0; i < prompt.ids.size(); ++i) {
      const int32_t id = prompt.ids[i];
      const std::string text = tokenizer_.token_text(id);
      tokens.push_back(text);
      offsets.push_back(std::min(offset, prompt.echo_text.size()));
      if (!tokenizer_.is_control(id)) offset += text.size();
      if (i == 0 || i - 1 >= q.prompt_logprobs.size()) {
        lps.push_back(nullptr);
        tops.push_back(nullptr);
      } else {
        lps.push_back(q.prompt_logprobs[i - 1]);
        tops.push_back(json{{text, q.prompt_logprobs[i - 1]}});
      }
    }
  }
  for (size_t i = from; i < q.tokens.size(); ++i) {
    const auto& t = q.tokens[i];
    tokens.push_back(tokenizer_.token_text(t.token));
    lps.push_back(t.logprob);
    json top = json::object();
    for (const auto& [id, lp] : t.top) {
      const std::string text = tokenizer_.token_text(id);
      if (!top.contains(text)) top[text] = lp;  // most likely first; equal texts keep the first
    }
    tops.push_back(std::move(top));
    offsets.push_back(text_offset + q.offsets[i]);
  }
  return {{"tokens", tokens},
          {"token_logprobs", lps},
          {"top_logprobs", tops},
          {"text_offset", offsets}};
}

json ResponseBuilder::add_token(size_t seq, const TokenLogprob& token, const std::string& text) {
  Sequence& q = seqs_.at(seq);
  // The engine flushes text held back at the end (an unfinished character, a partial stop-string
  // match) with token id -1: text without a token of its own.
  if (token.token >= 0) {
    q.offsets.push_back(q.text.size());
    q.tokens.push_back(token);
  }
  q.text += text;
  if (!request_.stream) return nullptr;
  if (text.empty() && (!request_.logprobs || token.token < 0)) return nullptr;
  const size_t from = q.streamed_tokens;
  q.streamed_tokens = q.tokens.size();
  const std::string piece = q.text.substr(q.streamed_text);
  q.streamed_text = q.text.size();
  if (request_.endpoint == Endpoint::kChat) {
    json lp = nullptr;
    if (request_.logprobs) {
      lp = json{{"content", json::array()}};
      for (size_t i = from; i < q.tokens.size(); ++i)
        lp["content"].push_back(chat_logprob(q.tokens[i]));
    }
    return chunk({{"index", seq},
                  {"delta", {{"content", piece}}},
                  {"logprobs", lp},
                  {"finish_reason", nullptr}});
  }
  const size_t base = prompt_of(seq).echo_text.size();  // empty without echo
  json lp = nullptr;
  if (request_.logprobs) lp = legacy_logprobs(seq, from, base, false);
  return chunk({{"index", seq}, {"text", piece}, {"logprobs", lp}, {"finish_reason", nullptr}});
}

std::optional<json> ResponseBuilder::first_chunk(size_t seq) {
  if (request_.endpoint == Endpoint::kChat)
    return chunk({{"index", seq},
                  {"delta", {{"role", "assistant"}, {"content", ""}}},
                  {"logprobs", nullptr},
                  {"finish_reason", nullptr}});
  if (!request_.echo) return std::nullopt;
  json lp = nullptr;
  if (request_.logprobs) {
    // Only the prompt part: generated tokens have not arrived yet.
    lp = legacy_logprobs(seq, 0, 0, true);
  }
  return chunk({{"index", seq},
                {"text", prompt_of(seq).echo_text},
                {"logprobs", lp},
                {"finish_reason", nullptr}});
}

json ResponseBuilder::final_chunk(size_t seq, FinishReason reason) {
  // Text held back by the engine until the end arrives with on_token; nothing is left to send here.
  if (request_.endpoint == Endpoint::kChat)
    return chunk({{"index", seq},
                  {"delta", json::object()},
                  {"logprobs", nullptr},
                  {"finish_reason", finish_reason_name(reason)}});
  return chunk({{"index", seq},
                {"text", ""},
                {"logprobs", nullptr},
                {"finish_reason", finish_reason_name(reason)}});
}

json ResponseBuilder::usage_chunk(const Usage& usage) {
  const bool chat = request_.endpoint == Endpoint::kChat;
  return {{"id", id_},
          {"object", chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created_},
          {"model", request_.engine.model},
          {"choices", json::array()},
          {"usage", usage_json(usage)}};
}

json ResponseBuilder::choice(size_t seq, size_t index, FinishReason reason) const {
  const Sequence& q = seqs_[seq];
  if (request_.endpoint == Endpoint::kChat) {
    json lp = nullptr;
    if (request_.logprobs) {
      lp = json{{"content", json::array()}};
      for (const auto& t : q.tokens) lp["content"].push_back(chat_logprob(t));
    }
    return {{"index", index},
            {"message", {{"role", "assistant"}, {"content", q.text}}},
            {"logprobs", lp},
            {"finish_reason", finish_reason_name(reason)}};
  }
  const Prompt& prompt = prompt_of(seq);
  json lp = nullptr;
  if (request_.logprobs) lp = legacy_logprobs(seq, 0, prompt.echo_text.size(), request_.echo);
  return {{"index", index},
          {"text", prompt.echo_text + q.text},
          {"logprobs", lp},
          {"finish_reason", finish_reason_name(reason)}};
}

json ResponseBuilder::finish(const std::vector<FinishReason>& reasons, const Usage& usage) {
  const size_t best_of = request_.best_of, n = request_.n;
  // Mean logprob per generated token; a sequence without tokens ranks last.
  const auto score = [&](size_t seq) -> double {
    const auto& tokens = seqs_[seq].tokens;
    if (tokens.empty()) return -INFINITY;
    double sum = 0;
    for (const auto& t : tokens) sum += t.logprob;
    return sum / double(tokens.size());
  };
  json choices = json::array();
  for (size_t p = 0; p < request_.prompts.size(); ++p) {
    std::vector<size_t> order(best_of);
    for (size_t j = 0; j < best_of; ++j) order[j] = p * best_of + j;
    if (best_of > n)  // stable: equal scores keep the order sequences were started in
      std::stable_sort(order.begin(), order.end(),
                       [&](size_t a, size_t b) { return score(a) > score(b); });
    for (size_t j = 0; j < n; ++j)
      choices.push_back(choice(order[j], p * n + j, reasons.at(order[j])));
  }
  const bool chat = request_.endpoint == Endpoint::kChat;
  return {{"id", id_},
          {"object", chat ? "chat.completion" : "text_completion"},
          {"created", created_},
          {"model", request_.engine.model},
          {"choices", std::move(choices)},
          {"usage", usage_json(usage)}};
}

}  // namespace bitdelta::server
