// The OpenAI protocol: request bodies parsed and validated into engine requests, and the response
// objects (whole and streamed) built from what the engine produced. No HTTP here.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bitdelta/chat_template.h"
#include "bitdelta/engine.h"

namespace bitdelta::server {

using nlohmann::json;

// An error as the API reports it: {"error": {"message", "type", "code"}} with an HTTP status.
struct ApiError : std::runtime_error {
  int status;
  std::string type, code;
  ApiError(int status, std::string message, std::string type = "invalid_request_error",
           std::string code = "")
      : std::runtime_error(std::move(message)),
        status(status),
        type(std::move(type)),
        code(std::move(code)) {}
};

json error_body(int status, const std::string& message, const std::string& type,
                const std::string& code);
std::string error_type_for(int status);  // invalid_request_error, authentication_error, ...

// Parses a request body; throws ApiError(400) naming what is wrong.
json parse_body(const std::string& body);

enum class Endpoint { kCompletions, kChat };

// What the parser needs to know about the model being served.
struct ModelInfo {
  const Tokenizer* tokenizer;
  std::string base_name;  // the model used when a request names none
  size_t context;         // max_position_embeddings
  const ChatTemplate* chat_template;
};

struct ParsedRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  GenerationRequest engine;  // model, prompt ids, sampling, stop, max_tokens, logprob requests
  std::string echo_text;     // completions with echo: the prompt as text
  bool echo = false;
  bool stream = false, include_usage = false;
  bool logprobs = false;  // report logprobs of generated tokens
};

// Validates and converts a /v1/completions or /v1/chat/completions body. Throws ApiError(400)
// naming the field ("temperature must be >= 0", "prompt[2] must be a token id ...").
ParsedRequest parse_generation(const json& body, Endpoint endpoint, const ModelInfo& model);

// A token as the API shows it: its text (SentencePiece's ▁ as a space; a byte piece as that byte)
// and, for chat logprobs, its UTF-8 bytes.
std::string token_text(const Tokenizer& tokenizer, int32_t id);

// Accumulates one request's output and renders the API objects.
class ResponseBuilder {
 public:
  ResponseBuilder(const ParsedRequest& request, const Tokenizer& tokenizer, std::string id,
                  int64_t created);

  void set_prompt_logprobs(const std::vector<float>& logprobs);  // echo + logprobs
  // Adds a generated token and its final text (token id -1: text only, flushed at the end); returns
  // the streamed chunk for it (null when there is nothing to send yet: no text and no logprobs).
  json add_token(const TokenLogprob& token, const std::string& text);
  json finish(FinishReason reason, const Usage& usage);  // the final non-stream object

  // Streaming: the first chunk (chat: role; completions with echo: the prompt), the last chunk with
  // finish_reason, and the usage chunk.
  std::optional<json> first_chunk();
  json final_chunk(FinishReason reason);
  json usage_chunk(const Usage& usage);

  const std::string& text() const { return text_; }
  size_t completion_tokens() const { return tokens_.size(); }

 private:
  json chunk(json choice) const;
  json usage_json(const Usage& usage) const;
  // The completions shape for generated tokens [from, end), after the prompt's tokens if
  // with_prompt.
  json legacy_logprobs(size_t from, size_t text_offset, bool with_prompt) const;
  json chat_logprob(const TokenLogprob& t) const;

  const ParsedRequest& request_;
  const Tokenizer& tokenizer_;
  std::string id_;
  int64_t created_;
  std::string text_;                  // generated text
  std::vector<TokenLogprob> tokens_;  // generated tokens
  std::vector<size_t> offsets_;       // byte offset of each generated token's text in text_
  std::vector<float> prompt_logprobs_;
  size_t streamed_tokens_ = 0;  // tokens already reported in chunks
  size_t streamed_text_ = 0;
};

}  // namespace bitdelta::server
