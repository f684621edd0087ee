// The OpenAI-compatible server, through real HTTP against a real `bitdelta serve` process on
// loopback: completions and chat (whole and streamed), logprobs against `bitdelta score`, errors,
// the delta cache seen through /metrics, disconnects, and a flood of malformed requests. Plus the
// chat templates and the request parser on their own.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <cmath>
#include <ctime>
#include <fstream>
#include <functional>
#include <thread>

#include "bitdelta/chat_template.h"
#include "bitdelta/error.h"
#include "bitdelta/tokenizer.h"
#include "server/client_watch.h"
#include "server/protocol.h"
#include "server_test_util.h"

namespace bitdelta {
namespace {

using nlohmann::json;
using test::ServerProcess;
using test::TinyFamily;
namespace fs = std::filesystem;

const fs::path kSourceDir = BITDELTA_SOURCE_DIR;

const TinyFamily& family() {
  static const TinyFamily f;
  return f;
}

std::vector<std::string> family_args(const TinyFamily& f, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {f.base.string(), "--threads", "1"};
  for (const auto& n : f.names) {
    args.push_back("--variant");
    args.push_back(n + "=" + f.delta(n).string());
  }
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

struct Reply {
  int status = 0;
  json body;
  std::string raw;
};

Reply post(httplib::Client& c, const std::string& path, const std::string& body,
           const httplib::Headers& headers = {}) {
  auto r = c.Post(path, headers, body, "application/json");
  if (!r) return {-1, nullptr, "no response: " + httplib::to_string(r.error())};
  return {r->status, json::parse(r->body, nullptr, false), r->body};
}
Reply post(httplib::Client& c, const std::string& path, const json& body,
           const httplib::Headers& headers = {}) {
  return post(c, path, body.dump(), headers);
}

// data: events of an SSE body; `done` is set when it ends with [DONE].
std::vector<json> sse_events(const std::string& body, bool* done) {
  std::vector<json> out;
  *done = false;
  size_t at = 0;
  while (at < body.size()) {
    size_t end = body.find("\n\n", at);
    if (end == std::string::npos) end = body.size();
    const std::string event = body.substr(at, end - at);
    at = end + 2;
    if (event.rfind("data: ", 0) != 0) continue;
    if (event == "data: [DONE]") {
      *done = true;
      continue;
    }
    out.push_back(json::parse(event.substr(6)));
  }
  return out;
}

// The request streamed, with usage: its events, checked to end with [DONE].
std::vector<json> streamed_events(httplib::Client& c, const std::string& path, json req) {
  req["stream"] = true;
  req["stream_options"] = {{"include_usage", true}};
  const auto r = post(c, path, req);
  EXPECT_EQ(r.status, 200) << r.raw;
  bool done = false;
  auto events = sse_events(r.raw, &done);
  EXPECT_TRUE(done) << r.raw;
  return events;
}

// The value of a metric line "name{labels} value" (labels exactly as written, "" for none).
double metric(const std::string& page, const std::string& name, const std::string& labels = "") {
  const std::string key = labels.empty() ? name + " " : name + "{" + labels + "} ";
  size_t at = 0;
  while ((at = page.find(key, at)) != std::string::npos) {
    if (at == 0 || page[at - 1] == '\n') return std::stod(page.substr(at + key.size()));
    at += key.size();
  }
  return std::nan("");
}

std::string metrics(httplib::Client& c) {
  auto r = c.Get("/metrics");
  return r && r->status == 200 ? r->body : "";
}

std::string variant_state(httplib::Client& c, const std::string& name) {
  auto r = c.Get("/v1/models");
  if (!r) return "";
  const json models = json::parse(r->body);
  for (const auto& m : models["data"])
    if (m["id"] == name) return m["state"];
  return "";
}

// ---------------------------------------------------------------------------------------------
// Chat templates

TEST(ChatTemplate, DemoFamilyRendersLikeTransformers) {
  bool known = false;
  const auto t = ChatTemplate::detect(test::kDemoChatTemplate, &known);
  EXPECT_TRUE(known);
  EXPECT_EQ(t.family(), ChatFamily::kRoleMarkers);
  // The string transformers' apply_chat_template(add_generation_prompt=True) renders for one user
  // message "hi" (tools/demo_family/train.py records it as chat_render).
  std::string expected = "<|user|>\nhi\n<|assistant|>\n";
  const fs::path quality = kSourceDir / "models/demo/quality.json";
  if (fs::exists(quality)) {
    const json q = json::parse(std::ifstream(quality));
    const auto& checks = q["transformers_checks"]["autotokenizer"];
    if (checks.contains("chat_render")) expected = checks["chat_render"].get<std::string>();
  }
  const auto segments = t.render({{"user", "hi"}});
  ASSERT_EQ(segments.size(), 1u);
  EXPECT_EQ(segments[0].text, expected);
  EXPECT_EQ(
      t.render(
           {{"system", "Be brief."}, {"user", "hi"}, {"assistant", "hello"}, {"user", "more"}})[0]
          .text,
      "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\nhello\n<|user|>\nmore\n<|assistant|>\n");
  const fs::path demo = kSourceDir / "models/demo/base";
  if (fs::exists(demo / "tokenizer_config.json")) {
    EXPECT_EQ(ChatTemplate::from_checkpoint(demo).family(), ChatFamily::kRoleMarkers);
  }
}

TEST(ChatTemplate, DetectsKnownFamiliesAndFallsBack) {
  bool known = false;
  EXPECT_EQ(
      ChatTemplate::detect("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n'}}", &known)
          .family(),
      ChatFamily::kChatML);
  EXPECT_EQ(
      ChatTemplate::detect("{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}")
          .family(),
      ChatFamily::kLlama3);
  EXPECT_EQ(ChatTemplate::detect("{{ bos_token + '[INST] ' + '<<SYS>>\\n' }}").family(),
            ChatFamily::kLlama2);
  EXPECT_EQ(ChatTemplate::detect("{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}")
                .family(),
            ChatFamily::kMistral);
  EXPECT_EQ(ChatTemplate::detect("{{ something else }}", &known).family(), ChatFamily::kPlain);
  EXPECT_FALSE(known);

  const std::vector<ChatMessage> msgs = {
      {"system", "S"}, {"user", "U"}, {"assistant", "A"}, {"user", "V"}};
  EXPECT_EQ(ChatTemplate(ChatFamily::kChatML).render(msgs)[0].text,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>"
            "assistant\nA<|im_end|>\n"
            "<|im_start|>user\nV<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(ChatTemplate(ChatFamily::kLlama3).render({{"user", " U "}})[0].text,
            "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|><|start_header_id|>assistant<|"
            "end_header_id|>\n\n");
  const auto llama2 = ChatTemplate(ChatFamily::kLlama2).render(msgs);
  ASSERT_EQ(llama2.size(), 2u);
  EXPECT_EQ(llama2[0].text, "[INST] <<SYS>>\nS\n<</SYS>>\n\nU [/INST] A ");
  EXPECT_TRUE(llama2[0].bos_before && llama2[0].eos_after);
  EXPECT_EQ(llama2[1].text, "[INST] V [/INST]");
  EXPECT_TRUE(llama2[1].bos_before && !llama2[1].eos_after);
  EXPECT_EQ(ChatTemplate(ChatFamily::kMistral).render({{"user", "U"}})[0].text, "[INST] U [/INST]");
  EXPECT_EQ(ChatTemplate().render({{"user", "U"}})[0].text, "User: U\n\nAssistant:");
  EXPECT_THROW(ChatTemplate().render({{"tool", "x"}}), Error);
}

// What templates of released families write beyond the turns, read from the template itself.
TEST(ChatTemplate, DefaultSystemMessageAndLlama31SystemHeader) {
  // ChatML with a fixed system message for conversations without one (Qwen2 / Qwen2.5 write it
  // this way; the message text here is ours). The role is joined from a variable elsewhere: only a
  // literal counts.
  const std::string qwen =
      "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
      "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou "
      "are a careful assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}"
      "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
      "{%- endfor %}";
  const auto chatml = ChatTemplate::detect(qwen);
  EXPECT_EQ(chatml.family(), ChatFamily::kChatML);
  EXPECT_EQ(chatml.render({{"user", "hi"}})[0].text,
            "<|im_start|>system\nYou are a careful assistant.<|im_end|>\n<|im_start|>user\nhi"
            "<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(chatml.render({{"system", "S"}, {"user", "hi"}})[0].text,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>"
            "assistant\n");
  // A template written with raw newlines inside its literals reads the same.
  EXPECT_EQ(ChatTemplate::detect("{{ '<|im_start|>system\nRaw.<|im_end|>\n' }}")
                .render({{"user", "u"}})[0]
                .text,
            "<|im_start|>system\nRaw.<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>"
            "assistant\n");
  EXPECT_EQ(ChatTemplate::detect("{{'<|im_start|>' + m['role'] + '\\n'}}")
                .render({{"user", "hi"}})[0]
                .text,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");

  // Llama 3.1: a system block with the knowledge date and its default date first, always; the
  // first system message (trimmed) goes inside it.
  const std::string llama31 =
      "{%- if not date_string is defined %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}"
      "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}"
      "{{- \"Cutting Knowledge Date: December 2023\\n\" }}"
      "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}";
  const auto l31 = ChatTemplate::detect(llama31);
  EXPECT_EQ(l31.family(), ChatFamily::kLlama3);
  EXPECT_EQ(l31.render({{"system", " Be brief. "}, {"user", "hi"}})[0].text,
            "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December "
            "2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user"
            "<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(l31.render({{"user", "hi"}})[0].text,
            "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December "
            "2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user"
            "<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  // Llama 3.2 dates it today (strftime_now("%d %b %Y")).
  const auto l32 = ChatTemplate::detect(
      "{%- if strftime_now is defined %}{%- set date_string = strftime_now(\"%d %b %Y\") %}"
      "{%- else %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}"
      "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}"
      "{{- \"Cutting Knowledge Date: December 2023\\n\" }}");
  const auto date = [] {
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buf[32];
    std::strftime(buf, sizeof buf, "%d %b %Y", &local);
    return std::string(buf);
  };
  const std::string before = date();
  const std::string text = l32.render({{"user", "hi"}})[0].text;
  const std::string after = date();
  EXPECT_TRUE(text.find("Today Date: " + before + "\n") != std::string::npos ||
              text.find("Today Date: " + after + "\n") != std::string::npos)
      << text;
}

// ---------------------------------------------------------------------------------------------
// The request parser, without a server

TEST(Protocol, ValidatesEveryFieldByName) {
  const Tokenizer tok(family().base);
  const ChatTemplate role_markers(ChatFamily::kRoleMarkers);
  const server::ModelInfo info{&tok, "base", 256, &role_markers};
  const auto parse = [&](const std::string& body,
                         server::Endpoint e = server::Endpoint::kCompletions) {
    return server::parse_generation(server::parse_body(body), e, info);
  };
  const auto message_of = [&](const std::string& body,
                              server::Endpoint e = server::Endpoint::kCompletions) {
    try {
      parse(body, e);
    } catch (const server::ApiError& err) {
      EXPECT_EQ(err.status, 400) << body;
      return std::string(err.what());
    }
    return std::string("(accepted)");
  };
  const auto r =
      parse(R"({"model": "coder", "prompt": [1, 5, 9], "max_tokens": 7, "temperature": 0, "seed": 3,
                           "stop": ["a", "b"], "logprobs": 2, "echo": true})");
  EXPECT_EQ(r.engine.model, "coder");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].ids, (std::vector<int32_t>{1, 5, 9}));
  EXPECT_EQ(r.sequence(0).prompt, (std::vector<int32_t>{1, 5, 9}));
  EXPECT_EQ(r.sequence(0).sampling.seed, 3u);
  EXPECT_EQ(r.engine.stop.max_tokens, 7u);
  EXPECT_EQ(r.engine.top_logprobs, 2u);
  EXPECT_TRUE(r.engine.prompt_logprobs);
  EXPECT_EQ(r.engine.stop.stop_strings.size(), 2u);
  EXPECT_EQ(parse(R"({"prompt": "the dog"})").prompts[0].ids, tok.encode("the dog", true));
  EXPECT_EQ(parse(R"({"prompt": "x"})").engine.model, "base");
  const auto c = parse(R"({"model": "m", "messages": [{"role": "user", "content": "hi"}]})",
                       server::Endpoint::kChat);
  EXPECT_EQ(c.prompts.at(0).ids, tok.encode("<|user|>\nhi\n<|assistant|>\n", true));
  EXPECT_EQ(c.engine.stop.max_tokens, 256 - c.prompts[0].ids.size());

  EXPECT_NE(message_of("{not json").find("not valid JSON"), std::string::npos);
  EXPECT_NE(message_of("[1, 2]").find("JSON object"), std::string::npos);
  EXPECT_NE(message_of("{\"prompt\": \"\xff\xfe\"}").find("not valid JSON"), std::string::npos);
  EXPECT_EQ(message_of(R"({"prompt": "x", "temperature": -1})"), "temperature must be >= 0");
  EXPECT_EQ(message_of(R"({"prompt": "x", "temperature": "hot"})"), "temperature must be a number");
  EXPECT_EQ(message_of(R"({"prompt": "x", "top_p": 0})"), "top_p must be in (0, 1]");
  EXPECT_EQ(message_of(R"({"prompt": "x", "max_tokens": -3})"),
            "max_tokens must be an integer >= 1");
  EXPECT_EQ(message_of(R"({"prompt": "x", "max_tokens": 1e300})"),
            "max_tokens must be an integer >= 1");
  EXPECT_NE(
      message_of(R"({"prompt": "x", "max_tokens": 99999999999999999999999})").find("max_tokens"),
      std::string::npos);
  EXPECT_NE(message_of(R"({"prompt": "x", "max_tokens": 1000})").find("context is 256"),
            std::string::npos);

  // Lists of prompts, n and best_of: engine sequences prompt by prompt, best_of each, seeds
  // counting up from the request's so that its choices differ and one seeded request repeats.
  const auto many = parse(R"({"prompt": ["the dog", [1, 7], "fox"], "n": 2, "seed": 10,
                              "echo": true})");
  ASSERT_EQ(many.prompts.size(), 3u);
  EXPECT_EQ(many.prompts[1].ids, (std::vector<int32_t>{1, 7}));
  EXPECT_EQ(many.prompts[0].echo_text, "the dog");
  EXPECT_EQ(many.prompts[1].echo_text, tok.decode(std::vector<int32_t>{1, 7}));
  EXPECT_EQ(many.n, 2u);
  EXPECT_EQ(many.best_of, 2u);
  ASSERT_EQ(many.sequences(), 6u);
  for (size_t s = 0; s < 6; ++s) {
    EXPECT_EQ(many.sequence(s).prompt, many.prompts[s / 2].ids) << s;
    EXPECT_EQ(many.sequence(s).sampling.seed, 10u + s % 2) << s;
  }
  const auto best = parse(R"({"prompt": "x", "n": 2, "best_of": 5, "seed": -1})");
  EXPECT_EQ(best.sequences(), 5u);
  EXPECT_EQ(best.sequence(1).sampling.seed, 0u);  // -1 + 1 wraps
  EXPECT_EQ(parse(R"({"prompt": [[1, 2]]})").prompts.at(0).ids, (std::vector<int32_t>{1, 2}));
  // max_tokens must fit the longest prompt of a list; the default is cut to it.
  EXPECT_EQ(parse(json{{"prompt", {std::vector<int>(250, 7), "x"}}}.dump()).engine.stop.max_tokens,
            6u);
  EXPECT_EQ(message_of(json{{"prompt", {"x", std::vector<int>(250, 7)}}, {"max_tokens", 7}}.dump()),
            "max_tokens is 7, but the prompt has 250 tokens and the model's context is 256 tokens");
  EXPECT_EQ(message_of(json{{"prompt", {"x", std::vector<int>(256, 7)}}}.dump()),
            "prompt[1] has 256 tokens, but the model's context is 256 tokens "
            "(max_position_embeddings)");
  EXPECT_EQ(message_of(R"({"prompt": "x", "n": 0})"), "n must be an integer between 1 and 128");
  EXPECT_EQ(message_of(R"({"prompt": "x", "n": 129})"), "n must be an integer between 1 and 128");
  EXPECT_EQ(message_of(R"({"prompt": "x", "n": 1.5})"), "n must be an integer between 1 and 128");
  EXPECT_EQ(message_of(R"({"prompt": "x", "n": 3, "best_of": 2})"),
            "best_of must be >= n (best_of is 2, n is 3)");
  EXPECT_EQ(message_of(R"({"prompt": "x", "best_of": 2, "stream": true})"),
            "best_of > n cannot be streamed (the best choices are known only at the end)");
  EXPECT_EQ(message_of(R"({"prompt": "x", "n": 2, "best_of": 2, "stream": true})"), "(accepted)");
  EXPECT_EQ(message_of(R"({"prompt": ["a", "b", "c"], "n": 100})"),
            "this request asks for 300 sequences (3 prompt(s), n 100 each), but the server "
            "queues at most 256 (--max-queue)");
  EXPECT_EQ(message_of(R"({"prompt": ["a", "b", "c"], "best_of": 100})"),
            "this request asks for 300 sequences (3 prompt(s), best_of 100 each), but the server "
            "queues at most 256 (--max-queue)");
  EXPECT_EQ(message_of(R"({"prompt": ["a", 5]})"),
            "prompt[1] must be a string or a list of token ids (prompt is a list of prompts)");
  EXPECT_EQ(message_of(R"({"prompt": ["a", []]})"), "prompt[1] must not be empty");
  EXPECT_EQ(message_of(R"({"prompt": [[1, "b"]]})"),
            "prompt[0][1] must be a token id (an integer)");
  EXPECT_EQ(message_of(R"({"messages": [{"role": "user", "content": "x"}], "n": 2})",
                       server::Endpoint::kChat),
            "(accepted)");
  const auto penalized = parse(
      R"({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1.25, "logit_bias": {"7": -100, "12": 3.5}})");
  EXPECT_EQ(penalized.engine.sampling.presence_penalty, 0.5f);
  EXPECT_EQ(penalized.engine.sampling.frequency_penalty, -1.25f);
  EXPECT_EQ(penalized.engine.sampling.logit_bias,
            (std::vector<std::pair<int32_t, float>>{{12, 3.5f}, {7, -100.0f}}));
  EXPECT_EQ(message_of(R"({"prompt": "x", "presence_penalty": 2.5})"),
            "presence_penalty must be in [-2, 2]");
  EXPECT_EQ(message_of(R"({"prompt": "x", "frequency_penalty": "high"})"),
            "frequency_penalty must be a number");
  EXPECT_EQ(message_of(R"({"prompt": "x", "logit_bias": [1]})"),
            "logit_bias must be an object mapping token ids to biases");
  for (const char* key : {"300", "-1", "x1", "", "99999999999"})
    EXPECT_EQ(message_of(json{{"prompt", "x"}, {"logit_bias", {{key, 1}}}}.dump()),
              std::string("logit_bias: key '") + key + "' must be a token id between 0 and 299");
  EXPECT_EQ(message_of(R"({"prompt": "x", "logit_bias": {"5": 101}})"),
            "logit_bias[\"5\"] must be a number in [-100, 100]");
  EXPECT_EQ(message_of(R"({"prompt": "x", "logit_bias": {"5": "up"}})"),
            "logit_bias[\"5\"] must be a number in [-100, 100]");
  EXPECT_EQ(message_of(R"({"prompt": "x", "stop": ""})"), "stop must not be an empty string");
  EXPECT_EQ(message_of(R"({"prompt": "x", "stop": [1]})"), "stop[0] must be a string");
  EXPECT_EQ(message_of(R"({"prompt": "x", "logprobs": 21})"),
            "logprobs must be an integer between 0 and 20");
  EXPECT_EQ(message_of(R"({"prompt": [1, 99999]})"),
            "prompt[1] (a token id) must be an integer between 0 and 299");
  EXPECT_EQ(message_of(R"({"prompt": [1, -1]})"),
            "prompt[1] (a token id) must be an integer between 0 and 299");
  EXPECT_EQ(message_of(R"({"prompt": []})"), "prompt must not be empty");
  EXPECT_EQ(message_of(R"({"prompt": 5})"),
            "prompt must be a string, a list of token ids, or a list of those");
  EXPECT_EQ(message_of(R"({"prompt": [true]})"), "prompt must be a string or a list of token ids");
  EXPECT_EQ(message_of(R"({"model": 5, "prompt": "x"})"),
            "model must be a string (GET /v1/models lists them)");
  EXPECT_EQ(message_of(R"({"prompt": "x", "stream": "yes"})"), "stream must be a boolean");
  EXPECT_EQ(message_of(R"({"prompt": "x", "stream_options": {"include_usage": true}})"),
            "stream_options is only allowed with stream: true");
  std::vector<int> long_prompt(300, 5);
  EXPECT_NE(message_of(json{{"prompt", long_prompt}}.dump()).find("prompt has 300 tokens"),
            std::string::npos);
  const auto chat = server::Endpoint::kChat;
  EXPECT_EQ(message_of(R"({"messages": []})", chat), "messages must not be empty");
  EXPECT_EQ(message_of(R"({"messages": [{"role": "robot", "content": "x"}]})", chat),
            "messages[0].role must be system, user or assistant (got 'robot')");
  EXPECT_EQ(message_of(R"({"messages": [{"role": "user"}]})", chat),
            "messages[0].content is required");
  EXPECT_EQ(
      message_of(
          R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})",
          chat),
      "tools are not supported");
  EXPECT_EQ(
      message_of(
          R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})",
          chat),
      "response_format: only {\"type\": \"text\"} is supported");
  EXPECT_EQ(
      parse(
          R"({"messages": [{"role": "developer", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})",
          chat)
          .prompts.at(0)
          .ids,
      tok.encode("<|system|>\nS\n<|user|>\nab\n<|assistant|>\n", true));
  EXPECT_EQ(
      message_of(R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", chat),
      "messages[0].content[0].type 'image_url' is not supported (only text)");
  EXPECT_EQ(
      message_of(R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3})", chat),
      "top_logprobs requires logprobs: true");
}

// best_of: each prompt's n choices are its sequences with the highest mean token logprob (the
// OpenAI API's "highest log probability per token"), best first; equal means keep their order.
TEST(Protocol, BestOfKeepsTheHighestMeanLogprobs) {
  const Tokenizer tok(family().base);
  const ChatTemplate role_markers(ChatFamily::kRoleMarkers);
  const server::ModelInfo info{&tok, "base", 256, &role_markers};
  const auto r = server::parse_generation(
      server::parse_body(R"({"prompt": ["a", "b"], "n": 2, "best_of": 3, "logprobs": 0})"),
      server::Endpoint::kCompletions, info);
  ASSERT_EQ(r.sequences(), 6u);
  server::ResponseBuilder b(r, tok, "cmpl-x", 0);
  // Sequence -> its tokens' logprobs. Prompt 0: means -1, -1.5, -0.5 (sums -4, -1.5, -0.5: a
  // sum would rank sequence 1 second). Prompt 1: means -2, -0.1, -0.1.
  const std::vector<std::vector<float>> logprobs = {{-1, -1, -1, -1}, {-1.5f},       {-0.5f}, {-2},
                                                    {-0.1f},          {-0.1f, -0.1f}};
  for (size_t s = 0; s < logprobs.size(); ++s)
    for (float lp : logprobs[s])
      EXPECT_TRUE(b.add_token(s, {5, lp, {}}, str("s", s)).is_null());  // not streamed
  std::vector<FinishReason> reasons(6, FinishReason::kLength);
  reasons[2] = FinishReason::kStop;
  const json out = b.finish(reasons, Usage{2, 9});
  ASSERT_EQ(out["choices"].size(), 4u);
  const std::vector<std::string> texts = {"s2", "s0s0s0s0", "s4", "s5s5"};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(out["choices"][i]["index"], i);
    EXPECT_EQ(out["choices"][i]["text"], texts[i]) << i;
  }
  EXPECT_EQ(out["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(out["choices"][1]["finish_reason"], "length");
  EXPECT_EQ(out["choices"][1]["logprobs"]["token_logprobs"], json({-1, -1, -1, -1}));
  EXPECT_EQ(out["usage"]["total_tokens"], 11);
}

// ---------------------------------------------------------------------------------------------
// Against a running server

class ServerTest : public ::testing::Test {
 protected:
  test::TempDir scratch;
  int servers = 0;
  std::unique_ptr<ServerProcess> start(std::vector<std::string> extra = {}) {
    const auto log = scratch / ("serve" + std::to_string(++servers) + ".log");
    return std::make_unique<ServerProcess>(family_args(family(), std::move(extra)), log);
  }
};

// A checkpoint whose tokenizer is a byte-level BPE tokenizer.json (Llama 3's configuration, from
// tests/fixtures/bpe) and whose chat template is Llama 3's: the chat prompt the server builds is
// the ids the reference tokenizer gives for the rendered text, special tokens included.
TEST(ServerBpe, Llama3TokenizerJsonServesChatAndCompletions) {
  test::TempDir dir;
  const fs::path base = dir / "base";
  fs::create_directories(base);
  json config = test::tiny_server_config();
  config["vocab_size"] = 962;    // the fixture's ids reach 961
  config["bos_token_id"] = 956;  // <|begin_of_text|>
  config["eos_token_id"] = 960;  // <|eot_id|>
  const ModelConfig c = ModelConfig::from_json(config, "tiny");
  test::TensorMap weights;
  uint64_t seed = 300;
  for (const auto& spec : weight_table(c)) {
    auto v = test::random_floats(numel(spec.shape), seed++, spec.shape.size() == 1 ? 0.1f : 0.4f);
    if (spec.shape.size() == 1)
      for (auto& x : v) x += 1.0f;
    weights[spec.name] = test::HostTensor::from_floats(DType::BF16, spec.shape, v);
  }
  test::write_checkpoint(base, weights);
  test::write_text(base / "config.json", config.dump());
  test::write_text(base / "tokenizer_config.json",
                   json{{"chat_template",
                         "{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
                         "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"}}
                       .dump());
  fs::copy_file(kSourceDir / "tests/fixtures/bpe/tokenizer_llama3.json", base / "tokenizer.json");
  std::ifstream in(kSourceDir / "tests/fixtures/bpe/cases.json");
  const json cases = json::parse(in)["variants"]["llama3"]["cases"];
  const auto ids_of = [&](const std::string& text) {
    for (const auto& k : cases) {
      std::string bytes;
      const std::string hex = k["hex"];
      for (size_t i = 0; i + 1 < hex.size(); i += 2)
        bytes += char(std::stoi(hex.substr(i, 2), nullptr, 16));
      if (bytes == text) return k["ids"].get<std::vector<int32_t>>();
    }
    ADD_FAILURE() << "no fixture case for " << text;
    return std::vector<int32_t>{};
  };

  ServerProcess server({base.string(), "--threads", "1"}, dir / "serve.log");
  auto cl = server.client();
  const json chat = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                     {"max_tokens", 5},
                     {"temperature", 0},
                     {"ignore_eos", true},
                     {"logprobs", true}};
  const auto whole = post(cl, "/v1/chat/completions", chat);
  ASSERT_EQ(whole.status, 200) << whole.raw << server.log();
  const auto prompt = ids_of(
      "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n");
  ASSERT_FALSE(prompt.empty());
  EXPECT_EQ(whole.body["usage"]["prompt_tokens"], prompt.size());  // BOS and specials as ids
  EXPECT_EQ(whole.body["choices"][0]["logprobs"]["content"].size(), 5u);
  std::string joined;
  for (const auto& e : streamed_events(cl, "/v1/chat/completions", chat))
    if (!e["choices"].empty() && e["choices"][0]["delta"].contains("content"))
      joined += e["choices"][0]["delta"]["content"].get<std::string>();
  EXPECT_EQ(joined, whole.body["choices"][0]["message"]["content"]);

  // /tokenize gives the reference's ids.
  const auto tokenized = post(cl, "/tokenize", json{{"prompt", "Hello world"}});
  EXPECT_EQ(tokenized.body["tokens"].get<std::vector<int32_t>>(), ids_of("Hello world"));

  // Completions with echo: the prompt's tokens are the reference's, BOS first.
  const auto echoed = post(cl, "/v1/completions",
                           json{{"prompt", "Hello world"},
                                {"max_tokens", 2},
                                {"echo", true},
                                {"logprobs", 0},
                                {"temperature", 0}});
  ASSERT_EQ(echoed.status, 200) << echoed.raw;
  const auto hello = ids_of("Hello world");
  EXPECT_EQ(echoed.body["usage"]["prompt_tokens"], hello.size());
  const auto& tokens = echoed.body["choices"][0]["logprobs"]["tokens"];
  ASSERT_EQ(tokens.size(), hello.size() + 2);
  EXPECT_EQ(tokens[0], "<|begin_of_text|>");
  std::string text;
  for (size_t i = 1; i < hello.size(); ++i) text += tokens[i].get<std::string>();
  EXPECT_EQ(text, "Hello world");
  EXPECT_EQ(echoed.body["choices"][0]["text"].get<std::string>().rfind("Hello world", 0), 0u);
}

TEST_F(ServerTest, CompletionsAndChatWholeAndStreamed) {
  auto server = start();
  auto c = server->client();
  const json req = {{"model", "coder"},
                    {"prompt", "the quick brown fox"},
                    {"max_tokens", 12},
                    {"temperature", 0},
                    {"ignore_eos", true}};
  const auto whole = post(c, "/v1/completions", req);
  ASSERT_EQ(whole.status, 200) << whole.raw;
  EXPECT_EQ(whole.body["object"], "text_completion");
  EXPECT_EQ(whole.body["model"], "coder");
  EXPECT_EQ(whole.body["choices"][0]["finish_reason"], "length");
  const Tokenizer tok(family().base);
  EXPECT_EQ(whole.body["usage"]["prompt_tokens"], tok.encode("the quick brown fox", true).size());
  EXPECT_EQ(whole.body["usage"]["completion_tokens"], 12);
  EXPECT_EQ(whole.body["usage"]["total_tokens"],
            whole.body["usage"]["prompt_tokens"].get<int>() + 12);
  const std::string text = whole.body["choices"][0]["text"];

  // The same request streamed gives the same text, chunk by chunk, then usage, then [DONE].
  const auto events = streamed_events(c, "/v1/completions", req);
  std::string joined;
  std::string finish;
  for (const auto& e : events) {
    if (e["choices"].empty()) continue;
    joined += e["choices"][0]["text"].get<std::string>();
    if (!e["choices"][0]["finish_reason"].is_null()) finish = e["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(joined, text);
  EXPECT_EQ(finish, "length");
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back()["usage"]["completion_tokens"], 12);

  // Chat: the demo template, whole and streamed.
  const json creq = {
      {"model", "math"},
      {"messages",
       {{{"role", "system"}, {"content", "Be brief."}}, {{"role", "user"}, {"content", "12+7="}}}},
      {"max_tokens", 10},
      {"temperature", 0},
      {"ignore_eos", true}};
  const auto chat = post(c, "/v1/chat/completions", creq);
  ASSERT_EQ(chat.status, 200) << chat.raw;
  EXPECT_EQ(chat.body["object"], "chat.completion");
  EXPECT_EQ(chat.body["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chat.body["usage"]["prompt_tokens"],
            tok.encode("<|system|>\nBe brief.\n<|user|>\n12+7=\n<|assistant|>\n", true).size());
  json screq = creq;
  screq["stream"] = true;
  const auto schat = post(c, "/v1/chat/completions", screq);
  ASSERT_EQ(schat.status, 200);
  bool done = false;
  const auto cevents = sse_events(schat.raw, &done);
  EXPECT_TRUE(done);
  ASSERT_GE(cevents.size(), 2u);
  EXPECT_EQ(cevents[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(cevents[0]["choices"][0]["delta"]["role"], "assistant");
  std::string cjoined;
  for (const auto& e : cevents)
    if (e["choices"][0]["delta"].contains("content"))
      cjoined += e["choices"][0]["delta"]["content"].get<std::string>();
  EXPECT_EQ(cjoined, chat.body["choices"][0]["message"]["content"]);
  EXPECT_EQ(cevents.back()["choices"][0]["finish_reason"], "length");

  // A stop string ends the text before it, with finish_reason stop.
  // (The stop string is an ASCII character of the greedy text, so it cannot split a character.)
  const size_t at = text.find_first_of("abcdefghijklmnopqrstuvwxyz", 1);
  if (at != std::string::npos) {
    json stop_req = req;
    stop_req["stop"] = text.substr(at, 1);
    const auto stopped = post(c, "/v1/completions", stop_req);
    ASSERT_EQ(stopped.status, 200);
    EXPECT_EQ(stopped.body["choices"][0]["finish_reason"], "stop");
    EXPECT_EQ(stopped.body["choices"][0]["text"], text.substr(0, text.find(text[at])));
  }
  // Seeded sampling repeats.
  json seeded = req;
  seeded["temperature"] = 0.9;
  seeded["seed"] = 42;
  seeded["top_k"] = 20;
  EXPECT_EQ(post(c, "/v1/completions", seeded).body["choices"][0]["text"],
            post(c, "/v1/completions", seeded).body["choices"][0]["text"]);
  EXPECT_NE(server->log().find("[serve] /v1/completions model=coder status=200"),
            std::string::npos);
}

// n choices, lists of prompts and best_of: choice k of prompt p is the completion a request of that
// prompt alone gives with seed + k (sequences of one step give the tokens of each alone), whole and
// streamed; best_of returns the single with the highest mean token logprob.
TEST_F(ServerTest, ChoicesAndPromptListsAreTheirSingleRequests) {
  auto server = start();
  auto c = server->client();
  const Tokenizer tok(family().base);
  const json one = {{"model", "coder"},   {"prompt", "the quick brown fox"},
                    {"max_tokens", 10},   {"temperature", 0.9},
                    {"top_k", 20},        {"seed", 5},
                    {"ignore_eos", true}, {"logprobs", 0}};
  const auto single = [&](const std::string& prompt, int seed) {
    json r = one;
    r["prompt"] = prompt;
    r["seed"] = seed;
    const auto reply = post(c, "/v1/completions", r);
    EXPECT_EQ(reply.status, 200) << reply.raw;
    return reply.body["choices"][0];
  };
  std::vector<json> fox, dog;
  for (int k = 0; k < 3; ++k) fox.push_back(single("the quick brown fox", 5 + k));
  for (int k = 0; k < 2; ++k) dog.push_back(single("lazy dog", 5 + k));
  EXPECT_NE(fox[0]["text"], fox[1]["text"]);  // the seeds differ, and so do the texts

  json req = one;
  req["n"] = 3;
  const double shared_before = metric(metrics(c), "bitdelta_prompt_tokens_shared_total");
  const auto whole = post(c, "/v1/completions", req);
  ASSERT_EQ(whole.status, 200) << whole.raw;
  ASSERT_EQ(whole.body["choices"].size(), 3u);
  for (size_t k = 0; k < 3; ++k) {
    EXPECT_EQ(whole.body["choices"][k]["index"], k);
    EXPECT_EQ(whole.body["choices"][k]["text"], fox[k]["text"]) << k;
    EXPECT_EQ(whole.body["choices"][k]["finish_reason"], "length");
  }
  const size_t fox_tokens = tok.encode("the quick brown fox", true).size();
  const size_t dog_tokens = tok.encode("lazy dog", true).size();
  EXPECT_EQ(whole.body["usage"]["prompt_tokens"], fox_tokens);  // once, not once per choice
  EXPECT_EQ(whole.body["usage"]["completion_tokens"], 30);
  // ... and prefilled once: the other two choices took it.
  EXPECT_EQ(metric(metrics(c), "bitdelta_prompt_tokens_shared_total") - shared_before,
            2.0 * double(fox_tokens));

  // Streamed: each index's chunks join to its text, each ends once, usage covers all, then [DONE].
  const auto events = streamed_events(c, "/v1/completions", req);
  std::vector<std::string> joined(3);
  std::vector<int> finishes(3);
  for (const auto& e : events) {
    if (e["choices"].empty()) continue;
    ASSERT_EQ(e["choices"].size(), 1u);
    const size_t k = e["choices"][0]["index"];
    ASSERT_LT(k, 3u);
    EXPECT_EQ(finishes[k], 0) << "a chunk of choice " << k << " after its end";
    joined[k] += e["choices"][0]["text"].get<std::string>();
    if (!e["choices"][0]["finish_reason"].is_null()) ++finishes[k];
  }
  for (size_t k = 0; k < 3; ++k) {
    EXPECT_EQ(joined[k], fox[k]["text"]) << k;
    EXPECT_EQ(finishes[k], 1) << k;
  }
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back()["usage"]["completion_tokens"], 30);

  // A list of prompts: prompt p's choices at indices p·n ...; prompt tokens summed over prompts.
  json list = one;
  list["prompt"] = {"the quick brown fox", "lazy dog"};
  list["n"] = 2;
  list["echo"] = true;
  const auto both = post(c, "/v1/completions", list);
  ASSERT_EQ(both.status, 200) << both.raw;
  ASSERT_EQ(both.body["choices"].size(), 4u);
  EXPECT_EQ(both.body["choices"][1]["text"],
            "the quick brown fox" + fox[1]["text"].get<std::string>());
  EXPECT_EQ(both.body["choices"][2]["text"], "lazy dog" + dog[0]["text"].get<std::string>());
  EXPECT_EQ(both.body["choices"][3]["text"], "lazy dog" + dog[1]["text"].get<std::string>());
  EXPECT_EQ(both.body["usage"]["prompt_tokens"], fox_tokens + dog_tokens);
  EXPECT_EQ(both.body["usage"]["completion_tokens"], 40);

  // best_of 3: the one of the three singles whose tokens have the highest mean logprob.
  size_t best = 0;
  std::vector<double> mean(3);
  for (size_t k = 0; k < 3; ++k) {
    for (const auto& lp : fox[k]["logprobs"]["token_logprobs"]) mean[k] += lp.get<double>() / 10;
    if (mean[k] > mean[best]) best = k;
  }
  json bo = one;
  bo["best_of"] = 3;
  const auto chosen = post(c, "/v1/completions", bo);
  ASSERT_EQ(chosen.status, 200) << chosen.raw;
  ASSERT_EQ(chosen.body["choices"].size(), 1u);
  EXPECT_EQ(chosen.body["choices"][0]["text"], fox[best]["text"])
      << mean[0] << " " << mean[1] << " " << mean[2];
  EXPECT_EQ(chosen.body["usage"]["completion_tokens"], 30);  // all three were generated

  // Chat, n = 2 streamed: each index opens with the assistant role; contents match the whole.
  const json chat = {{"model", "math"},   {"messages", {{{"role", "user"}, {"content", "12+7="}}}},
                     {"max_tokens", 6},   {"temperature", 0.9},
                     {"seed", 11},        {"n", 2},
                     {"ignore_eos", true}};
  const auto cwhole = post(c, "/v1/chat/completions", chat);
  ASSERT_EQ(cwhole.status, 200) << cwhole.raw;
  ASSERT_EQ(cwhole.body["choices"].size(), 2u);
  std::vector<std::string> content(2);
  std::vector<int> chunks(2);
  for (const auto& e : streamed_events(c, "/v1/chat/completions", chat)) {
    if (e["choices"].empty()) {  // the usage chunk
      EXPECT_EQ(e["usage"]["completion_tokens"], 12);
      continue;
    }
    const size_t k = e["choices"][0]["index"];
    ASSERT_LT(k, 2u);
    if (chunks[k]++ == 0) {
      EXPECT_EQ(e["choices"][0]["delta"]["role"], "assistant") << k;
    }
    if (e["choices"][0]["delta"].contains("content"))
      content[k] += e["choices"][0]["delta"]["content"].get<std::string>();
  }
  for (size_t k = 0; k < 2; ++k)
    EXPECT_EQ(content[k], cwhole.body["choices"][k]["message"]["content"]) << k;
}

TEST_F(ServerTest, TokenIdPromptLogprobsMatchScore) {
  auto server = start();
  auto c = server->client();
  const std::vector<int32_t> ids = {1, 40, 41, 77, 120, 5, 9, 200, 33};
  std::string csv;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) csv += ',';
    csv += std::to_string(ids[i]);
  }
  for (const std::string model : {"base", "writer"}) {
    const auto r = post(c, "/v1/completions",
                        {{"model", model},
                         {"prompt", ids},
                         {"max_tokens", 1},
                         {"temperature", 0},
                         {"logprobs", 3},
                         {"echo", true},
                         {"ignore_eos", true}});
    ASSERT_EQ(r.status, 200) << r.raw;
    const auto& lp = r.body["choices"][0]["logprobs"];
    ASSERT_EQ(lp["token_logprobs"].size(), ids.size() + 1);
    EXPECT_TRUE(lp["token_logprobs"][0].is_null());
    EXPECT_EQ(lp["tokens"].size(), ids.size() + 1);
    EXPECT_EQ(lp["text_offset"].size(), ids.size() + 1);
    EXPECT_EQ(lp["top_logprobs"][ids.size()].size(), 3u);

    std::string args = "score " + family().base.string() + " --tokens " + csv + " --json";
    if (model != "base") args += " --delta " + family().delta(model).string();
    const auto out = test::run_cli(args, scratch.path());
    ASSERT_EQ(out.exit_code, 0) << out.err;
    const json score = json::parse(out.out);
    const auto& expected = score["prompt_logprobs"];
    ASSERT_EQ(expected.size(), ids.size() - 1);
    for (size_t i = 0; i + 1 < ids.size(); ++i)
      EXPECT_NEAR(lp["token_logprobs"][i + 1].get<double>(), expected[i].get<double>(), 1e-4)
          << model << " token " << i + 1;

    // The generated token: greedy picks the argmax of the last logits; its logprob is log_softmax.
    std::vector<float> last = score["last_logits"].get<std::vector<float>>();
    const auto lsm = log_softmax(last);
    const size_t best = size_t(std::max_element(last.begin(), last.end()) - last.begin());
    EXPECT_NEAR(lp["token_logprobs"][ids.size()].get<double>(), lsm[best], 1e-4) << model;
    EXPECT_EQ(r.body["usage"]["prompt_tokens"], ids.size());
  }
  // Streamed with echo: the first chunk is the prompt with its logprobs, then the generated tokens.
  const auto streamed = post(c, "/v1/completions",
                             {{"model", "base"},
                              {"prompt", ids},
                              {"max_tokens", 3},
                              {"temperature", 0},
                              {"logprobs", 1},
                              {"echo", true},
                              {"ignore_eos", true},
                              {"stream", true}});
  ASSERT_EQ(streamed.status, 200) << streamed.raw;
  bool done = false;
  const auto events = sse_events(streamed.raw, &done);
  ASSERT_TRUE(done);
  ASSERT_FALSE(events.empty());
  const Tokenizer tok(family().base);
  EXPECT_EQ(events[0]["choices"][0]["text"], tok.decode(ids));
  EXPECT_EQ(events[0]["choices"][0]["logprobs"]["tokens"].size(), ids.size());
  size_t generated = 0;
  for (size_t i = 1; i < events.size(); ++i)
    if (events[i]["choices"][0]["logprobs"].is_object())
      generated += events[i]["choices"][0]["logprobs"]["tokens"].size();
  EXPECT_EQ(generated, 3u);

  // Chat logprobs use the new shape.
  const auto chat = post(c, "/v1/chat/completions",
                         {{"model", "legal"},
                          {"messages", {{{"role", "user"}, {"content", "hi"}}}},
                          {"max_tokens", 4},
                          {"temperature", 0},
                          {"logprobs", true},
                          {"top_logprobs", 2},
                          {"ignore_eos", true}});
  ASSERT_EQ(chat.status, 200) << chat.raw;
  const auto& content = chat.body["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 4u);
  for (const auto& t : content) {
    EXPECT_TRUE(t["token"].is_string());
    EXPECT_LE(t["logprob"].get<double>(), 0.0);
    EXPECT_TRUE(t["bytes"].is_array());
    EXPECT_EQ(t["top_logprobs"].size(), 2u);
  }
}

TEST_F(ServerTest, ModelsListsBaseAndVariants) {
  auto server = start();
  auto c = server->client();
  auto r = c.Get("/v1/models");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 5u);
  EXPECT_EQ(j["data"][0]["id"], "base");
  EXPECT_TRUE(j["data"][0]["parent"].is_null());
  for (size_t i = 1; i < 5; ++i) {
    EXPECT_EQ(j["data"][i]["object"], "model");
    EXPECT_EQ(j["data"][i]["owned_by"], "bitdelta");
    EXPECT_EQ(j["data"][i]["parent"], "base");
    EXPECT_TRUE(j["data"][i]["state"].is_string());
  }
  auto one = c.Get("/v1/models/writer");
  ASSERT_TRUE(one);
  EXPECT_EQ(one->status, 200);
  EXPECT_EQ(json::parse(one->body)["parent"], "base");
  EXPECT_EQ(c.Get("/v1/models/nope")->status, 404);
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
}

TEST_F(ServerTest, ErrorsInOpenAIShape) {
  auto server = start();
  auto c = server->client();
  const auto expect_error = [&](const Reply& r, int status, const std::string& fragment) {
    EXPECT_EQ(r.status, status) << r.raw;
    ASSERT_TRUE(r.body.is_object()) << r.raw;
    ASSERT_TRUE(r.body.contains("error")) << r.raw;
    EXPECT_TRUE(r.body["error"]["message"].is_string());
    EXPECT_TRUE(r.body["error"]["type"].is_string());
    EXPECT_NE(r.body["error"]["message"].get<std::string>().find(fragment), std::string::npos)
        << r.raw;
  };
  expect_error(post(c, "/v1/completions", json{{"model", "nope"}, {"prompt", "x"}}), 404, "nope");
  expect_error(
      post(c, "/v1/chat/completions", std::string("{\"model\": \"base\", \"messages\": [")), 400,
      "not valid JSON");
  expect_error(
      post(c, "/v1/completions", json{{"model", "base"}, {"prompt", "x"}, {"temperature", -0.5}}),
      400, "temperature must be >= 0");
  expect_error(post(c, "/v1/completions", json{{"prompt", "x"}, {"max_tokens", -1}}), 400,
               "max_tokens");
  expect_error(post(c, "/v1/completions", json{{"prompt", "x"}, {"n", 300}}), 400,
               "n must be an integer between 1 and 128");
  expect_error(post(c, "/v1/completions", std::string("{\"prompt\": \"bad \xc3\x28 utf8\"}")), 400,
               "not valid JSON");
  expect_error(post(c, "/v1/completions", json{{"prompt", std::vector<int>(400, 7)}}), 400,
               "context");
  expect_error(post(c, "/v1/chat/completions", json{{"messages", "hello"}}), 400, "messages");
  expect_error(post(c, "/v1/nothing-here", json::object()), 404, "no route");
  // A known path asked with a method it is not served with: 405, and the methods it takes.
  const auto expect_405 = [&](httplib::Result r, const std::string& allow,
                              const std::string& text) {
    ASSERT_TRUE(r);
    expect_error({r->status, json::parse(r->body, nullptr, false), r->body}, 405, text);
    EXPECT_EQ(r->get_header_value("Allow"), allow);
  };
  expect_405(c.Get("/v1/completions"), "POST, OPTIONS", "/v1/completions takes POST, not GET");
  expect_405(c.Delete("/v1/models"), "GET, OPTIONS", "/v1/models takes GET, not DELETE");
  expect_405(c.Post("/v1/models/writer", "{}", "application/json"), "GET, OPTIONS",
             "takes GET, not POST");
  expect_405(c.Put("/metrics", "", "text/plain"), "GET, OPTIONS", "takes GET, not PUT");
  EXPECT_EQ(c.Delete("/v1/models-list")->status, 404);
  // Loading is off without --variants-dir.
  expect_error(post(c, "/v1/variants/load", json{{"name", "x"}, {"path", "/etc/passwd"}}), 403,
               "--variants-dir");
  // Still serving.
  EXPECT_EQ(post(c, "/v1/completions", json{{"prompt", "x"}, {"max_tokens", 2}}).status, 200);
}

// A conversation's next turn starts from the first turn's kept cache (the default
// --prefix-cache-bytes), and gives what a server without kept caches gives.
TEST_F(ServerTest, NextChatTurnStartsFromTheKeptCache) {
  auto server = start();
  auto off = start({"--prefix-cache-bytes", "0"});
  auto c = server->client();
  auto c_off = off->client();
  json turn = {{"model", "writer"},
               {"messages",
                {{{"role", "system"}, {"content", "You write short poems about the sea and wind."}},
                 {{"role", "user"}, {"content", "Write about the lazy dog and the brown fox."}}}},
               {"max_tokens", 8},
               {"temperature", 0},
               {"ignore_eos", true}};
  const auto first = post(c, "/v1/chat/completions", turn);
  ASSERT_EQ(first.status, 200) << first.raw;
  const size_t first_prompt = first.body["usage"]["prompt_tokens"];
  ASSERT_GE(first_prompt, 16u);
  turn["messages"].push_back(first.body["choices"][0]["message"]);
  turn["messages"].push_back({{"role", "user"}, {"content", "And now the wind."}});
  const double before = metric(metrics(c), "bitdelta_prompt_tokens_cached_total");
  const auto second = post(c, "/v1/chat/completions", turn);
  ASSERT_EQ(second.status, 200) << second.raw;
  const double taken = metric(metrics(c), "bitdelta_prompt_tokens_cached_total") - before;
  EXPECT_GE(taken, 16);
  EXPECT_LE(taken, double(second.body["usage"]["prompt_tokens"].get<size_t>() - 1));
  // The same two turns on a server that keeps nothing.
  turn["messages"].erase(turn["messages"].end() - 2, turn["messages"].end());
  EXPECT_EQ(post(c_off, "/v1/chat/completions", turn).body["choices"][0]["message"],
            first.body["choices"][0]["message"]);
  turn["messages"].push_back(first.body["choices"][0]["message"]);
  turn["messages"].push_back({{"role", "user"}, {"content", "And now the wind."}});
  EXPECT_EQ(post(c_off, "/v1/chat/completions", turn).body["choices"][0]["message"],
            second.body["choices"][0]["message"]);
  EXPECT_EQ(metric(metrics(c_off), "bitdelta_prompt_tokens_cached_total"), 0);
  EXPECT_EQ(metric(metrics(c_off), "bitdelta_prefix_cache_entries"), 0);
}

TEST_F(ServerTest, TokenizeAndDetokenize) {
  auto server = start();
  auto c = server->client();
  const Tokenizer tok(family().base);
  const auto t = post(c, "/tokenize", json{{"prompt", "the quick brown fox"}});
  ASSERT_EQ(t.status, 200) << t.raw;
  const auto ids = tok.encode("the quick brown fox", true);
  EXPECT_EQ(t.body["tokens"].get<std::vector<int32_t>>(), ids);
  EXPECT_EQ(t.body["count"], ids.size());
  EXPECT_EQ(t.body["max_model_len"], 256);
  // Without special tokens: no BOS. With token strings: each token as logprobs show it.
  const auto plain = post(c, "/tokenize",
                          json{{"model", "coder"},
                               {"prompt", "the quick brown fox"},
                               {"add_special_tokens", false},
                               {"return_token_strs", true}});
  ASSERT_EQ(plain.status, 200) << plain.raw;
  EXPECT_EQ(plain.body["tokens"].get<std::vector<int32_t>>(),
            tok.encode("the quick brown fox", false));
  std::string joined;
  for (const auto& piece : plain.body["token_strs"]) joined += piece.get<std::string>();
  EXPECT_EQ(joined, " the quick brown fox");  // SentencePiece's leading ▁
  // Messages: the prompt a chat request runs (the usage it reports).
  const json messages = {{{"role", "user"}, {"content", "hi"}}};
  const auto chat_ids = post(c, "/tokenize", json{{"messages", messages}});
  ASSERT_EQ(chat_ids.status, 200) << chat_ids.raw;
  EXPECT_EQ(chat_ids.body["tokens"].get<std::vector<int32_t>>(),
            tok.encode("<|user|>\nhi\n<|assistant|>\n", true));
  const auto chat =
      post(c, "/v1/chat/completions", json{{"messages", messages}, {"max_tokens", 1}});
  EXPECT_EQ(chat.body["usage"]["prompt_tokens"], chat_ids.body["count"]);
  // Back to text.
  const auto d = post(c, "/detokenize", json{{"tokens", ids}});
  ASSERT_EQ(d.status, 200) << d.raw;
  EXPECT_EQ(d.body["prompt"], "the quick brown fox");
  // Errors name the field.
  const auto message = [](const Reply& r) { return r.body["error"]["message"].get<std::string>(); };
  auto e = post(c, "/detokenize", json{{"tokens", {1, 99999}}});
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(message(e), "tokens[1] (a token id) must be an integer between 0 and 299");
  e = post(c, "/detokenize", json{{"tokens", "1 2"}});
  EXPECT_EQ(message(e), "tokens must be a list of token ids");
  e = post(c, "/tokenize", json{{"prompt", "x"}, {"messages", messages}});
  EXPECT_EQ(message(e), "give either prompt (text) or messages");
  e = post(c, "/tokenize", json{{"prompt", {1, 2}}});
  EXPECT_EQ(message(e), "prompt must be a string");
  e = post(c, "/tokenize", json{{"prompt", "x"}, {"return_token_strs", "yes"}});
  EXPECT_EQ(message(e), "return_token_strs must be a boolean");
  e = post(c, "/tokenize", json{{"model", "nope"}, {"prompt", "x"}});
  EXPECT_EQ(e.status, 404);
  e = post(c, "/tokenize", std::string("{\"prompt\": "));
  EXPECT_EQ(e.status, 400);
}

TEST_F(ServerTest, ApiKeyRequiredOnV1) {
  auto server = start({"--api-key", "sekrit"});
  auto c = server->client();
  const json req = {{"prompt", "x"}, {"max_tokens", 2}};
  auto none = post(c, "/v1/completions", req);
  EXPECT_EQ(none.status, 401);
  EXPECT_EQ(none.body["error"]["type"], "authentication_error");
  EXPECT_EQ(post(c, "/v1/completions", req, {{"Authorization", "Bearer wrong!"}}).status, 401);
  EXPECT_EQ(post(c, "/v1/completions", req, {{"Authorization", "Bearer sekrit"}}).status, 200);
  EXPECT_EQ(post(c, "/tokenize", req).status, 401);
  EXPECT_EQ(post(c, "/detokenize", json{{"tokens", {1}}}).status, 401);
  EXPECT_EQ(post(c, "/tokenize", req, {{"Authorization", "Bearer sekrit"}}).status, 200);
  auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(models->status, 401);
  EXPECT_EQ(c.Get("/health")->status, 200);
}

// A page of an allowed origin may call the API from a browser: the preflight (OPTIONS, no key) is
// answered with the path's methods, and every answer (an error too) names the origin. Another
// origin, or a server started without --allowed-origin, gets no such header; OPTIONS still lists
// the methods.
TEST_F(ServerTest, BrowserPagesOfAllowedOriginsMayCallIt) {
  const std::string page = "http://chat.example:3000";
  auto server = start({"--api-key", "sekrit", "--allowed-origin", page});
  auto c = server->client();
  const httplib::Headers preflight = {
      {"Origin", page},
      {"Access-Control-Request-Method", "POST"},
      {"Access-Control-Request-Headers", "authorization,content-type"}};
  auto p = c.Options("/v1/chat/completions", preflight);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->status, 204);
  EXPECT_EQ(p->get_header_value("Access-Control-Allow-Origin"), page);
  EXPECT_EQ(p->get_header_value("Access-Control-Allow-Methods"), "POST");
  EXPECT_EQ(p->get_header_value("Access-Control-Allow-Headers"), "authorization,content-type");
  EXPECT_EQ(p->get_header_value("Allow"), "POST, OPTIONS");
  EXPECT_EQ(p->get_header_value("Vary"), "Origin");
  // The call itself: answered (or refused without the key) with the origin named.
  const json req = {{"prompt", "x"}, {"max_tokens", 2}};
  auto ok = c.Post("/v1/completions", {{"Origin", page}, {"Authorization", "Bearer sekrit"}},
                   req.dump(), "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  EXPECT_EQ(ok->get_header_value("Access-Control-Allow-Origin"), page);
  auto refused = c.Post("/v1/completions", {{"Origin", page}}, req.dump(), "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 401);
  EXPECT_EQ(refused->get_header_value("Access-Control-Allow-Origin"), page);
  auto streamed =
      c.Post("/v1/completions", {{"Origin", page}, {"Authorization", "Bearer sekrit"}},
             json{{"prompt", "x"}, {"max_tokens", 2}, {"stream", true}}.dump(), "application/json");
  ASSERT_TRUE(streamed);
  EXPECT_EQ(streamed->status, 200);
  EXPECT_EQ(streamed->get_header_value("Access-Control-Allow-Origin"), page);
  // Another origin: no permission given.
  auto other = c.Options("/v1/chat/completions", {{"Origin", "http://evil.example"},
                                                  {"Access-Control-Request-Method", "POST"}});
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 204);
  EXPECT_FALSE(other->has_header("Access-Control-Allow-Origin"));
  EXPECT_FALSE(other->has_header("Access-Control-Allow-Methods"));
  auto unknown = c.Options("/v1/nothing", preflight);
  ASSERT_TRUE(unknown);
  EXPECT_EQ(unknown->status, 404);

  // "*": any origin. None given: no header for anyone.
  auto any = start({"--allowed-origin", "*"});
  auto ca = any->client();
  auto h = ca.Get("/v1/models", {{"Origin", "http://anything.example"}});
  ASSERT_TRUE(h);
  EXPECT_EQ(h->get_header_value("Access-Control-Allow-Origin"), "*");
  EXPECT_FALSE(h->has_header("Vary"));
  auto closed = start();
  auto cc = closed->client();
  auto m = cc.Get("/v1/models", {{"Origin", page}});
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  EXPECT_FALSE(m->has_header("Access-Control-Allow-Origin"));
  auto o = cc.Options("/v1/models", {{"Origin", page}});
  ASSERT_TRUE(o);
  EXPECT_EQ(o->status, 204);
  EXPECT_EQ(o->get_header_value("Allow"), "GET, OPTIONS");
}

// A client's X-Request-Id comes back on the answer (streamed or not, an error too) and is in the
// request's log line; one that is not 1 to 128 visible ASCII characters is ignored.
TEST_F(ServerTest, RequestIdIsEchoedAndLogged) {
  auto server = start();
  auto c = server->client();
  const std::string req = json{{"prompt", "x"}, {"max_tokens", 2}}.dump();
  auto plain = c.Post("/v1/completions", {{"X-Request-Id", "gw-7f3a"}}, req, "application/json");
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->status, 200);
  EXPECT_EQ(plain->get_header_value("X-Request-Id"), "gw-7f3a");
  auto streamed =
      c.Post("/v1/completions", {{"X-Request-Id", "gw-stream"}},
             json{{"prompt", "x"}, {"max_tokens", 2}, {"stream", true}}.dump(), "application/json");
  ASSERT_TRUE(streamed);
  EXPECT_EQ(streamed->get_header_value("X-Request-Id"), "gw-stream");
  auto bad = c.Post("/v1/completions", {{"X-Request-Id", "gw-bad"}}, "{", "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(bad->get_header_value("X-Request-Id"), "gw-bad");
  for (const std::string& odd : {std::string("has space"), std::string(129, 'a')}) {
    auto r = c.Post("/v1/completions", {{"X-Request-Id", odd}}, req, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
    EXPECT_FALSE(r->has_header("X-Request-Id")) << odd;
  }
  auto none = c.Post("/v1/completions", req, "application/json");
  ASSERT_TRUE(none);
  EXPECT_FALSE(none->has_header("X-Request-Id"));
  const std::string log = server->log();
  EXPECT_NE(log.find("status=200 prompt_tokens="), std::string::npos) << log;
  for (const char* id : {"request_id=gw-7f3a", "stream request_id=gw-stream", "request_id=gw-bad"})
    EXPECT_NE(log.find(id), std::string::npos) << id << "\n" << log;
  EXPECT_EQ(log.find("request_id=has"), std::string::npos) << log;
}

TEST_F(ServerTest, DifferentVariantsShareSteps) {
  auto server = start();
  auto c = server->client();
  // Three streams of three variants at once. The tiny model writes 200 tokens in about 15 ms, so on a
  // loaded machine the three may run one after another and share no step; then they are sent again
  // (up to five times), and every count below is per round.
  int rounds = 0;
  std::string page;
  while (rounds < 5) {
    ++rounds;
    std::vector<std::thread> threads;
    std::atomic<int> ok{0};
    for (const std::string model : {"coder", "math", "writer"})
      threads.emplace_back([&, model] {
        auto cc = server->client();
        const auto r = post(cc, "/v1/completions",
                            {{"model", model},
                             {"prompt", "the lazy dog"},
                             {"max_tokens", 200},
                             {"temperature", 0},
                             {"ignore_eos", true},
                             {"stream", true}});
        if (r.status == 200) ++ok;
      });
    for (auto& t : threads) t.join();
    EXPECT_EQ(ok, 3);
    page = metrics(c);
    if (metric(page, "bitdelta_mixed_variant_steps_total") > 0) break;
  }
  EXPECT_GT(metric(page, "bitdelta_mixed_variant_steps_total"), 0) << page;
  EXPECT_GE(metric(page, "bitdelta_max_variants_in_step"), 2);
  EXPECT_EQ(metric(page, "bitdelta_requests_total", "variant=\"math\""), rounds);
  EXPECT_EQ(metric(page, "bitdelta_completion_tokens_total", "variant=\"writer\""), 200 * rounds);
  EXPECT_EQ(metric(page, "bitdelta_time_to_first_token_seconds_count", "variant=\"coder\""), rounds);
  EXPECT_EQ(metric(page, "bitdelta_running_sequences"), 0);
}

TEST_F(ServerTest, ConcurrentRequestsToColdVariantLoadOnce) {
  auto server = start();
  auto c = server->client();
  const double before = metric(metrics(c), "bitdelta_delta_cache_loads_total");
  EXPECT_EQ(variant_state(c, "legal"), "cold");
  std::vector<std::thread> threads;
  std::vector<Reply> replies(20);
  for (int i = 0; i < 20; ++i)
    threads.emplace_back([&, i] {
      auto cc = server->client();
      replies[size_t(i)] = post(cc, "/v1/completions",
                                {{"model", "legal"},
                                 {"prompt", "license " + std::to_string(i)},
                                 {"max_tokens", 4},
                                 {"temperature", 0},
                                 {"ignore_eos", true}});
    });
  for (auto& t : threads) t.join();
  for (const auto& r : replies) EXPECT_EQ(r.status, 200) << r.raw;
  const auto page = metrics(c);
  EXPECT_EQ(metric(page, "bitdelta_delta_cache_loads_total") - before, 1) << page;
  EXPECT_EQ(metric(page, "bitdelta_requests_total", "variant=\"legal\""), 20);
  EXPECT_EQ(variant_state(c, "legal"), "resident");
}

TEST_F(ServerTest, FullQueueAnswers429) {
  auto server = start({"--max-running", "1", "--max-queue", "1"});
  // Twelve requests at once for one running slot and one queue place: some must be refused. The
  // tiny model serves one in about 20 ms, so on a loaded machine the twelve may arrive spread out
  // enough that none is; then they are sent again (up to five times).
  int ok = 0, full = 0;
  for (int round = 0; round < 5 && full == 0; ++round) {
    std::vector<std::thread> threads;
    std::vector<Reply> replies(12);
    for (size_t i = 0; i < replies.size(); ++i)
      threads.emplace_back([&, i] {
        auto c = server->client();
        replies[i] = post(c, "/v1/completions",
                          {{"model", "coder"},
                           {"prompt", "the"},
                           {"max_tokens", 250},
                           {"ignore_eos", true},
                           {"seed", i}});
      });
    for (auto& t : threads) t.join();
    ok = full = 0;
    for (const auto& r : replies) {
      if (r.status == 200) ++ok;
      if (r.status == 429) {
        ++full;
        EXPECT_EQ(r.body["error"]["type"], "rate_limit_error") << r.raw;
        EXPECT_EQ(r.body["error"]["code"], "queue_full") << r.raw;
      }
    }
    EXPECT_EQ(ok + full, 12);
    EXPECT_GE(ok, 1);
  }
  EXPECT_GE(full, 1);
  // More sequences than the queue can ever hold is a bad request, not a full queue.
  auto c = server->client();
  const auto many = post(c, "/v1/completions", json{{"prompt", "the"}, {"n", 2}});
  EXPECT_EQ(many.status, 400) << many.raw;
  EXPECT_EQ(many.body["error"]["message"],
            "this request asks for 2 sequences (1 prompt(s), n 2 each), but the server queues at "
            "most 1 (--max-queue)");
}

TEST_F(ServerTest, BudgetOfTwoDeltasEvictsButKeepsPinned) {
  // One delta's resident size, measured by a server without a budget.
  uint64_t one = 0;
  {
    auto probe = start();
    auto c = probe->client();
    ASSERT_EQ(
        post(c, "/v1/completions", json{{"model", "math"}, {"prompt", "x"}, {"max_tokens", 1}})
            .status,
        200);
    const json models = json::parse(c.Get("/v1/models")->body);
    for (const auto& m : models["data"])
      if (m["id"] == "math") one = m.value("bytes", uint64_t(0));
    ASSERT_GT(one, 0u);
  }
  auto server = start({"--delta-cache-bytes", std::to_string(one * 2 + one / 2), "--pin", "coder"});
  auto c = server->client();
  const auto ask = [&](const std::string& model) {
    return post(c, "/v1/completions", json{{"model", model}, {"prompt", "x"}, {"max_tokens", 1}})
        .status;
  };
  ASSERT_EQ(ask("coder"), 200);
  for (const std::string m : {"math", "writer", "legal", "math", "writer"}) {
    ASSERT_EQ(ask(m), 200) << m;
    EXPECT_EQ(variant_state(c, "coder"), "resident") << "pinned coder after " << m;
    int resident = 0;
    const json models = json::parse(c.Get("/v1/models")->body);
    for (const auto& v : models["data"]) resident += v["state"] == "resident";
    // The budget holds two: the pinned coder and the one just used; the other is evicted.
    EXPECT_EQ(resident, 2) << "after " << m;
    EXPECT_EQ(variant_state(c, m), "resident") << m;
  }
  const auto page = metrics(c);
  EXPECT_GE(metric(page, "bitdelta_delta_cache_evictions_total"), 3) << page;
  EXPECT_LE(metric(page, "bitdelta_delta_cache_resident_bytes"), double(one * 2 + one / 2));
  EXPECT_EQ(metric(page, "bitdelta_delta_cache_budget_bytes"), double(one * 2 + one / 2));
}

TEST_F(ServerTest, CorruptDeltaFailsOnlyItsOwnRequestsAndIsRetried) {
  const fs::path broken = scratch / "broken.bitdelta";
  {
    const std::string good = test::read_file(family().delta("writer"));
    std::ofstream(broken, std::ios::binary) << good.substr(0, good.size() / 2);
  }
  auto server = start({"--variant", "broken=" + broken.string()});
  auto c = server->client();
  const json req = {{"model", "broken"}, {"prompt", "x"}, {"max_tokens", 2}};
  const auto bad = post(c, "/v1/completions", req);
  EXPECT_GE(bad.status, 500) << bad.raw;
  ASSERT_TRUE(bad.body.contains("error")) << bad.raw;
  EXPECT_NE(bad.body["error"]["message"].get<std::string>().find("broken"), std::string::npos)
      << bad.raw;
  json sreq = req;
  sreq["stream"] = true;
  EXPECT_GE(post(c, "/v1/completions", sreq).status, 500);
  EXPECT_EQ(post(c, "/v1/completions", json{{"model", "coder"}, {"prompt", "x"}, {"max_tokens", 2}})
                .status,
            200);
  EXPECT_EQ(variant_state(c, "broken"), "failed");
  // Repaired on disk: the next request tries again and succeeds.
  fs::copy_file(family().delta("writer"), broken, fs::copy_options::overwrite_existing);
  const auto good = post(c, "/v1/completions", req);
  EXPECT_EQ(good.status, 200) << good.raw;
  EXPECT_GE(metric(metrics(c), "bitdelta_delta_cache_load_failures_total"), 1);
}

// A raw socket with `body` sent to /v1/completions on it.
int send_raw(int port, const std::string& body) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const std::string request =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  EXPECT_EQ(::send(fd, request.data(), request.size(), 0), ssize_t(request.size()));
  return fd;
}

// A streaming request: read until the first event arrives, hang up with a reset (SO_LINGER 0), so
// the server's next write fails at once.
void stream_and_hang_up(int port, const std::string& body) {
  const int fd = send_raw(port, body);
  std::string got;
  char buf[4096];
  while (got.find("data: ") == std::string::npos) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    got.append(buf, size_t(n));
  }
  EXPECT_NE(got.find("200"), std::string::npos) << got;
  const linger reset{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
  ::close(fd);
}

// A request that is not streamed: hang up `after` sending it (a plain close, as a client's
// timeout).
void send_and_hang_up(int port, const std::string& body, std::chrono::milliseconds after) {
  const int fd = send_raw(port, body);
  std::this_thread::sleep_for(after);
  ::close(fd);
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Up to five times: hang_up(attempt) sends a request of `tokens` tokens in all and hangs up, then
// the running batch and the queue must empty, and the log show the request either cancelled (its
// line has `cancelled`) or finished with all its tokens before the hang-up reached the server (a
// fast machine, a client descheduled: it tests nothing, so it is made again). True when one was
// cancelled.
bool cancelled_by_hang_up(test::ServerProcess& server, httplib::Client& c,
                          const std::string& cancelled, int tokens,
                          const std::function<void(int attempt)>& hang_up) {
  const std::string finished = "completion_tokens=" + std::to_string(tokens) + " ";
  for (int attempt = 0; attempt < 5; ++attempt) {
    const std::string before = server.log();
    const size_t cancelled_before = count_of(before, cancelled),
                 finished_before = count_of(before, finished);
    hang_up(attempt);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    double running = -1;
    std::string log;
    while (std::chrono::steady_clock::now() < deadline) {
      running = metric(metrics(c), "bitdelta_running_sequences");
      log = server.log();
      if (running == 0 && (count_of(log, cancelled) > cancelled_before ||
                           count_of(log, finished) > finished_before))
        break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_EQ(running, 0) << log;
    EXPECT_EQ(metric(metrics(c), "bitdelta_queue_length"), 0) << log;
    if (count_of(log, cancelled) > cancelled_before) return true;
    EXPECT_GT(count_of(log, finished), finished_before)
        << "the request neither finished nor was cancelled:\n"
        << log;
    if (count_of(log, finished) <= finished_before) return false;
  }
  ADD_FAILURE() << "five requests all finished before their client hung up:\n" << server.log();
  return false;
}

TEST_F(ServerTest, ClientDisconnectMidStreamFreesItsSlot) {
  auto server = start();
  auto c = server->client();
  // One sequence, then four (n = 4): hanging up must stop every one of them. (The tiny model
  // writes all 250 tokens in about 20 ms, so a client descheduled that long after the first event
  // hangs up on a stream that has already ended: cancelled_by_hang_up makes it again.)
  for (const int n : {1, 4}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const json body = {{"model", "coder"},
                       {"prompt", "the"},
                       {"max_tokens", 250},
                       {"temperature", 0},
                       {"ignore_eos", true},
                       {"stream", true},
                       {"n", n}};
    EXPECT_TRUE(
        cancelled_by_hang_up(*server, c, "cancelled: client disconnected", 250 * n,
                             [&](int) { stream_and_hang_up(server->port(), body.dump()); }));
  }
  EXPECT_EQ(post(c, "/v1/completions", json{{"model", "coder"}, {"prompt", "x"}, {"max_tokens", 2}})
                .status,
            200);
}

// A client that is not streaming hangs up (its timeout) while its sequences run: they stop, and
// the request is logged and counted as 499, not finished for nobody.
TEST_F(ServerTest, ClientDisconnectBeforeTheAnswerStopsItsSequences) {
  auto server = start();
  auto c = server->client();
  // 64 sequences of 250 tokens (32 took 0.13 s here): longer than the server waits before it
  // watches the socket (ClientWatch::kLookAfter); each attempt hangs up sooner.
  const int n = 64, tokens = 250;
  const json body = {{"model", "coder"}, {"prompt", "the"},    {"max_tokens", tokens},
                     {"temperature", 0}, {"ignore_eos", true}, {"n", n}};
  EXPECT_TRUE(cancelled_by_hang_up(*server, c, "status=499", n * tokens, [&](int attempt) {
    send_and_hang_up(server->port(), body.dump(),
                     server::ClientWatch::kLookAfter + std::chrono::milliseconds(20 >> attempt));
  }));
  EXPECT_NE(server->log().find("model=coder status=499"), std::string::npos)
      << server->log();
  EXPECT_NE(server->log().find("cancelled: client disconnected"), std::string::npos)
      << server->log();
  EXPECT_EQ(metric(metrics(c), "bitdelta_http_responses_total",
                   "route=\"/v1/completions\",status=\"499\""),
            double(1))
      << metrics(c);
  // A client that stays gets its answer as before.
  EXPECT_EQ(post(c, "/v1/completions", json{{"model", "coder"}, {"prompt", "x"}, {"max_tokens", 2}})
                .status,
            200);
}

TEST_F(ServerTest, ThousandMalformedRequestsLeaveItServing) {
  auto server = start();
  auto c = server->client();
  const std::vector<std::string> garbage = {
      "",
      "{",
      "}",
      "null",
      "[]",
      "\"str\"",
      "{\"prompt\":}",
      "{\"prompt\": 1e999}",
      "{\"prompt\": [1, 2, 3e40]}",
      "{\"prompt\": \"x\", \"max_tokens\": 18446744073709551616}",
      "{\"prompt\": \"x\", \"temperature\": NaN}",
      "{\"prompt\": \"x\", \"stop\": [[]]}",
      "{\"prompt\": {\"a\": 1}}",
      "{\"messages\": [{\"role\": null}]}",
      std::string("{\"prompt\": \"\xff\"}"),
      std::string(1, '\0'),
      "{\"prompt\": \"x\", \"logprobs\": -1}",
      "{\"prompt\": [[1, 2], [3, \"x\"]]}",
      "{\"prompt\": \"x\", \"top_k\": -7}",
      "{\"prompt\": \"x\", \"seed\": \"s\"}"};
  int failed = 0;
  for (int i = 0; i < 1000; ++i) {
    const std::string& body = garbage[size_t(i) % garbage.size()];
    const std::string path = i % 2 ? "/v1/completions" : "/v1/chat/completions";
    const auto r = post(c, path, body);
    if (r.status != 400) ++failed;
  }
  EXPECT_EQ(failed, 0);
  const auto ok = post(c, "/v1/completions", json{{"prompt", "the"}, {"max_tokens", 3}});
  EXPECT_EQ(ok.status, 200) << ok.raw;
  EXPECT_EQ(c.Get("/health")->status, 200);
}

TEST_F(ServerTest, LoadAndUnloadOnlyInsideVariantsDir) {
  const fs::path vdir = scratch / "vdir";
  fs::create_directories(vdir / "sub");
  fs::copy_file(family().delta("math"), vdir / "sub" / "extra.bitdelta");
  fs::copy_file(family().delta("math"), scratch / "outside.bitdelta");
  fs::create_symlink(scratch / "outside.bitdelta", vdir / "escape.bitdelta");
  auto server = start({"--variants-dir", vdir.string()});
  auto c = server->client();
  EXPECT_EQ(
      post(c, "/v1/variants/load", json{{"name", "x1"}, {"path", "../outside.bitdelta"}}).status,
      403);
  EXPECT_EQ(post(c, "/v1/variants/load",
                 json{{"name", "x2"}, {"path", (scratch / "outside.bitdelta").string()}})
                .status,
            403);
  EXPECT_EQ(post(c, "/v1/variants/load", json{{"name", "x3"}, {"path", "escape.bitdelta"}}).status,
            403);
  EXPECT_EQ(post(c, "/v1/variants/load", json{{"name", "x4"}, {"path", "missing.bitdelta"}}).status,
            400);
  EXPECT_EQ(
      post(c, "/v1/variants/load", json{{"name", "bad name!"}, {"path", "sub/extra.bitdelta"}})
          .status,
      400);
  const auto loaded =
      post(c, "/v1/variants/load", json{{"name", "extra"}, {"path", "sub/extra.bitdelta"}});
  ASSERT_EQ(loaded.status, 200) << loaded.raw;
  EXPECT_EQ(loaded.body["id"], "extra");
  EXPECT_EQ(loaded.body["state"], "resident");
  // A delta that cannot be loaded is refused at load time and not kept.
  {
    const std::string good = test::read_file(family().delta("math"));
    std::ofstream(vdir / "torn.bitdelta", std::ios::binary) << good.substr(0, good.size() / 3);
  }
  const auto torn = post(c, "/v1/variants/load", json{{"name", "torn"}, {"path", "torn.bitdelta"}});
  EXPECT_EQ(torn.status, 400) << torn.raw;
  EXPECT_NE(torn.raw.find("failed to load"), std::string::npos) << torn.raw;
  EXPECT_EQ(variant_state(c, "torn"), "");
  EXPECT_EQ(
      post(c, "/v1/variants/load", json{{"name", "extra"}, {"path", "sub/extra.bitdelta"}}).status,
      409);
  EXPECT_EQ(post(c, "/v1/completions", json{{"model", "extra"}, {"prompt", "x"}, {"max_tokens", 2}})
                .status,
            200);
  EXPECT_EQ(post(c, "/v1/variants/unload", json{{"name", "extra"}}).status, 200);
  EXPECT_EQ(post(c, "/v1/completions", json{{"model", "extra"}, {"prompt", "x"}, {"max_tokens", 2}})
                .status,
            404);
  EXPECT_EQ(post(c, "/v1/variants/unload", json{{"name", "extra"}}).status, 404);
  EXPECT_EQ(post(c, "/v1/variants/unload", json{{"name", "base"}}).status, 400);
}

TEST_F(ServerTest, ConfigFileWithFineTuneDirectoryAndPins) {
  const TinyFamily& f = family();
  const fs::path config = scratch / "serve.json";
  test::write_text(
      config, json{{"base", f.base.string()},
                   {"cache_dir", (scratch / "cache").string()},
                   {"max_running", 4},
                   {"cuda_graphs", false},  // (read; the CPU has no graphs)
                   {"allowed_origins", {"http://a.example", "http://b.example"}},
                   {"variants",
                    {{{"name", "coder"}, {"path", f.delta("coder").string()}, {"pinned", true}},
                     {{"name", "tuned"}, {"path", (f.dir / "finetunes" / "math").string()}}}}}
                  .dump());
  ServerProcess server({"--config", config.string()}, scratch / "config.log");
  EXPECT_TRUE(fs::exists(scratch / "cache" / "tuned.bitdelta")) << server.log();
  auto c = server.client();
  const auto listed = c.Get("/v1/models", {{"Origin", "http://b.example"}});
  ASSERT_TRUE(listed);
  EXPECT_EQ(listed->get_header_value("Access-Control-Allow-Origin"), "http://b.example");
  const json models = json::parse(listed->body);
  ASSERT_EQ(models["data"].size(), 3u);
  for (const auto& m : models["data"]) {
    if (m["id"] == "coder") {
      EXPECT_TRUE(m["pinned"].get<bool>());
    }
  }
  // The fine-tune compressed on start answers like its delta file.
  const json req = {
      {"prompt", "the sea"}, {"max_tokens", 6}, {"temperature", 0}, {"ignore_eos", true}};
  json a = req, b = req;
  a["model"] = "tuned";
  const auto tuned = post(c, "/v1/completions", a);
  ASSERT_EQ(tuned.status, 200) << tuned.raw;
  ServerProcess plain(family_args(f), scratch / "plain.log");
  auto pc = plain.client();
  b["model"] = "math";
  EXPECT_EQ(post(pc, "/v1/completions", b).body["choices"][0]["text"],
            tuned.body["choices"][0]["text"]);
}

TEST_F(ServerTest, UnknownChatTemplateFallsBackToPlainAndSaysSo) {
  const fs::path base = scratch / "base";
  fs::copy(family().base, base);
  test::write_text(
      base / "tokenizer_config.json",
      json{{"chat_template", "{% for m in messages %}<start_of_turn>{{ m.content }}{% endfor %}"}}
          .dump());
  ServerProcess server({base.string()}, scratch / "plain.log");
  EXPECT_NE(server.log().find("not a family we know"), std::string::npos) << server.log();
  auto c = server.client();
  const auto r =
      post(c, "/v1/chat/completions",
           json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}});
  ASSERT_EQ(r.status, 200) << r.raw;
  const Tokenizer tok(base);
  EXPECT_EQ(r.body["usage"]["prompt_tokens"], tok.encode("User: hi\n\nAssistant:", true).size());
}

TEST_F(ServerTest, PortInUseIsAnError) {
  auto server = start();
  const auto out =
      test::run_command("timeout 30 " + std::string(BITDELTA_CLI) + " serve " +
                            family().base.string() + " --port " + std::to_string(server->port()),
                        scratch.path());
  EXPECT_EQ(out.exit_code, 1) << out.err;
  EXPECT_NE(out.err.find("cannot listen on 127.0.0.1:" + std::to_string(server->port())),
            std::string::npos)
      << out.err;
}

TEST_F(ServerTest, SigtermShutsDownCleanly) {
  auto server = start();
  EXPECT_EQ(server->stop(), 0);
  EXPECT_NE(server->log().find("[serve] stopped"), std::string::npos) << server->log();
}

// The official `openai` npm package against the server (tests/node/openai_client.mjs). ctest's
// node_openai_install installs it first; without it (no npm registry) the test is skipped.
TEST_F(ServerTest, OfficialOpenAINodeClient) {
  const fs::path node_dir = kSourceDir / "tests/node";
  if (!fs::exists(node_dir / "node_modules/openai/package.json"))
    GTEST_SKIP() << "run: npm install --prefix tests/node";
  auto server = start({"--api-key", "node-key"});
  const auto out =
      test::run_command("node " + (node_dir / "openai_client.mjs").string() +
                            " http://127.0.0.1:" + std::to_string(server->port()) + "/v1 node-key",
                        scratch.path());
  EXPECT_EQ(out.exit_code, 0) << out.out << out.err << server->log();
  EXPECT_NE(out.out.find("openai client: all checks passed"), std::string::npos)
      << out.out << out.err;
}

}  // namespace
}  // namespace bitdelta
