#include "bitdelta/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include "bitdelta/error.h"

namespace bitdelta {

void prefetch_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path.string(), ": cannot open: ", std::strerror(errno));
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_WILLNEED);
  ::close(fd);
}

void release_pages(std::span<const std::byte> bytes) {
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(bytes.data()) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(bytes.data()) + bytes.size()) / page * page;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);  // advice only
}

void populate_pages(std::span<const std::byte> bytes) {
#ifndef MADV_POPULATE_READ
  constexpr int MADV_POPULATE_READ = 22;  // Linux 5.14
#endif
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(bytes.data()) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(bytes.data()) + bytes.size();
  if (end <= begin) return;
  if (::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_READ) == 0) return;
  volatile const std::byte* p = bytes.data();
  for (size_t i = 0; i < bytes.size(); i += page) (void)p[i];
}

SequentialPager::SequentialPager(std::span<const std::byte> bytes, size_t chunk_bytes)
    : bytes_(bytes), chunk_(chunk_bytes > 0 ? chunk_bytes : 1) {}

void SequentialPager::run() {
  for (size_t at = 0; at < bytes_.size();) {
    {
      std::lock_guard lock(mu_);
      if (stopped_) return;
    }
    const size_t n = std::min(chunk_, bytes_.size() - at);
    populate_pages(bytes_.subspan(at, n));
    at += n;
    {
      std::lock_guard lock(mu_);
      done_ = at;
    }
    cv_.notify_all();
  }
}

void SequentialPager::wait_for(const void* p, size_t n) {
  const auto begin = reinterpret_cast<uintptr_t>(bytes_.data());
  const auto at = reinterpret_cast<uintptr_t>(p);
  if (n == 0 || at >= begin + bytes_.size() || at + n <= begin) return;
  const size_t need = std::min(size_t(at + n - begin), bytes_.size());
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return stopped_ || done_ >= need; });
}

void SequentialPager::stop() {
  {
    std::lock_guard lock(mu_);
    stopped_ = true;
  }
  cv_.notify_all();
}

size_t SequentialPager::done() const {
  std::lock_guard lock(mu_);
  return done_;
}

MappedFile::MappedFile(const std::filesystem::path& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path.string(), ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    fail(path.string(), ": cannot stat: ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path.string(), ": not a regular file");
  }
  size_ = size_t(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      fail(path.string(), ": cannot mmap: ", std::strerror(err));
    }
    data_ = static_cast<std::byte*>(p);
  }
  fd_ = fd;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (data_) ::munmap(data_, size_);
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(data_, size_);
  if (fd_ >= 0) ::close(fd_);
}

void MappedFile::read(size_t offset, size_t len, std::byte* dst) const {
  if (offset > size_ || len > size_ - offset) fail(path_.string(), ": read past the end of the file");
  while (len > 0) {
    const ssize_t n = ::pread(fd_, dst, len, off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(path_.string(), ": read failed at offset ", offset, ": ", n < 0 ? std::strerror(errno) : "unexpected end of file");
    dst += n;
    offset += size_t(n);
    len -= size_t(n);
  }
}

}  // namespace bitdelta
