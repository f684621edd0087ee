// Prometheus text exposition of the engine's counters and latency samples, plus the server's own
// HTTP counters.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "bitdelta/engine.h"

namespace bitdelta::server {

// Responses by route and status, counted by the HTTP layer.
class HttpCounters {
 public:
  void count(const std::string& route, int status);
  std::map<std::pair<std::string, int>, uint64_t> snapshot() const;

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int>, uint64_t> counts_;
};

// The whole /metrics page (text format 0.0.4).
std::string render_metrics(const EngineMetrics& metrics, const std::vector<VariantStatus>& variants,
                           const HttpCounters& http);

}  // namespace bitdelta::server
