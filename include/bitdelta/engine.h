// The serving engine: one base model in memory, a cache of variant deltas under a byte budget, and a
// scheduler thread that runs continuous batching: requests join and leave between steps, prompts
// are prefilled in chunks so running decodes keep their pace, and rows of different variants share
// every step. The HTTP server (src/server) sits on this interface; so do the CLI and benchmarks.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bitdelta/model.h"
#include "bitdelta/sampler.h"
#include "bitdelta/tokenizer.h"

namespace bitdelta {

struct EngineOptions {
  std::string base_name = "base";    // the name clients use for the base model
  size_t threads = 0;                // compute threads (0: all cores)
  size_t max_batch_tokens = 512;     // rows per forward step (decode rows + prefill chunk rows)
  size_t max_running = 32;           // sequences decoding at once
  size_t max_queue = 256;            // requests waiting to start; more are refused (QueueFull)
  uint64_t delta_cache_bytes = 0;    // resident delta bytes; 0 = unlimited
  std::vector<std::string> pinned;   // never evicted
  size_t protect_top = 0;            // the top-N variants by request rate are never evicted
  double rate_half_life_s = 60;      // decay of the request-rate estimate
  std::string device = "cpu";        // cpu | cuda | cuda:N (delta_cache_bytes is then GPU memory)
  uint64_t host_cache_bytes = uint64_t(16) << 30;  // cuda: pinned host copies of evicted deltas
  bool cuda_graphs = true;  // cuda: decode steps replayed as CUDA graphs (ModelOptions::cuda_graphs)
  // Caches of finished sequences kept for prompts that begin with their tokens (CPU memory, or GPU
  // memory with cuda); 0 = none kept.
  uint64_t prefix_cache_bytes = uint64_t(1) << 30;
};

// Why a submit() was refused before it started.
struct EngineError : std::runtime_error {
  enum class Kind { UnknownModel, QueueFull, BadRequest, Unavailable };
  Kind kind;
  EngineError(Kind k, const std::string& msg) : std::runtime_error(msg), kind(k) {}
};

struct GenerationRequest {
  std::string model;              // variant name, or EngineOptions::base_name
  std::vector<int32_t> prompt;    // token ids, BOS included if wanted; non-empty
  SamplingParams sampling;
  StopConditions stop;            // stop strings, extra stop ids, max_tokens
  bool stop_at_eos = true;        // also stop at the tokenizer's EOS ids
  bool prompt_logprobs = false;   // report log p of each prompt token (for echo + logprobs)
  size_t top_logprobs = 0;        // alternatives reported per generated token (0..20)
};

struct TokenLogprob {
  int32_t token;
  float logprob;
  std::vector<std::pair<int32_t, float>> top;  // most likely first, top_logprobs entries
};

struct Usage {
  size_t prompt_tokens = 0, completion_tokens = 0;
  double queue_s = 0, ttft_s = 0, total_s = 0;  // wait before the first step, to the first token, to the end
};

// Callbacks run on the engine's thread: keep them short (copy, enqueue, return).
struct GenerationCallbacks {
  // Once, before any token, if prompt_logprobs was asked: log p of tokens 1..n-1 of the prompt.
  std::function<void(const std::vector<float>&)> on_prompt_logprobs;
  // Each generated token, with the text that became final with it (may be empty; never a split
  // UTF-8 character, never part of a stop string). At the end, text held back until then comes
  // with token −1 (no token).
  std::function<void(const TokenLogprob&, const std::string& text)> on_token;
  // Exactly once at the end, unless on_error is called instead.
  std::function<void(FinishReason, const Usage&)> on_done;
  // Exactly once if the request fails after submit (its variant failed to load, ...): message
  // names what went wrong; http_status is the status an HTTP server should answer with.
  std::function<void(const std::string& message, int http_status)> on_error;
};

// A submitted request: cancel() stops it at the next step and frees its KV cache; no callback
// runs after cancel() returns.
class RequestHandle {
 public:
  virtual ~RequestHandle() = default;
  virtual void cancel() = 0;
  virtual bool finished() const = 0;
};

struct VariantStatus {
  std::string name;
  std::string path;          // delta file ("" for the base)
  std::string state;         // base | resident | loading | cold | failed
  std::string last_error;    // why the last load failed
  uint64_t bytes = 0;        // delta bytes when resident
  bool pinned = false;
  double request_rate = 0;   // decayed requests per second
  uint64_t requests = 0;
};

// Counters and histograms for /metrics, all since start.
struct EngineMetrics {
  struct PerVariant {
    std::string name;
    uint64_t requests = 0, prompt_tokens = 0, completion_tokens = 0, errors = 0;
    std::vector<double> ttft_s, itl_s, e2e_s;  // samples (the server buckets them)
  };
  std::vector<PerVariant> variants;
  size_t queue_length = 0, running = 0;
  uint64_t steps = 0, mixed_steps = 0;  // steps, and steps whose rows came from 2+ variants
  // Prompt tokens run through the model, and those a sequence took from another's prefill of the
  // same prompt (n choices, identical requests admitted together).
  uint64_t prompt_tokens_run = 0, prompt_tokens_shared = 0;
  uint64_t prompt_tokens_cached = 0;  // prompt tokens a sequence started with, from a kept cache
  uint64_t prefix_cache_bytes = 0, prefix_cache_entries = 0;  // kept now
  uint64_t max_variants_in_step = 0;
  uint64_t cache_hits = 0, cache_misses = 0, cache_loads = 0, cache_load_failures = 0, cache_evictions = 0;
  uint64_t cache_host_hits = 0;  // device loads served from the pinned host tier (no file read)
  double cache_load_seconds = 0;
  uint64_t cache_resident_bytes = 0, cache_budget_bytes = 0;
};

class Engine {
 public:
  // Loads the base (and its tokenizer) and starts the scheduler thread.
  Engine(const std::filesystem::path& base_dir, EngineOptions options);
  ~Engine();  // stops the thread; pending requests get on_error
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const Tokenizer& tokenizer() const;
  const ModelConfig& config() const;
  const std::filesystem::path& base_dir() const;
  const EngineOptions& options() const;

  // Registers a variant by name and delta path; it loads on first use (or now, if `load_now`).
  // Throws Error if the name is taken or the file does not exist.
  void add_variant(const std::string& name, const std::filesystem::path& delta_path, bool load_now = false);
  // Forgets a variant: refused (Error) while requests for it are running or waiting.
  void remove_variant(const std::string& name);
  std::vector<VariantStatus> variants() const;  // the base first

  // Throws EngineError (UnknownModel, QueueFull, BadRequest) before anything starts.
  std::shared_ptr<RequestHandle> submit(GenerationRequest request, GenerationCallbacks callbacks);
  // Several requests at once, all or none (one error refuses them all): they reach the scheduler
  // together, so those of one prompt share its prefill (n choices of a request).
  std::vector<std::shared_ptr<RequestHandle>> submit_all(
      std::vector<GenerationRequest> requests, std::vector<GenerationCallbacks> callbacks);

  EngineMetrics metrics() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bitdelta
