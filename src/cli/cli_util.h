// Small helpers shared by the subcommands: byte formatting and a terminal progress bar.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace bitdelta::cli {

std::string human_bytes(double bytes);      // "1.23 GB"
std::string human_seconds(double seconds);  // "1:05" or "2:03:04"

// Draws one self-overwriting line on stderr when stderr is a terminal; silent otherwise.
class ProgressBar {
 public:
  explicit ProgressBar(std::string label);
  ~ProgressBar();  // ends the line if anything was drawn
  void update(uint64_t items_done, uint64_t items_total, uint64_t bytes_done, uint64_t bytes_total);

 private:
  std::string label_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace bitdelta::cli
