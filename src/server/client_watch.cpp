// httplib (0.11) passes a handler the request's addresses but not its socket. The socket is found
// once among the process's open descriptors by those addresses: a TCP connection's (local, remote)
// pair names one socket. It stays open, and ours, until the handler returns.
#include "server/client_watch.h"

#include <dirent.h>
#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace bitdelta::server {

namespace {

// The numeric host and port of a socket address, as httplib writes them into a Request.
bool host_port(const sockaddr_storage& a, socklen_t len, std::string& host, int& port) {
  char h[NI_MAXHOST], p[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&a), len, h, sizeof h, p, sizeof p,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return false;
  host = h, port = std::atoi(p);
  return true;
}

int find_socket(const httplib::Request& req) {
  DIR* dir = ::opendir("/proc/self/fd");
  if (!dir) return -1;
  int found = -1;
  while (const dirent* e = ::readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == ::dirfd(dir)) continue;
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    std::string host;
    int port = -1;
    if (::getpeername(int(fd), reinterpret_cast<sockaddr*>(&a), &len) != 0) continue;  // no peer
    if (!host_port(a, len, host, port) || port != req.remote_port || host != req.remote_addr)
      continue;
    len = sizeof a;
    if (::getsockname(int(fd), reinterpret_cast<sockaddr*>(&a), &len) != 0) continue;
    if (!host_port(a, len, host, port) || port != req.local_port || host != req.local_addr)
      continue;
    found = int(fd);
    break;
  }
  ::closedir(dir);
  return found;
}

}  // namespace

bool ClientWatch::gone() {
  if (fd_ == -1) return false;
  if (fd_ == -2) {
    if (std::chrono::steady_clock::now() - start_ < kLookAfter) return false;
    fd_ = find_socket(req_);
    if (fd_ < 0) return false;
  }
  // The client has sent its whole request: anything the socket says now is a hang-up (end of
  // stream, a reset), or the next request of a pipelining client, which leaves it waiting.
  pollfd p{fd_, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) return true;
  char c;
  return (p.revents & POLLIN) && ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

}  // namespace bitdelta::server
