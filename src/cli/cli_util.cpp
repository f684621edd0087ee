#include "cli_util.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

namespace bitdelta::cli {

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (bytes >= 1000 && u < 4) {
    bytes /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

std::string human_seconds(double seconds) {
  long s = std::lround(std::max(0.0, seconds));
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
  else
    std::snprintf(buf, sizeof buf, "%ld:%02ld", s / 60, s % 60);
  return buf;
}

ProgressBar::ProgressBar(std::string label)
    : label_(std::move(label)), enabled_(::isatty(STDERR_FILENO)), start_(std::chrono::steady_clock::now()) {}

ProgressBar::~ProgressBar() {
  if (drawn_) std::fputc('\n', stderr);
}

void ProgressBar::update(uint64_t items_done, uint64_t items_total, uint64_t bytes_done, uint64_t bytes_total) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  const bool finished = items_done == items_total;
  if (drawn_ && !finished && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double frac = bytes_total ? double(bytes_done) / double(bytes_total) : 1.0;
  const double rate = elapsed > 0 ? double(bytes_done) / elapsed : 0;
  const double eta = rate > 0 ? double(bytes_total - bytes_done) / rate : 0;
  constexpr int kWidth = 28;
  std::string bar(size_t(kWidth), ' ');
  for (int i = 0; i < int(frac * kWidth); ++i) bar[size_t(i)] = '#';
  std::fprintf(stderr, "\r%s [%s] %3.0f%%  %llu/%llu tensors  %s/%s  %s/s  ETA %s   ", label_.c_str(), bar.c_str(),
               frac * 100, (unsigned long long)items_done, (unsigned long long)items_total,
               human_bytes(double(bytes_done)).c_str(), human_bytes(double(bytes_total)).c_str(),
               human_bytes(rate).c_str(), human_seconds(eta).c_str());
  std::fflush(stderr);
  drawn_ = true;
}

}  // namespace bitdelta::cli
