#include "bitdelta/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <future>
#include <list>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>

#include "bitdelta/error.h"

namespace bitdelta {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

constexpr size_t kMaxSamples = 100000;  // latency samples kept per variant and kind
// A prompt starts from a kept cache when at least this many of its tokens match it (fewer are
// cheaper to run than to copy a whole cache for).
constexpr size_t kMinPrefix = 16;

void push_sample(std::vector<double>& v, double x) {
  if (v.size() >= kMaxSamples) v.erase(v.begin(), v.begin() + long(kMaxSamples / 10));
  v.push_back(x);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// A request's life: queued (waiting for its variant or for a running slot) -> prefill (its
// prompt fed in chunks) -> decode (one row per step) -> done. Callbacks go through deliver(), which
// holds the request's callback mutex, so after cancel() returns none runs.

struct Request : RequestHandle, std::enable_shared_from_this<Request> {
  GenerationRequest req;
  GenerationCallbacks cb;
  std::string variant;  // resolved name
  Clock::time_point submitted, first_step, first_token, last_token;
  bool got_token = false;

  std::unique_ptr<Sequence> seq;
  int model_id = -1;
  size_t prefilled = 0;  // prompt tokens fed
  // A running request of the same model and prompt whose prefill this one takes: it waits, then
  // starts from a copy of that sequence (Model::fork_sequence) and samples its own first token
  // from the same logits. n choices of one prompt prefill it once.
  std::shared_ptr<Request> leader;
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<StopChecker> checker;
  std::unique_ptr<StreamDecoder> decoder;
  std::vector<int32_t> history;
  std::vector<float> prompt_lp;
  int32_t next_input = -1;  // the token to feed at the next decode step
  size_t generated = 0;

  mutable std::mutex cb_mutex;
  bool cancelled = false;
  std::atomic<bool> done{false};
  std::function<void()> wake;  // tells the engine a cancel happened

  void cancel() override {
    {
      std::lock_guard lock(cb_mutex);
      cancelled = true;
    }
    if (wake) wake();
  }
  bool finished() const override { return done.load(); }

  template <typename F>
  void deliver(F&& f) {
    std::lock_guard lock(cb_mutex);
    if (!cancelled) f();
  }
  bool is_cancelled() const {
    std::lock_guard lock(cb_mutex);
    return cancelled;
  }
};

struct VariantEntry {
  std::string name;
  fs::path path;
  std::string state = "cold";  // resident | loading | cold | failed
  std::string last_error;
  int model_id = -1;
  uint64_t bytes = 0;
  bool pinned = false;
  double rate = 0;  // decayed requests per second, as of rate_time
  Clock::time_point rate_time = Clock::now(), last_used = Clock::now();
  uint64_t requests = 0;
  size_t active = 0;  // requests queued, waiting or running for it
  std::future<std::unique_ptr<PreparedVariant>> load;
  Clock::time_point load_start;
  std::deque<std::shared_ptr<Request>> waiting_load;  // single flight: they all wait on `load`
  bool load_requested = false;                        // load without a request (serve --variant at start)
};

struct Engine::Impl {
  EngineOptions opt;
  fs::path base_dir;
  Model model;
  Tokenizer tokenizer;

  mutable std::mutex mutex;  // guards everything below (not the model: the engine thread owns it)
  std::condition_variable cv;
  bool stopping = false;
  bool load_finished = false;  // a loader thread is done: the engine thread should install it
  std::map<std::string, VariantEntry> variants;
  std::vector<int> removed_model_ids;             // variants removed by the API, to drop from the model
  std::deque<std::shared_ptr<Request>> incoming;  // submitted, not yet seen by the engine thread
  std::deque<std::shared_ptr<Request>> queued;    // variant resident, waiting for a running slot
  std::vector<std::shared_ptr<Request>> running;  // owned by the engine thread
  EngineMetrics m;

  // The caches of finished sequences, kept under EngineOptions::prefix_cache_bytes (least recently
  // used first out): a prompt that begins with the tokens of one (a conversation's next turn, a
  // shared system message) starts from a copy of its first positions.
  struct KeptCache {
    int model_id;
    std::vector<int32_t> tokens;  // what its positions hold
    std::unique_ptr<Sequence> seq;
    uint64_t bytes = 0, last_use = 0;
  };
  std::list<KeptCache> kept;
  uint64_t kept_bytes = 0, use_clock = 0;
  std::map<std::string, EngineMetrics::PerVariant> per_variant;

  std::thread thread;
  struct Loader {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done = std::make_shared<std::atomic<bool>>(false);
  };
  std::vector<Loader> loaders;  // engine thread only: started in start_load, joined once done

  Impl(const fs::path& dir, EngineOptions o)
      : opt(std::move(o)), base_dir(dir), model(dir, model_options(opt.device, opt.threads, opt.host_cache_bytes, opt.cuda_graphs)), tokenizer(dir) {
    if (opt.max_batch_tokens < 1 || opt.max_running < 1) fail("max_batch_tokens and max_running must be at least 1");
    m.cache_budget_bytes = opt.delta_cache_bytes;
    per_variant[opt.base_name].name = opt.base_name;
  }

  // --- rate and eviction policy ---------------------------------------------------------------

  double decayed_rate(const VariantEntry& v, Clock::time_point now) const {
    const double lambda = std::log(2.0) / opt.rate_half_life_s;
    return v.rate * std::exp(-lambda * seconds(now - v.rate_time));
  }
  void note_request(VariantEntry& v, Clock::time_point now) {
    const double lambda = std::log(2.0) / opt.rate_half_life_s;
    v.rate = decayed_rate(v, now) + lambda;  // steady state: requests per second
    v.rate_time = now;
    v.last_used = now;
    ++v.requests;
  }
  // LRU weighted by request rate: the decayed rate plus a recency term; the lowest goes first.
  double score(const VariantEntry& v, Clock::time_point now) const {
    return decayed_rate(v, now) + 1.0 / (1.0 + seconds(now - v.last_used));
  }
  // The names of the top-N variants by decayed request rate (never evicted).
  std::vector<std::string> top_by_rate(Clock::time_point now) const {
    std::vector<std::pair<double, std::string>> by_rate;
    for (const auto& [name, e] : variants) by_rate.emplace_back(decayed_rate(e, now), name);
    std::sort(by_rate.rbegin(), by_rate.rend());
    std::vector<std::string> top;
    for (size_t i = 0; i < std::min(opt.protect_top, by_rate.size()); ++i) top.push_back(by_rate[i].second);
    return top;
  }
  uint64_t resident_bytes() const {
    uint64_t total = 0;
    for (const auto& [_, v] : variants)
      if (v.state == "resident" || v.state == "loading") total += v.bytes;
    return total;
  }
  // Frees room for `need` bytes by evicting; returns false if it cannot (without evicting).
  bool make_room(uint64_t need, const std::string& for_name) {
    if (opt.delta_cache_bytes == 0) return true;
    const auto now = Clock::now();
    const auto top = top_by_rate(now);
    std::vector<std::pair<double, VariantEntry*>> candidates;
    for (auto& [name, v] : variants)
      if (v.state == "resident" && name != for_name && !v.pinned && v.active == 0 &&
          std::find(top.begin(), top.end(), name) == top.end())
        candidates.emplace_back(score(v, now), &v);
    std::sort(candidates.begin(), candidates.end(), [](auto& a, auto& b) { return a.first < b.first; });
    uint64_t resident = resident_bytes(), freeable = 0;
    for (auto& c : candidates) freeable += c.second->bytes;
    if (resident + need > opt.delta_cache_bytes + freeable) return false;
    for (auto& [s, v] : candidates) {
      if (resident + need <= opt.delta_cache_bytes) break;
      drop_kept(v->model_id);
      model.remove_variant(v->model_id);
      v->model_id = -1;
      v->state = "cold";
      resident -= v->bytes;
      ++m.cache_evictions;
    }
    return true;
  }

  // --- loading ------------------------------------------------------------------------------

  void start_load(VariantEntry& v) {
    v.bytes = fs::exists(v.path) ? fs::file_size(v.path) : 0;
    v.state = "loading";
    v.load_start = Clock::now();
    ++m.cache_loads;
    const fs::path path = v.path;
    std::promise<std::unique_ptr<PreparedVariant>> promise;
    v.load = promise.get_future();
    auto& loader = loaders.emplace_back();
    loader.thread = std::thread([this, path, name = v.name, done = loader.done,
                                 promise = std::move(promise)]() mutable {
      try {
        // Ask for the whole file in one sequential pass first: validating it through its mapping
        // would fault a cold file's pages in scattered order (free when the file is cached).
        if (fs::exists(path)) prefetch_file(path);
        auto delta = std::make_shared<const DeltaFile>(path);
        // On the CPU, bring every page into memory now, so the first step that uses it does not
        // stall; on a device, prepare_variant uploads it (through the pinned host tier) instead.
        if (model.device() == Device::Cpu) {
          volatile uint8_t sink = 0;
          for (const auto& t : delta->file().tensors()) {
            const auto d = delta->file().view(t).data;
            for (size_t i = 0; i < d.size(); i += 4096) sink = sink + uint8_t(d[i]);
          }
        }
        // Fingerprint and tensors checked, weights resolved (and uploaded) off the engine thread.
        promise.set_value(model.prepare_variant(name, std::move(delta)));
      } catch (...) {
        promise.set_exception(std::current_exception());
      }
      // The result is ready: wake the engine thread to install it (or report the failure).
      {
        std::lock_guard lock(mutex);
        load_finished = true;
        cv.notify_all();
      }
      *done = true;
    });
  }

  // Called on the engine thread with the mutex held: installs finished loads, fails broken ones.
  void finish_loads(std::vector<std::function<void()>>& after) {
    for (auto& [name, v] : variants) {
      if (v.state != "loading" || !v.load.valid()) continue;
      if (v.load.wait_for(std::chrono::seconds(0)) != std::future_status::ready) continue;
      m.cache_load_seconds += seconds(Clock::now() - v.load_start);
      try {
        auto prepared = v.load.get();
        if (prepared->upload.host_hit) ++m.cache_host_hits;
        v.model_id = model.install_variant(std::move(prepared));
        v.state = "resident";
        v.last_error.clear();
        for (auto& r : v.waiting_load) {
          r->model_id = v.model_id;
          queued.push_back(r);
        }
      } catch (const std::exception& e) {
        v.state = "failed";
        v.last_error = e.what();
        ++m.cache_load_failures;
        const std::string msg = std::string("variant '") + name + "' failed to load: " + e.what();
        for (auto& r : v.waiting_load) {
          --v.active;
          ++per_variant[name].errors;
          after.push_back([r, msg] {
            r->deliver([&] {
              if (r->cb.on_error) r->cb.on_error(msg, 500);
            });
            r->done = true;
          });
        }
      }
      v.waiting_load.clear();
    }
  }

  // A new request on the engine thread: straight to the queue if its variant is resident, else it
  // waits on the variant's one load (started by the first such request).
  void route(const std::shared_ptr<Request>& r, std::vector<std::function<void()>>& after) {
    if (r->variant == opt.base_name) {
      r->model_id = 0;
      queued.push_back(r);
      return;
    }
    auto it = variants.find(r->variant);
    if (it == variants.end()) {  // removed meanwhile
      after.push_back([r] {
        r->deliver([&] {
          if (r->cb.on_error) r->cb.on_error("model '" + r->variant + "' does not exist", 404);
        });
        r->done = true;
      });
      return;
    }
    auto& v = it->second;
    if (v.state == "resident") {
      ++m.cache_hits;
      r->model_id = v.model_id;
      queued.push_back(r);
      return;
    }
    ++m.cache_misses;
    v.waiting_load.push_back(r);
    if (v.state != "loading") {
      if (opt.delta_cache_bytes && fs::exists(v.path) && fs::file_size(v.path) > opt.delta_cache_bytes) {
        const std::string msg = str("variant '", v.name, "' (", fs::file_size(v.path),
                                    " bytes) does not fit in the delta cache budget (", opt.delta_cache_bytes, " bytes)");
        for (auto& w : v.waiting_load) {
          --v.active;
          after.push_back([w, msg] {
            w->deliver([&] {
              if (w->cb.on_error) w->cb.on_error(msg, 503);
            });
            w->done = true;
          });
        }
        v.waiting_load.clear();
        return;
      }
      if (make_room(fs::exists(v.path) ? fs::file_size(v.path) : 0, v.name)) start_load(v);
      // else: it waits; each loop retries make_room as running requests finish.
    }
  }

  // Loads that wait for room (or were asked for without a request) start as soon as they fit.
  void retry_blocked_loads() {
    for (auto& [name, v] : variants)
      if (v.state != "loading" && v.state != "resident" && (!v.waiting_load.empty() || v.load_requested) &&
          make_room(fs::exists(v.path) ? fs::file_size(v.path) : 0, name)) {
        v.load_requested = false;
        start_load(v);
      }
  }

  // --- the step -----------------------------------------------------------------------------

  void finish_request(Request& r, FinishReason reason, std::vector<std::function<void()>>& after) {
    const auto now = Clock::now();
    Usage u;
    u.prompt_tokens = r.req.prompt.size();
    u.completion_tokens = r.generated;
    u.queue_s = seconds(r.first_step - r.submitted);
    u.ttft_s = r.got_token ? seconds(r.first_token - r.submitted) : 0;
    u.total_s = seconds(now - r.submitted);
    auto& pv = per_variant[r.variant];
    pv.prompt_tokens += u.prompt_tokens;
    pv.completion_tokens += u.completion_tokens;
    push_sample(pv.e2e_s, u.total_s);
    if (auto it = variants.find(r.variant); it != variants.end()) --it->second.active;
    keep_cache(r);  // or frees it now
    auto self = r.shared_from_this();
    after.push_back([self, reason, u] {
      self->deliver([&] {
        if (self->cb.on_done) self->cb.on_done(reason, u);
      });
      self->done = true;
    });
  }

  void emit_token(Request& r, const float* logits, std::vector<std::function<void()>>& after) {
    const size_t V = model.config().vocab_size;
    std::span<const float> l(logits, V);
    // Checkpoints often pad the embedding past the tokenizer's vocabulary: those ids can never be
    // decoded, so they are never chosen.
    thread_local std::vector<float> masked;
    if (tokenizer.vocab_size() < V) {
      masked.assign(logits, logits + V);
      std::fill(masked.begin() + long(tokenizer.vocab_size()), masked.end(), -INFINITY);
      l = masked;
    }
    const int32_t token = r.sampler->sample(l, r.history, r.generated);
    const auto lp = log_softmax(l);
    TokenLogprob t{token, lp[size_t(token)], {}};
    if (r.req.top_logprobs > 0) {
      std::vector<int32_t> ids(V);
      std::iota(ids.begin(), ids.end(), 0);
      const size_t k = std::min(r.req.top_logprobs, V);
      std::partial_sort(ids.begin(), ids.begin() + long(k), ids.end(),
                        [&](int32_t a, int32_t b) { return lp[size_t(a)] > lp[size_t(b)] || (lp[size_t(a)] == lp[size_t(b)] && a < b); });
      for (size_t i = 0; i < k; ++i) t.top.emplace_back(ids[i], lp[size_t(ids[i])]);
    }
    r.history.push_back(token);
    ++r.generated;
    const auto now = Clock::now();
    auto& pv = per_variant[r.variant];
    if (!r.got_token) {
      r.got_token = true;
      r.first_token = now;
      push_sample(pv.ttft_s, seconds(now - r.submitted));
    } else {
      push_sample(pv.itl_s, seconds(now - r.last_token));
    }
    r.last_token = now;
    const std::string text = r.checker->push(token, r.decoder->push(token));
    r.next_input = token;
    auto self = r.shared_from_this();
    after.push_back([self, t, text] {
      self->deliver([&] {
        if (self->cb.on_token) self->cb.on_token(t, text);
      });
    });
  }

  // One forward step over decode rows first, then prefill chunks, up to max_batch_tokens rows.
  // Returns false if there was nothing to run.
  bool step(std::unique_lock<std::mutex>& lock, std::vector<std::function<void()>>& after) {
    std::vector<ForwardRow> rows;
    struct Use {
      Request* r;
      size_t first_row, count;
      bool decode;
    };
    std::vector<Use> uses;
    size_t budget = opt.max_batch_tokens;
    for (auto& rp : running) {
      Request& r = *rp;
      if (r.prefilled < r.req.prompt.size() || budget == 0) continue;
      uses.push_back({&r, rows.size(), 1, true});
      rows.push_back({r.seq.get(), r.next_input, true});
      --budget;
    }
    for (auto& rp : running) {
      Request& r = *rp;
      if (r.leader && !r.leader->seq) r.leader.reset();  // it was cancelled: prefill alone
      if (r.leader || r.prefilled >= r.req.prompt.size() || budget == 0) continue;
      const size_t n = std::min(budget, r.req.prompt.size() - r.prefilled);
      uses.push_back({&r, rows.size(), n, false});
      for (size_t i = 0; i < n; ++i) {
        const size_t pos = r.prefilled + i;
        const bool last = pos + 1 == r.req.prompt.size();
        rows.push_back({r.seq.get(), r.req.prompt[pos], last || r.req.prompt_logprobs});
      }
      budget -= n;
    }
    if (rows.empty()) return false;
    std::vector<int> ids;
    for (const auto& u : uses) ids.push_back(u.r->model_id);
    std::sort(ids.begin(), ids.end());
    const size_t distinct = size_t(std::unique(ids.begin(), ids.end()) - ids.begin());

    // The model belongs to this thread: submit(), metrics() and the API need not wait for a step.
    lock.unlock();
    std::vector<float> logits;
    std::exception_ptr error;
    try {
      logits = model.forward(rows);  // throws only on a bug: rows were validated at submit
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    if (error) std::rethrow_exception(error);

    ++m.steps;
    if (distinct > 1) ++m.mixed_steps;
    for (const auto& u : uses)
      if (!u.decode) m.prompt_tokens_run += u.count;
    m.max_variants_in_step = std::max<uint64_t>(m.max_variants_in_step, distinct);
    const size_t V = model.config().vocab_size;
    size_t at = 0;  // index into logits rows (only rows with want_logits have one)
    for (const auto& u : uses) {
      Request& r = *u.r;
      if (u.decode) {
        emit_token(r, &logits[at * V], after);
        ++at;
        continue;
      }
      const size_t begin = r.prefilled;
      r.prefilled += u.count;
      const bool finished_prompt = r.prefilled == r.req.prompt.size();
      if (r.req.prompt_logprobs) {
        for (size_t i = 0; i < u.count; ++i) {
          const size_t pos = begin + i;
          if (pos + 1 < r.req.prompt.size()) {
            const auto lp = log_softmax(std::span(&logits[(at + i) * V], V));
            r.prompt_lp.push_back(lp[size_t(r.req.prompt[pos + 1])]);
          }
        }
        if (finished_prompt) {
          auto self = r.shared_from_this();
          auto values = r.prompt_lp;
          after.push_back([self, values] {
            self->deliver([&] {
              if (self->cb.on_prompt_logprobs) self->cb.on_prompt_logprobs(values);
            });
          });
        }
        at += u.count;
        if (finished_prompt) {
          emit_token(r, &logits[(at - 1) * V], after);
          start_followers(r, &logits[(at - 1) * V], after);
        }
      } else if (finished_prompt) {
        emit_token(r, &logits[at * V], after);
        start_followers(r, &logits[at * V], after);
        ++at;
      }
    }
    // Requests that stopped, or have no room left, finish now.
    for (auto& rp : running) {
      Request& r = *rp;
      if (!r.checker || r.prefilled < r.req.prompt.size() || r.generated == 0) continue;
      if (!r.checker->done() && r.seq->length < model.config().max_position) continue;
      const std::string tail = r.checker->finish(r.decoder->finish());
      if (!tail.empty()) {
        auto self = r.shared_from_this();
        after.push_back([self, tail] {
          self->deliver([&] {
            if (self->cb.on_token) self->cb.on_token(TokenLogprob{-1, 0, {}}, tail);
          });
        });
      }
      finish_request(r, r.checker->reason(), after);
    }
    return true;
  }

  // --- kept caches ---------------------------------------------------------------------------

  // A finished request's cache joins the kept ones (or is freed): its positions hold its prompt and
  // every generated token but the last.
  void keep_cache(Request& r) {
    std::unique_ptr<Sequence> seq = std::move(r.seq);
    if (!seq || opt.prefix_cache_bytes == 0 || seq->length < kMinPrefix) return;
    std::vector<int32_t> tokens(r.history.begin(),
                                r.history.begin() + long(std::min(seq->length, r.history.size())));
    const auto starts = [](const std::vector<int32_t>& a, const std::vector<int32_t>& prefix) {
      return prefix.size() <= a.size() && std::equal(prefix.begin(), prefix.end(), a.begin());
    };
    for (auto it = kept.begin(); it != kept.end();) {
      if (it->model_id == r.model_id && starts(it->tokens, tokens)) {  // already kept, or more
        it->last_use = ++use_clock;
        return;
      }
      if (it->model_id == r.model_id && starts(tokens, it->tokens)) {  // this one holds it all
        kept_bytes -= it->bytes;
        it = kept.erase(it);
      } else {
        ++it;
      }
    }
    const uint64_t bytes = model.sequence_bytes(*seq);
    if (bytes > opt.prefix_cache_bytes) return;
    kept.push_back({r.model_id, std::move(tokens), std::move(seq), bytes, ++use_clock});
    kept_bytes += bytes;
    while (kept_bytes > opt.prefix_cache_bytes) {
      auto oldest = std::min_element(kept.begin(), kept.end(), [](const auto& a, const auto& b) {
        return a.last_use < b.last_use;
      });
      kept_bytes -= oldest->bytes;
      kept.erase(oldest);
    }
  }

  // Starts r from the kept cache that shares the longest beginning with its prompt, if that is
  // kMinPrefix tokens or more; its last prompt token always runs (its logits give the first token).
  void start_from_kept(Request& r) {
    if (r.req.prompt_logprobs) return;  // those need every prompt token run
    KeptCache* best = nullptr;
    size_t best_len = 0;
    for (auto& k : kept) {
      if (k.model_id != r.model_id) continue;
      const size_t n = std::min(k.tokens.size(), r.req.prompt.size() - 1);
      const size_t common = size_t(
          std::mismatch(k.tokens.begin(), k.tokens.begin() + long(n), r.req.prompt.begin()).first -
          k.tokens.begin());
      if (common > best_len) {
        best = &k;
        best_len = common;
      }
    }
    if (!best || best_len < kMinPrefix) return;
    try {
      r.seq = std::make_unique<Sequence>(model.fork_sequence(*best->seq, best_len));
    } catch (const std::exception& e) {
      // No memory for the copy (a GPU allocation): the kept caches go, and it prefills as usual.
      std::fprintf(stderr, "[engine] prefilling in full: copying a kept cache failed (%s)\n",
                   e.what());
      drop_all_kept();
      return;
    }
    r.prefilled = best_len;
    best->last_use = ++use_clock;
    m.prompt_tokens_cached += best_len;
  }

  void drop_all_kept() {
    kept.clear();
    kept_bytes = 0;
  }

  void drop_kept(int model_id) {
    for (auto it = kept.begin(); it != kept.end();)
      if (it->model_id == model_id) {
        kept_bytes -= it->bytes;
        it = kept.erase(it);
      } else {
        ++it;
      }
  }

  // The requests waiting for `leader`'s prompt, now that it is in: each continues from a copy of
  // its sequence, with its prompt logprobs if asked for, and samples its first token from `logits`.
  void start_followers(Request& leader, const float* logits,
                       std::vector<std::function<void()>>& after) {
    for (auto& fp : running) {
      Request& f = *fp;
      if (f.leader.get() != &leader) continue;
      f.leader.reset();
      try {
        f.seq = std::make_unique<Sequence>(model.fork_sequence(*leader.seq));
      } catch (const std::exception& e) {
        // No memory for the copy (a GPU allocation): it prefills the prompt itself instead.
        std::fprintf(stderr, "[engine] a sequence prefills alone: copying a cache failed (%s)\n",
                     e.what());
        drop_all_kept();
        continue;
      }
      f.prefilled = f.req.prompt.size();
      m.prompt_tokens_shared += f.req.prompt.size();
      if (f.req.prompt_logprobs) {
        f.prompt_lp = leader.prompt_lp;
        auto self = f.shared_from_this();
        auto values = f.prompt_lp;
        after.push_back([self, values] {
          self->deliver([&] {
            if (self->cb.on_prompt_logprobs) self->cb.on_prompt_logprobs(values);
          });
        });
      }
      emit_token(f, logits, after);
    }
  }

  void admit(std::vector<std::function<void()>>& after) {
    while (!queued.empty() && running.size() < opt.max_running) {
      auto r = queued.front();
      queued.pop_front();
      if (r->is_cancelled()) {
        if (auto it = variants.find(r->variant); it != variants.end()) --it->second.active;
        r->done = true;
        continue;
      }
      try {
        r->seq = std::make_unique<Sequence>(model.new_sequence(r->model_id));
        r->sampler = std::make_unique<Sampler>(r->req.sampling);
        StopConditions stop = r->req.stop;
        if (r->req.stop_at_eos)
          stop.stop_ids.insert(stop.stop_ids.end(), tokenizer.eos_ids().begin(), tokenizer.eos_ids().end());
        r->checker = std::make_unique<StopChecker>(std::move(stop));
        r->decoder = std::make_unique<StreamDecoder>(tokenizer);
        r->history = r->req.prompt;
        r->first_step = Clock::now();
        for (const auto& other : running)
          if (!other->leader && other->model_id == r->model_id &&
              other->prefilled < other->req.prompt.size() &&
              other->req.prompt_logprobs == r->req.prompt_logprobs &&
              other->req.prompt == r->req.prompt) {
            r->leader = other;
            break;
          }
        if (!r->leader) start_from_kept(*r);
        running.push_back(r);
      } catch (const std::exception& e) {
        const std::string msg = e.what();
        if (auto it = variants.find(r->variant); it != variants.end()) --it->second.active;
        after.push_back([r, msg] {
          r->deliver([&] {
            if (r->cb.on_error) r->cb.on_error(msg, 500);
          });
          r->done = true;
        });
      }
    }
  }

  void loop() {
    for (;;) {
      std::vector<std::function<void()>> after;  // callbacks, run without the engine mutex
      {
        std::unique_lock lock(mutex);
        cv.wait_for(lock, std::chrono::milliseconds(50), [&] {
          // Loads notify when they finish; blocked loads are retried at least every 50 ms.
          return stopping || load_finished || !incoming.empty() || !running.empty() || !queued.empty() ||
                 !removed_model_ids.empty();
        });
        if (stopping) break;
        while (!incoming.empty()) {
          route(incoming.front(), after);
          incoming.pop_front();
        }
        load_finished = false;
        for (int id : removed_model_ids) {
          drop_kept(id);
          model.remove_variant(id);
        }
        removed_model_ids.clear();
        finish_loads(after);
        // Cancelled requests leave now: their KV cache is freed and no callback follows.
        for (auto it = running.begin(); it != running.end();) {
          if ((*it)->is_cancelled()) {
            if (auto v = variants.find((*it)->variant); v != variants.end()) --v->second.active;
            (*it)->seq.reset();
            (*it)->done = true;
            it = running.erase(it);
          } else {
            ++it;
          }
        }
        admit(after);
        retry_blocked_loads();
        try {
          step(lock, after);
        } catch (const std::exception& e) {  // a bug, not a client's fault: fail the running requests
          const std::string msg = std::string("internal error: ") + e.what();
          for (auto& r : running) {
            if (auto v = variants.find(r->variant); v != variants.end()) --v->second.active;
            after.push_back([r, msg] {
              r->deliver([&] {
                if (r->cb.on_error) r->cb.on_error(msg, 500);
              });
              r->done = true;
            });
          }
          running.clear();
        }
        running.erase(std::remove_if(running.begin(), running.end(), [](auto& r) { return !r->seq; }), running.end());
        m.running = running.size();  // queue_length is counted when metrics() is asked
      }
      for (auto& f : after) f();
      // Finished loader threads are joined here, outside the mutex they last took.
      for (auto it = loaders.begin(); it != loaders.end();) {
        if (*it->done) {
          it->thread.join();
          it = loaders.erase(it);
        } else {
          ++it;
        }
      }
    }
    // Stopping: everyone still here gets an error.
    std::vector<std::shared_ptr<Request>> left(running.begin(), running.end());
    left.insert(left.end(), queued.begin(), queued.end());
    left.insert(left.end(), incoming.begin(), incoming.end());
    for (auto& [_, v] : variants) left.insert(left.end(), v.waiting_load.begin(), v.waiting_load.end());
    for (auto& r : left) {
      r->deliver([&] {
        if (r->cb.on_error) r->cb.on_error("the server is shutting down", 503);
      });
      r->done = true;
    }
  }
};

// ---------------------------------------------------------------------------------------------

Engine::Engine(const fs::path& base_dir, EngineOptions options)
    : impl_(std::make_unique<Impl>(base_dir, std::move(options))) {
  impl_->thread = std::thread([this] { impl_->loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  impl_->thread.join();
  for (auto& l : impl_->loaders) l.thread.join();
}

const Tokenizer& Engine::tokenizer() const { return impl_->tokenizer; }
const ModelConfig& Engine::config() const { return impl_->model.config(); }
const fs::path& Engine::base_dir() const { return impl_->base_dir; }
const EngineOptions& Engine::options() const { return impl_->opt; }

void Engine::add_variant(const std::string& name, const fs::path& delta_path, bool load_now) {
  if (name.empty()) fail("a variant needs a name");
  if (!fs::is_regular_file(delta_path)) fail(delta_path.string(), ": no such delta file");
  std::lock_guard lock(impl_->mutex);
  if (name == impl_->opt.base_name || impl_->variants.count(name)) fail("a model named '", name, "' already exists");
  auto& v = impl_->variants[name];
  v.name = name;
  v.path = delta_path;
  v.pinned = std::find(impl_->opt.pinned.begin(), impl_->opt.pinned.end(), name) != impl_->opt.pinned.end();
  impl_->per_variant[name].name = name;
  v.load_requested = load_now;  // the engine thread starts it when it fits
  impl_->cv.notify_all();
}

void Engine::remove_variant(const std::string& name) {
  std::lock_guard lock(impl_->mutex);
  auto it = impl_->variants.find(name);
  if (it == impl_->variants.end()) fail("no variant named '", name, "'");
  auto& v = it->second;
  if (v.active > 0 || v.state == "loading") fail("variant '", name, "' is in use (", v.active, " requests)");
  if (v.model_id > 0) impl_->removed_model_ids.push_back(v.model_id);  // the engine thread drops it
  impl_->variants.erase(it);
  impl_->cv.notify_all();
}

std::vector<VariantStatus> Engine::variants() const {
  std::lock_guard lock(impl_->mutex);
  const auto now = Clock::now();
  std::vector<VariantStatus> out;
  const auto& base = impl_->per_variant.at(impl_->opt.base_name);
  out.push_back({impl_->opt.base_name, "", "base", "", 0, true, 0, base.requests});
  for (const auto& [name, v] : impl_->variants)
    out.push_back({name, v.path.string(), v.state, v.last_error, v.state == "resident" ? v.bytes : 0, v.pinned,
                   impl_->decayed_rate(v, now), v.requests});
  return out;
}

std::shared_ptr<RequestHandle> Engine::submit(GenerationRequest request, GenerationCallbacks callbacks) {
  std::vector<GenerationRequest> requests;
  std::vector<GenerationCallbacks> cbs;
  requests.push_back(std::move(request));
  cbs.push_back(std::move(callbacks));
  return submit_all(std::move(requests), std::move(cbs)).front();
}

std::vector<std::shared_ptr<RequestHandle>> Engine::submit_all(
    std::vector<GenerationRequest> requests, std::vector<GenerationCallbacks> callbacks) {
  using K = EngineError::Kind;
  const auto& c = impl_->model.config();
  if (requests.empty() || requests.size() != callbacks.size())
    throw EngineError(K::BadRequest, "submit_all: one set of callbacks per request");
  std::vector<std::shared_ptr<Request>> made;
  for (size_t i = 0; i < requests.size(); ++i) {
    GenerationRequest& request = requests[i];
    if (request.prompt.empty()) throw EngineError(K::BadRequest, "the prompt is empty");
    for (int32_t t : request.prompt)
      if (t < 0 || uint64_t(t) >= c.vocab_size)
        throw EngineError(K::BadRequest, str("prompt token id ", t, " is outside the vocabulary (",
                                             c.vocab_size, ")"));
    if (request.prompt.size() >= c.max_position)
      throw EngineError(K::BadRequest,
                        str("the prompt has ", request.prompt.size(),
                            " tokens; this model takes at most ", c.max_position - 1));
    if (request.top_logprobs > 20)
      throw EngineError(K::BadRequest, "top_logprobs must be at most 20");
    try {
      request.sampling.validate();
      StopChecker check(request.stop);  // validates stop strings
    } catch (const Error& e) {
      throw EngineError(K::BadRequest, e.what());
    }
    auto r = std::make_shared<Request>();
    r->req = std::move(request);
    r->cb = std::move(callbacks[i]);
    r->variant = r->req.model;
    r->submitted = Clock::now();
    Impl* impl = impl_.get();
    r->wake = [impl] { impl->cv.notify_all(); };
    made.push_back(std::move(r));
  }
  std::lock_guard lock(impl_->mutex);
  for (const auto& r : made)
    if (r->variant != impl_->opt.base_name && !impl_->variants.count(r->variant))
      throw EngineError(K::UnknownModel, "model '" + r->variant + "' does not exist");
  size_t waiting = impl_->incoming.size() + impl_->queued.size();
  for (const auto& [_, v] : impl_->variants) waiting += v.waiting_load.size();
  if (waiting + made.size() > impl_->opt.max_queue)
    throw EngineError(K::QueueFull, str("the queue is full (", impl_->opt.max_queue,
                                        " requests waiting at most, ", waiting, " now)"));
  for (const auto& r : made) {
    auto& pv = impl_->per_variant[r->variant];
    ++pv.requests;
    if (auto it = impl_->variants.find(r->variant); it != impl_->variants.end()) {
      impl_->note_request(it->second, r->submitted);
      ++it->second.active;
    }
    impl_->incoming.push_back(r);
  }
  impl_->cv.notify_all();
  return {made.begin(), made.end()};
}

EngineMetrics Engine::metrics() const {
  std::lock_guard lock(impl_->mutex);
  EngineMetrics out = impl_->m;
  out.prefix_cache_bytes = impl_->kept_bytes;
  out.prefix_cache_entries = impl_->kept.size();
  out.queue_length = impl_->queued.size() + impl_->incoming.size();
  for (const auto& [_, v] : impl_->variants) out.queue_length += v.waiting_load.size();
  out.cache_resident_bytes = 0;
  for (const auto& [_, v] : impl_->variants)
    if (v.state == "resident") out.cache_resident_bytes += v.bytes;
  for (const auto& [_, pv] : impl_->per_variant) out.variants.push_back(pv);
  return out;
}

}  // namespace bitdelta
