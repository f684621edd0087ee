// Errors: one exception type carrying a message that names what was wrong (file, tensor, field).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace bitdelta {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Concatenates anything streamable into one string: str("tensor ", name, " has ", n, " rows").
template <typename... Args>
std::string str(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

template <typename... Args>
[[noreturn]] void fail(Args&&... args) {
  throw Error(str(std::forward<Args>(args)...));
}

}  // namespace bitdelta
