// A fixed set of worker threads running parallel loops.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace bitdelta {

class ThreadPool {
 public:
  static constexpr size_t kMaxThreads = 1024;

  // threads = 0 picks the number of hardware threads. Throws Error past kMaxThreads, or if the
  // threads cannot be started.
  explicit ThreadPool(size_t threads = 0);
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool();

  size_t size() const { return workers_.size() + 1; }

  // Calls fn(begin, end) over [0, n) split into one contiguous chunk per thread (the caller's
  // thread takes one). Returns when all chunks are done; rethrows the first exception.
  void parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn);

 private:
  void worker_loop(size_t index);
  void stop_workers();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(size_t, size_t)>* job_ = nullptr;
  size_t job_n_ = 0;
  size_t generation_ = 0;
  size_t pending_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
};

}  // namespace bitdelta
