// Read-only memory mapping of a whole file (RAII).
#pragma once

#include <cstddef>
#include <filesystem>
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
