// bitdelta bench serve [--url URL] [--endpoint completions|chat] [--rate R | --concurrency N]
//   [--num-requests N] [--variants NAME=WEIGHT,...] [--prompts-file FILE | --input-len WORDS]
//   [--output-len N] [--seed S] [--api-key KEY] [--json FILE]
// Load generator against a running `bitdelta serve` (in the manner of `vllm bench serve`): requests
// arrive as a Poisson process at --rate (or all at once), at most --concurrency in flight, each for
// a variant drawn from the weighted mix; every request streams, so time to first token (TTFT), time
// per output token (TPOT) and inter-token latency (ITL) are measured at the client.
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "bitdelta/error.h"
#include "commands.h"

namespace bitdelta::cli {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct BenchArgs {
  std::string url = "http://127.0.0.1:8080";
  std::string endpoint = "completions";
  double rate = 0;         // requests per second; 0 = all at once
  size_t concurrency = 0;  // 0 = unlimited
  size_t num_requests = 100;
  std::string variants = "base";
  std::string prompts_file;
  size_t input_len = 64, output_len = 64;
  uint64_t seed = 0;
  std::string api_key, json_out;
  bool ignore_eos = true;
};

struct Outcome {
  std::string variant;
  bool ok = false;
  std::string error;
  size_t prompt_tokens = 0, completion_tokens = 0;
  double ttft = 0, e2e = 0;
  std::vector<double> itl;
};

struct Summary {
  size_t completed = 0, failed = 0, prompt_tokens = 0, completion_tokens = 0;
  std::vector<double> ttft, tpot, itl, e2e;
};

std::vector<std::pair<std::string, double>> parse_mix(const std::string& text) {
  std::vector<std::pair<std::string, double>> mix;
  size_t at = 0;
  while (at < text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    const size_t eq = item.find('=');
    std::string name = item.substr(0, eq);
    double w = 1;
    if (eq != std::string::npos) {
      try {
        w = std::stod(item.substr(eq + 1));
      } catch (const std::exception&) {
        fail("--variants: weight of '", name, "' is not a number");
      }
    }
    if (name.empty() || !(w > 0))
      fail("--variants: '", item, "' must be NAME or NAME=WEIGHT with WEIGHT > 0");
    mix.emplace_back(name, w);
    at = comma + 1;
  }
  if (mix.empty()) fail("--variants: give at least one model name");
  return mix;
}

std::vector<std::string> load_prompts(const BenchArgs& a, std::mt19937_64& rng) {
  std::vector<std::string> prompts;
  if (!a.prompts_file.empty()) {
    std::ifstream in(a.prompts_file);
    if (!in) fail("--prompts-file: cannot read ", a.prompts_file);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      // JSON lines ({"prompt": ...} or a JSON string) or plain text lines.
      if (line[0] == '{' || line[0] == '"') {
        try {
          const json j = json::parse(line);
          if (j.is_string())
            prompts.push_back(j.get<std::string>());
          else if (j.is_object() && j.contains("prompt") && j["prompt"].is_string())
            prompts.push_back(j["prompt"]);
          else if (j.is_object() && j.contains("text") && j["text"].is_string())
            prompts.push_back(j["text"]);
          continue;
        } catch (const json::exception&) {
        }
      }
      prompts.push_back(line);
    }
    if (prompts.empty()) fail("--prompts-file: ", a.prompts_file, " has no prompts");
    return prompts;
  }
  // Random prompts: words drawn from a fixed list, so every run with the same seed sends the same.
  static const char* kWords[] = {
      "the",     "of",       "and",     "to",     "in",     "is",   "that",   "for",
      "it",      "as",       "with",    "was",    "on",     "file", "be",     "by",
      "this",    "are",      "from",    "or",     "which",  "an",   "at",     "not",
      "can",     "function", "value",   "return", "number", "page", "system", "license",
      "section", "under",    "program", "time",   "line",   "data", "set",    "user",
      "option",  "output",   "input",   "error",  "list",   "name", "type",   "word"};
  std::uniform_int_distribution<size_t> pick(0, std::size(kWords) - 1);
  for (size_t i = 0; i < std::max<size_t>(a.num_requests, 1); ++i) {
    std::string p;
    for (size_t w = 0; w < a.input_len; ++w) {
      if (w) p += ' ';
      p += kWords[pick(rng)];
    }
    prompts.push_back(std::move(p));
  }
  return prompts;
}

Outcome run_one(const BenchArgs& a, const std::string& variant, const std::string& prompt) {
  Outcome o;
  o.variant = variant;
  json body = {{"model", variant},
               {"max_tokens", a.output_len},
               {"temperature", 0},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}},
               {"ignore_eos", a.ignore_eos}};
  const bool chat = a.endpoint == "chat";
  if (chat)
    body["messages"] = json::array({{{"role", "user"}, {"content", prompt}}});
  else
    body["prompt"] = prompt;

  httplib::Client client(a.url);
  client.set_read_timeout(600);
  client.set_connection_timeout(10);
  httplib::Request req;
  req.method = "POST";
  req.path = chat ? "/v1/chat/completions" : "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  if (!a.api_key.empty()) req.set_header("Authorization", "Bearer " + a.api_key);

  const auto start = Clock::now();
  auto last = start;
  bool first = true, done = false;
  std::string buffer, error_body;
  int status = 0;
  req.response_handler = [&](const httplib::Response& r) {
    status = r.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (status != 200) {
      error_body.append(data, n);
      return true;
    }
    buffer.append(data, n);
    size_t end;
    while ((end = buffer.find("\n\n")) != std::string::npos) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0) continue;
      const std::string payload = event.substr(6);
      if (payload == "[DONE]") {
        done = true;
        continue;
      }
      const json j = json::parse(payload, nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("error")) {
        o.error = j["error"].value("message", "error");
        continue;
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        o.prompt_tokens = j["usage"].value("prompt_tokens", size_t(0));
        o.completion_tokens = j["usage"].value("completion_tokens", size_t(0));
      }
      if (!j.contains("choices") || j["choices"].empty()) continue;
      const auto& c = j["choices"][0];
      std::string text;
      if (chat && c.contains("delta") && c["delta"].contains("content") &&
          c["delta"]["content"].is_string())
        text = c["delta"]["content"];
      if (!chat && c.contains("text") && c["text"].is_string()) text = c["text"];
      if (text.empty()) continue;
      const auto now = Clock::now();
      if (first) {
        o.ttft = std::chrono::duration<double>(now - start).count();
        first = false;
      } else {
        o.itl.push_back(std::chrono::duration<double>(now - last).count());
      }
      last = now;
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool sent = client.send(req, res, err);
  o.e2e = std::chrono::duration<double>(Clock::now() - start).count();
  if (!sent)
    o.error = "connection failed: " + httplib::to_string(err);
  else if (status != 200)
    o.error = "HTTP " + std::to_string(status) + ": " + error_body.substr(0, 200);
  else if (!done && o.error.empty())
    o.error = "stream ended without [DONE]";
  o.ok = o.error.empty();
  return o;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = p / 100 * double(v.size() - 1);
  const size_t lo = size_t(pos);
  const double frac = pos - double(lo);
  return lo + 1 < v.size() ? v[lo] * (1 - frac) + v[lo + 1] * frac : v[lo];
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / double(v.size());
}

json stats_json(const std::vector<double>& v) {
  return {{"mean_ms", mean(v) * 1e3},
          {"p50_ms", percentile(v, 50) * 1e3},
          {"p99_ms", percentile(v, 99) * 1e3}};
}

json summary_json(const Summary& s, double duration) {
  return {{"completed", s.completed},
          {"failed", s.failed},
          {"prompt_tokens", s.prompt_tokens},
          {"completion_tokens", s.completion_tokens},
          {"request_throughput", double(s.completed) / duration},
          {"output_token_throughput", double(s.completion_tokens) / duration},
          {"total_token_throughput", double(s.prompt_tokens + s.completion_tokens) / duration},
          {"ttft", stats_json(s.ttft)},
          {"tpot", stats_json(s.tpot)},
          {"itl", stats_json(s.itl)},
          {"e2e", stats_json(s.e2e)}};
}

void print_summary(const std::string& title, const Summary& s, double duration) {
  std::printf("---- %s ----\n", title.c_str());
  std::printf("  requests: %zu ok, %zu failed;  %.2f req/s\n", s.completed, s.failed,
              double(s.completed) / duration);
  std::printf("  tokens:   %zu prompt, %zu generated;  %.1f output tok/s, %.1f total tok/s\n",
              s.prompt_tokens, s.completion_tokens, double(s.completion_tokens) / duration,
              double(s.prompt_tokens + s.completion_tokens) / duration);
  const auto line = [](const char* name, const std::vector<double>& v) {
    std::printf("  %-5s mean %9.2f ms   p50 %9.2f ms   p99 %9.2f ms\n", name, mean(v) * 1e3,
                percentile(v, 50) * 1e3, percentile(v, 99) * 1e3);
  };
  line("TTFT", s.ttft);
  line("TPOT", s.tpot);
  line("ITL", s.itl);
  line("E2E", s.e2e);
}

void add(Summary& s, const Outcome& o) {
  if (!o.ok) {
    ++s.failed;
    return;
  }
  ++s.completed;
  s.prompt_tokens += o.prompt_tokens;
  s.completion_tokens += o.completion_tokens;
  s.ttft.push_back(o.ttft);
  s.e2e.push_back(o.e2e);
  if (o.completion_tokens > 1) s.tpot.push_back((o.e2e - o.ttft) / double(o.completion_tokens - 1));
  s.itl.insert(s.itl.end(), o.itl.begin(), o.itl.end());
}

void run_bench(const BenchArgs& a) {
  if (a.endpoint != "completions" && a.endpoint != "chat")
    fail("--endpoint must be completions or chat");
  if (a.num_requests == 0) fail("--num-requests must be >= 1");
  if (a.rate < 0) fail("--rate must be >= 0");
  if (a.output_len == 0) fail("--output-len must be >= 1 (it is each request's max_tokens)");
  const auto mix = parse_mix(a.variants);
  std::mt19937_64 rng(a.seed);
  const auto prompts = load_prompts(a, rng);

  {
    httplib::Client probe(a.url);
    probe.set_connection_timeout(5);
    auto r = probe.Get("/health");
    if (!r || r->status != 200) fail("--url: no bitdelta server answers ", a.url, "/health");
  }

  // The plan, fixed by the seed: which variant and prompt each request uses, and when it arrives.
  std::vector<double> weights;
  for (const auto& [name, w] : mix) weights.push_back(w);
  std::discrete_distribution<size_t> pick_variant(weights.begin(), weights.end());
  std::exponential_distribution<double> gap(a.rate > 0 ? a.rate : 1.0);
  struct Planned {
    std::string variant;
    const std::string* prompt;
    double at;
  };
  std::vector<Planned> plan;
  double t = 0;
  for (size_t i = 0; i < a.num_requests; ++i) {
    plan.push_back({mix[pick_variant(rng)].first, &prompts[i % prompts.size()], t});
    if (a.rate > 0) t += gap(rng);
  }

  const size_t workers = a.concurrency ? std::min(a.concurrency, a.num_requests)
                                       : std::min<size_t>(a.num_requests, 1024);
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<size_t> ready;
  bool all_sent = false;
  std::vector<Outcome> outcomes(plan.size());
  std::atomic<size_t> finished{0};

  char arrivals[64] = "all at once";
  if (a.rate > 0)
    std::snprintf(arrivals, sizeof arrivals, "Poisson arrivals at %.2f req/s", a.rate);
  std::printf(
      "bench serve: %zu requests to %s (%s), %s, concurrency %s, mix %s, %zu-word prompts, %zu "
      "tokens out\n",
      a.num_requests, a.url.c_str(), a.endpoint.c_str(), arrivals,
      a.concurrency ? std::to_string(a.concurrency).c_str() : "unlimited", a.variants.c_str(),
      a.prompts_file.empty() ? a.input_len : 0, a.output_len);
  const auto start = Clock::now();
  std::vector<std::thread> pool;
  for (size_t w = 0; w < workers; ++w)
    pool.emplace_back([&] {
      while (true) {
        size_t i;
        {
          std::unique_lock lock(mutex);
          cv.wait(lock, [&] { return !ready.empty() || all_sent; });
          if (ready.empty()) return;
          i = ready.front();
          ready.pop_front();
        }
        outcomes[i] = run_one(a, plan[i].variant, *plan[i].prompt);
        const size_t n = ++finished;
        if (n % std::max<size_t>(1, a.num_requests / 10) == 0)
          std::fprintf(stderr, "  %zu/%zu done\n", n, a.num_requests);
      }
    });
  for (size_t i = 0; i < plan.size(); ++i) {
    std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(plan[i].at)));
    {
      std::lock_guard lock(mutex);
      ready.push_back(i);
    }
    cv.notify_one();
  }
  {
    std::lock_guard lock(mutex);
    all_sent = true;
  }
  cv.notify_all();
  for (auto& th : pool) th.join();
  const double duration = std::chrono::duration<double>(Clock::now() - start).count();

  Summary overall;
  std::map<std::string, Summary> per;
  std::map<std::string, std::string> first_error;
  for (const auto& o : outcomes) {
    add(overall, o);
    add(per[o.variant], o);
    if (!o.ok && !first_error.count(o.variant)) first_error[o.variant] = o.error;
  }
  std::printf("duration %.2f s\n", duration);
  for (const auto& [name, s] : per) print_summary("variant " + name, s, duration);
  print_summary("overall", overall, duration);
  for (const auto& [name, e] : first_error)
    std::printf("first error for %s: %s\n", name.c_str(), e.c_str());

  if (!a.json_out.empty()) {
    json j = {{"url", a.url},
              {"endpoint", a.endpoint},
              {"rate", a.rate},
              {"concurrency", a.concurrency},
              {"num_requests", a.num_requests},
              {"variants", a.variants},
              {"input_len", a.input_len},
              {"output_len", a.output_len},
              {"prompts_file", a.prompts_file},
              {"seed", a.seed},
              {"duration_s", duration},
              {"overall", summary_json(overall, duration)}};
    for (const auto& [name, s] : per) j["per_variant"][name] = summary_json(s, duration);
    std::ofstream out(a.json_out);
    if (!out) fail("--json: cannot write ", a.json_out);
    out << j.dump(2) << "\n";
  }
  if (overall.completed == 0) fail("every request failed");
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Benchmarks against a running server");
  bench->require_subcommand(1);
  auto a = std::make_shared<BenchArgs>();
  auto* cmd = bench->add_subcommand(
      "serve", "Load-test a running `bitdelta serve`: throughput, TTFT, TPOT, ITL");
  cmd->add_option("--url", a->url, "Server base URL")->capture_default_str();
  cmd->add_option("--endpoint", a->endpoint, "completions or chat")->capture_default_str();
  cmd->add_option("--rate", a->rate, "Poisson arrival rate in requests/s (0: all at once)")
      ->capture_default_str();
  cmd->add_option("--concurrency", a->concurrency, "Most requests in flight (0: unlimited)")
      ->capture_default_str();
  cmd->add_option("--num-requests", a->num_requests, "Requests to send")->capture_default_str();
  cmd->add_option("--variants", a->variants, "Model mix, e.g. base=1,coder=2,math=1")
      ->capture_default_str();
  cmd->add_option("--prompts-file", a->prompts_file,
                  "One prompt per line (text or JSON {\"prompt\"})");
  cmd->add_option("--input-len", a->input_len, "Words per random prompt")->capture_default_str();
  cmd->add_option("--output-len", a->output_len, "max_tokens per request")->capture_default_str();
  cmd->add_option("--seed", a->seed, "Seed of the plan (variants, prompts, arrivals)")
      ->capture_default_str();
  cmd->add_option("--api-key", a->api_key, "Sent as Authorization: Bearer KEY");
  cmd->add_flag("!--stop-at-eos", a->ignore_eos,
                "Let requests end at EOS (default: generate --output-len tokens)");
  cmd->add_option("--json", a->json_out, "Also write the results as JSON to this file");
  cmd->callback([a] { run_bench(*a); });
}

}  // namespace bitdelta::cli
