// Whether the client of a request still waits for its answer, for handlers that wait on the engine
// before writing anything (a non-streaming generation; a stream before its first event).
#pragma once

#include <chrono>

namespace httplib {
struct Request;
}

namespace bitdelta::server {

class ClientWatch {
 public:
  explicit ClientWatch(const httplib::Request& req) : req_(req) {}

  // True once the client has closed its end of the connection or reset it: nobody will read the
  // answer. Checked from kLookAfter on (a short request never pays for finding its socket); false
  // where the socket cannot be found.
  bool gone();

  static constexpr auto kLookAfter = std::chrono::milliseconds(50);

 private:
  const httplib::Request& req_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  int fd_ = -2;  // the connection's socket; -2: not looked for yet, -1: not found
};

}  // namespace bitdelta::server
