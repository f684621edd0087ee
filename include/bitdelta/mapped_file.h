// Read-only memory mapping of a whole file (RAII).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <filesystem>
#include <mutex>
#include <span>

namespace bitdelta {

// Asks the kernel to read a whole file into the page cache, front to back, before it is mapped:
// on a cold file that runs at the disk's sequential speed, where faulting the pages of a mapping in
// a scattered order (validating each α) runs at a fraction of it; on a cached file it costs nothing
// (no copy). Returns at once; later page faults wait for the reads. Throws Error if it cannot open.
void prefetch_file(const std::filesystem::path& path);

// Drops the whole pages inside `bytes` (part of a read-only file mapping) from this process's
// resident memory: for data that has been copied elsewhere. The page cache keeps them as it sees
// fit; a later access reads them back, with the same contents.
void release_pages(std::span<const std::byte> bytes);

// Reads the pages of `bytes` (part of a file mapping) into memory front to back and maps them
// (madvise MADV_POPULATE_READ; where the kernel lacks it, one read per page), so that later
// accesses neither fault nor wait for the disk. Blocks until done; advice only, never throws.
void populate_pages(std::span<const std::byte> bytes);

// Pages a mapping in front to back, a chunk at a time (populate_pages), on the thread that calls
// run(), while other threads wait for just the part they need: a loader copies a file's first
// tensors while the disk still reads the rest, where populating the whole file first puts the copy
// after the read. Waiting only orders the work: any access is correct at any time (an access
// ahead of the pager faults its page in itself).
class SequentialPager {
 public:
  explicit SequentialPager(std::span<const std::byte> bytes, size_t chunk_bytes = size_t(16) << 20);
  SequentialPager(const SequentialPager&) = delete;
  SequentialPager& operator=(const SequentialPager&) = delete;

  // Pages the whole span in, front to back, and publishes the progress after each chunk. Returns
  // early after stop(). Never throws.
  void run();
  // Returns once every byte of [p, p + n) that lies in the span has been paged in (at once for
  // bytes outside it), or once stop() has been called.
  void wait_for(const void* p, size_t n);
  // Ends run() after its current chunk and releases every waiter: for a loader that has failed.
  void stop();
  // Bytes from the front of the span paged in so far.
  size_t done() const;

 private:
  std::span<const std::byte> bytes_;
  size_t chunk_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  size_t done_ = 0;
  bool stopped_ = false;
};

class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  ~MappedFile();

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

  // Copies [offset, offset+len) into dst with pread: for streaming a file once, this costs less
  // than faulting its pages into the mapping.
  void read(size_t offset, size_t len, std::byte* dst) const;

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace bitdelta
