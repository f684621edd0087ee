#include "server/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace bitdelta::server {

namespace {

// Bucket bounds in seconds; the engine keeps raw samples and we bucket them per scrape.
const std::vector<double> kTtftBuckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                          1,     2.5,  5,     10,   30,  60};
const std::vector<double> kItlBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                         0.1,   0.25,   0.5,   1,    2.5};
const std::vector<double> kE2eBuckets = {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};

std::string label_value(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

std::string number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

class Page {
 public:
  void header(const std::string& name, const char* type, const char* help) {
    out_ << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n';
  }
  void sample(const std::string& name, const std::string& labels, double value) {
    out_ << name;
    if (!labels.empty()) out_ << '{' << labels << '}';
    out_ << ' ' << number(value) << '\n';
  }
  void histogram(const std::string& name, const std::string& labels,
                 const std::vector<double>& bounds, const std::vector<double>& samples) {
    std::vector<double> sorted = samples;
    std::sort(sorted.begin(), sorted.end());
    const std::string sep = labels.empty() ? "" : ",";
    for (double b : bounds) {
      const auto n = std::upper_bound(sorted.begin(), sorted.end(), b) - sorted.begin();
      sample(name + "_bucket", labels + sep + "le=\"" + number(b) + "\"", double(n));
    }
    sample(name + "_bucket", labels + sep + "le=\"+Inf\"", double(sorted.size()));
    double sum = 0;
    for (double s : sorted) sum += s;
    sample(name + "_sum", labels, sum);
    sample(name + "_count", labels, double(sorted.size()));
  }
  std::string text() const { return out_.str(); }

 private:
  std::ostringstream out_;
};

}  // namespace

void HttpCounters::count(const std::string& route, int status) {
  std::lock_guard lock(mutex_);
  ++counts_[{route, status}];
}

std::map<std::pair<std::string, int>, uint64_t> HttpCounters::snapshot() const {
  std::lock_guard lock(mutex_);
  return counts_;
}

std::string render_metrics(const EngineMetrics& m, const std::vector<VariantStatus>& variants,
                           const HttpCounters& http) {
  Page p;
  const auto per_variant = [&](const std::string& name, const char* type, const char* help,
                               auto value) {
    p.header(name, type, help);
    for (const auto& v : m.variants)
      p.sample(name, "variant=\"" + label_value(v.name) + "\"", double(value(v)));
  };
  using PV = EngineMetrics::PerVariant;
  per_variant("bitdelta_requests_total", "counter", "Requests finished or failed, per variant.",
              [](const PV& v) { return v.requests; });
  per_variant("bitdelta_request_errors_total", "counter",
              "Requests that failed after submission, per variant.",
              [](const PV& v) { return v.errors; });
  per_variant("bitdelta_prompt_tokens_total", "counter", "Prompt tokens processed, per variant.",
              [](const PV& v) { return v.prompt_tokens; });
  per_variant("bitdelta_completion_tokens_total", "counter", "Tokens generated, per variant.",
              [](const PV& v) { return v.completion_tokens; });

  const auto hist = [&](const std::string& name, const char* help,
                        const std::vector<double>& bounds, std::vector<double> PV::*samples) {
    p.header(name, "histogram", help);
    for (const auto& v : m.variants)
      p.histogram(name, "variant=\"" + label_value(v.name) + "\"", bounds, v.*samples);
  };
  hist("bitdelta_time_to_first_token_seconds", "Time from arrival to the first generated token.",
       kTtftBuckets, &PV::ttft_s);
  hist("bitdelta_inter_token_latency_seconds", "Time between consecutive generated tokens.",
       kItlBuckets, &PV::itl_s);
  hist("bitdelta_e2e_request_latency_seconds", "Time from arrival to the last token.", kE2eBuckets,
       &PV::e2e_s);

  const auto scalar = [&](const char* name, const char* type, const char* help, double value) {
    p.header(name, type, help);
    p.sample(name, "", value);
  };
  scalar("bitdelta_queue_length", "gauge", "Requests waiting to start.", double(m.queue_length));
  scalar("bitdelta_running_sequences", "gauge", "Sequences in the running batch.",
         double(m.running));
  scalar("bitdelta_steps_total", "counter", "Forward steps run.", double(m.steps));
  scalar("bitdelta_mixed_variant_steps_total", "counter",
         "Steps whose rows came from two or more variants.", double(m.mixed_steps));
  scalar("bitdelta_max_variants_in_step", "gauge", "Most distinct variants seen in one step.",
         double(m.max_variants_in_step));
  scalar("bitdelta_prompt_tokens_run_total", "counter", "Prompt tokens run through the model.",
         double(m.prompt_tokens_run));
  scalar("bitdelta_prompt_tokens_shared_total", "counter",
         "Prompt tokens taken from another sequence's prefill of the same prompt.",
         double(m.prompt_tokens_shared));
  scalar("bitdelta_prompt_tokens_cached_total", "counter",
         "Prompt tokens a sequence started with, from the kept cache of an earlier one.",
         double(m.prompt_tokens_cached));
  scalar("bitdelta_prefix_cache_bytes", "gauge", "Memory of the kept caches of finished sequences.",
         double(m.prefix_cache_bytes));
  scalar("bitdelta_prefix_cache_entries", "gauge", "Kept caches of finished sequences.",
         double(m.prefix_cache_entries));
  scalar("bitdelta_delta_cache_hits_total", "counter", "Requests whose delta was resident.",
         double(m.cache_hits));
  scalar("bitdelta_delta_cache_misses_total", "counter", "Requests whose delta was not resident.",
         double(m.cache_misses));
  scalar("bitdelta_delta_cache_loads_total", "counter", "Delta loads started.",
         double(m.cache_loads));
  scalar("bitdelta_delta_cache_load_failures_total", "counter", "Delta loads that failed.",
         double(m.cache_load_failures));
  scalar("bitdelta_delta_cache_load_seconds_total", "counter", "Time spent loading deltas.",
         m.cache_load_seconds);
  scalar("bitdelta_delta_cache_host_hits_total", "counter",
         "Device loads served from the pinned host tier (no file read).", double(m.cache_host_hits));
  scalar("bitdelta_delta_cache_evictions_total", "counter",
         "Deltas evicted to stay within the budget.", double(m.cache_evictions));
  scalar("bitdelta_delta_cache_resident_bytes", "gauge", "Bytes of resident deltas.",
         double(m.cache_resident_bytes));
  scalar("bitdelta_delta_cache_budget_bytes", "gauge",
         "Byte budget of the delta cache (0: unlimited).", double(m.cache_budget_bytes));

  p.header("bitdelta_variant_info", "gauge",
           "1 per registered model, with its cache state and pin.");
  for (const auto& v : variants)
    p.sample("bitdelta_variant_info",
             "variant=\"" + label_value(v.name) + "\",state=\"" + label_value(v.state) +
                 "\",pinned=\"" + (v.pinned ? "true" : "false") + "\"",
             1);
  p.header("bitdelta_variant_request_rate", "gauge",
           "Decayed request rate per variant (requests/s).");
  for (const auto& v : variants)
    p.sample("bitdelta_variant_request_rate", "variant=\"" + label_value(v.name) + "\"",
             v.request_rate);

  p.header("bitdelta_http_responses_total", "counter", "HTTP responses by route and status.");
  for (const auto& [key, n] : http.snapshot())
    p.sample(
        "bitdelta_http_responses_total",
        "route=\"" + label_value(key.first) + "\",status=\"" + std::to_string(key.second) + "\"",
        double(n));
  return p.text();
}

}  // namespace bitdelta::server
