// safetensors files: a validating zero-copy reader over mmap, and a streaming writer that
// renames its temp file into place only when complete.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "bitdelta/mapped_file.h"
#include "bitdelta/tensor.h"

namespace bitdelta {

using Metadata = std::map<std::string, std::string>;

struct TensorInfo {
  std::string name;
  DType dtype = DType::U8;
  Shape shape;
  uint64_t begin = 0;  // byte offsets inside the data section
  uint64_t end = 0;
  uint64_t bytes() const { return end - begin; }
};

class SafetensorsFile {
 public:
  // Maps the file and validates its header; throws Error naming the file (and tensor) otherwise.
  explicit SafetensorsFile(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return file_.path(); }
  uint64_t file_size() const { return file_.size(); }
  std::span<const std::byte> mapped_bytes() const { return file_.bytes(); }  // the whole file
  const Metadata& metadata() const { return metadata_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // sorted by name
  const TensorInfo* find(std::string_view name) const;
  const TensorInfo& info(std::string_view name) const;  // throws if missing

  TensorView view(const TensorInfo& t) const;
  TensorView view(std::string_view name) const { return view(info(name)); }

  // Copies bytes [offset, offset+len) of one tensor's data into dst (see MappedFile::read).
  void read(const TensorInfo& t, uint64_t offset, uint64_t len, std::byte* dst) const;

 private:
  MappedFile file_;
  uint64_t data_start_ = 0;
  Metadata metadata_;
  std::vector<TensorInfo> tensors_;
};

class SafetensorsWriter {
 public:
  // Writes to a temp file beside `path`; nothing appears at `path` until finish().
  SafetensorsWriter(std::filesystem::path path, Metadata metadata);
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  ~SafetensorsWriter();  // removes the temp file unless finish() succeeded

  // Declares the next tensor; tensors lie in the data section in declaration order. Returns its
  // index (for write_at).
  size_t add(std::string name, DType dtype, Shape shape);
  // Writes the header; call after the last add().
  void begin();
  // Appends bytes of the current tensor(s), in declaration order, in chunks of any size.
  void write(std::span<const std::byte> bytes);
  // Or: writes bytes of tensor `index` at `offset` within it, in any order (a writer takes one form
  // or the other). Each byte of each tensor once.
  void write_at(size_t index, uint64_t offset, std::span<const std::byte> bytes);
  // Checks every declared byte arrived, flushes, closes and renames into place (atomic: readers
  // see the old file or the complete new one, never a partial one).
  void finish();

  const std::filesystem::path& path() const { return path_; }
  uint64_t bytes_written() const { return offset_; }

 private:
  struct Output;
  std::filesystem::path path_, temp_path_;
  Metadata metadata_;
  std::vector<TensorInfo> tensors_;
  std::unique_ptr<Output> out_;
  uint64_t header_bytes_ = 0;
  uint64_t offset_ = 0;  // into the data section
  size_t current_ = 0;
  std::vector<uint64_t> placed_;  // write_at: bytes written per tensor (empty: write's form)
  bool finished_ = false;
};

}  // namespace bitdelta
