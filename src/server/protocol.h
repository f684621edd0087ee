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
  size_t max_sequences = 256;  // engine sequences one request may start (the engine's queue)
};

// One prompt of a request: its token ids and, for echo, its text.
struct Prompt {
  std::vector<int32_t> ids;
  std::string echo_text;  // completions with echo: the prompt as text
};

struct ParsedRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  // Model, sampling, stop, max_tokens and logprob requests; its prompt is empty: sequences() gives
  // each engine request its prompt and seed.
  GenerationRequest engine;
  std::vector<Prompt> prompts;  // one; completions may send a list
  size_t n = 1;                 // choices returned per prompt
  size_t best_of = 1;           // sequences generated per prompt (>= n)
  bool echo = false;
  bool stream = false, include_usage = false;
  bool logprobs = false;  // report logprobs of generated tokens

  // Engine sequences: best_of per prompt, prompt by prompt. Sequence s generates for prompt
  // s / best_of with seed `seed + s % best_of`, so one seeded request repeats and its choices
  // differ.
  size_t sequences() const { return prompts.size() * best_of; }
  GenerationRequest sequence(size_t s) const;
};

// Validates and converts a /v1/completions or /v1/chat/completions body. Throws ApiError(400)
// naming the field ("temperature must be >= 0", "prompt[2] must be a token id ...").
ParsedRequest parse_generation(const json& body, Endpoint endpoint, const ModelInfo& model);

// POST /tokenize: {"prompt": text} or {"messages": [...]} (the chat prompt as /v1/chat/completions
// runs it), with "add_special_tokens" (default true: BOS where the tokenizer puts it; text only)
// and "return_token_strs" (default false). POST /detokenize: {"tokens": [ids]}. Both throw
// ApiError(400) naming the field.
struct TokenizeRequest {
  std::vector<int32_t> ids;
  bool token_strs = false;  // also answer each token as text
};
TokenizeRequest parse_tokenize(const json& body, const ModelInfo& model);
std::vector<int32_t> parse_detokenize(const json& body, const ModelInfo& model);

// Accumulates one request's output, sequence by sequence (ParsedRequest::sequence), and renders
// the API objects. Streamed, sequence s is choice s (streaming needs best_of == n). Whole, prompt
// p's choices are its n sequences with the highest mean token logprob, best first, at indices
// p·n ... p·n + n − 1 (OpenAI's best_of).
class ResponseBuilder {
 public:
  ResponseBuilder(const ParsedRequest& request, const Tokenizer& tokenizer, std::string id,
                  int64_t created);

  void set_prompt_logprobs(size_t seq, const std::vector<float>& logprobs);  // echo + logprobs
  // Adds a generated token and its final text (token id -1: text only, flushed at the end); returns
  // the streamed chunk for it (null when there is nothing to send yet: no text and no logprobs).
  json add_token(size_t seq, const TokenLogprob& token, const std::string& text);
  // The final non-stream object: `reasons` has one entry per sequence; usage covers them all.
  json finish(const std::vector<FinishReason>& reasons, const Usage& usage);

  // Streaming: a choice's first chunk (chat: role; completions with echo: the prompt), its last
  // chunk with finish_reason, and the usage chunk.
  std::optional<json> first_chunk(size_t seq);
  json final_chunk(size_t seq, FinishReason reason);
  json usage_chunk(const Usage& usage);

 private:
  struct Sequence {
    std::string text;                  // generated text
    std::vector<TokenLogprob> tokens;  // generated tokens
    std::vector<size_t> offsets;       // byte offset of each generated token's text in text
    std::vector<float> prompt_logprobs;
    size_t streamed_tokens = 0;  // tokens already reported in chunks
    size_t streamed_text = 0;
  };
  const Prompt& prompt_of(size_t seq) const { return request_.prompts[seq / request_.best_of]; }
  json chunk(json choice) const;
  json usage_json(const Usage& usage) const;
  json choice(size_t seq, size_t index, FinishReason reason) const;  // whole, non-stream
  // The completions shape for sequence seq's generated tokens [from, end), after the prompt's
  // tokens if with_prompt.
  json legacy_logprobs(size_t seq, size_t from, size_t text_offset, bool with_prompt) const;
  json chat_logprob(const TokenLogprob& t) const;

  const ParsedRequest& request_;
  const Tokenizer& tokenizer_;
  std::string id_;
  int64_t created_;
  std::vector<Sequence> seqs_;
};

}  // namespace bitdelta::server
