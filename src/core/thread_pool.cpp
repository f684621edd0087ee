#include "bitdelta/thread_pool.h"

#include <algorithm>
#include <system_error>

#include "bitdelta/error.h"

namespace bitdelta {

ThreadPool::ThreadPool(size_t threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  // Every parallel loop wakes every thread: 100000 of them on two cores never finished a step.
  if (threads > kMaxThreads)
    fail(threads, " compute threads asked for; at most ", kMaxThreads, " (this machine has ",
         std::thread::hardware_concurrency(), ")");
  try {
    for (size_t i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  } catch (const std::system_error& e) {
    stop_workers();  // joinable threads must not be destroyed
    fail("cannot start ", threads, " compute threads: ", e.what());
  }
}

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::stop_workers() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

static void run_chunk(const std::function<void(size_t, size_t)>& fn, size_t n, size_t index,
                      size_t parts) {
  size_t begin = n * index / parts, end = n * (index + 1) / parts;
  if (begin < end) fn(begin, end);
}

void ThreadPool::worker_loop(size_t index) {
  size_t seen = 0;
  for (;;) {
    std::unique_lock lock(mutex_);
    wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
    if (stopping_) return;
    seen = generation_;
    const auto* job = job_;
    size_t n = job_n_;
    lock.unlock();
    std::exception_ptr err;
    try {
      run_chunk(*job, n, index, size());
    } catch (...) {
      err = std::current_exception();
    }
    lock.lock();
    if (err && !error_) error_ = err;
    if (--pending_ == 0) done_.notify_all();
  }
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn) {
  if (workers_.empty() || n <= 1) {
    if (n) fn(0, n);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    job_ = &fn;
    job_n_ = n;
    pending_ = workers_.size();
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  std::exception_ptr err;
  try {
    run_chunk(fn, n, 0, size());
  } catch (...) {
    err = std::current_exception();
  }
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return pending_ == 0; });
  if (!err) err = error_;
  job_ = nullptr;
  if (err) std::rethrow_exception(err);
}

}  // namespace bitdelta
